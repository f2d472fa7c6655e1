"""Signals that reach a worker while it is still starting (importing asyncio, ZeroMQ, the
engines: a quarter of a second idle, seconds on a busy machine). actors.boot holds them and
asks for the parent-death SIGCONT before any of that, so nothing is left behind:

- a SIGTERM to the whole process group (the supervisor in a script without a handler dies of
  it) is answered once the worker is ready: it cleans up after the dead supervisor;
- a worker stopped that early, whose supervisor is then killed, wakes up and goes.

The workers of these tests load a ``sitecustomize`` (on their PYTHONPATH only) that makes the
import of ``rollfleet.actors.worker`` take seconds, after saying so in a marker file: the
window is then wide and known.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from ..helpers import wait_until, worker_children
from .helpers import alive

pytestmark = pytest.mark.usefixtures("no_leaks")

SLOW_IMPORT_S = 3.0

HOOK = textwrap.dedent(f"""
    import os
    import sys
    import time

    if "ROLLFLEET_WORKER_CONFIG" in os.environ and "SLOW_IMPORT_DIR" in os.environ:
        class SlowWorkerImport:
            def find_spec(self, name, path=None, target=None):
                if name == "rollfleet.actors.worker":
                    marker = os.path.join(os.environ["SLOW_IMPORT_DIR"], f"importing-{{os.getpid()}}")
                    open(marker, "w").close()
                    time.sleep(float(os.environ.get("SLOW_IMPORT_S", {SLOW_IMPORT_S})))
                return None  # found by the usual finders, now

        sys.meta_path.insert(0, SlowWorkerImport())
""")

SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys
    from rollfleet.actors import FleetConfig, Supervisor

    # A job started in the background by a shell without job control (a CI runner's, nohup ... &)
    # inherits SIGINT ignored, and asyncio.run then leaves it so: Ctrl-C is what this script stands for.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def main():
        config = FleetConfig(engine="echo", num_workers=2, frontend_addr=None, start_timeout_s=120,
                             shutdown_timeout_s=120,
                             worker_env={"PYTHONPATH": sys.argv[1], "SLOW_IMPORT_DIR": sys.argv[2]})
        async with Supervisor(config):
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.fixture
def job(tmp_path):
    """start() -> (the script's process, its TMPDIR, marker dir): an embedded supervisor (no
    signal handler of its own) whose 2 echo workers start slowly, in a session of its own."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    markers = tmp_path / "markers"
    markers.mkdir()
    tmpdir = tempfile.mkdtemp(prefix="rfb-")  # short: socket paths must fit in 107 characters
    procs = []

    def start(slow_import_s: float = SLOW_IMPORT_S):
        pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
        with open(tmp_path / "job.err", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", SCRIPT, pythonpath, str(markers)], stderr=err,
                                    env=dict(os.environ, TMPDIR=tmpdir, SLOW_IMPORT_S=str(slow_import_s)),
                                    start_new_session=True)
        proc.err_path = tmp_path / "job.err"
        procs.append(proc)
        assert wait_until(lambda: len(list(markers.iterdir())) == 2, 60), "the workers did not start importing"
        workers = [int(m.name.split("-")[1]) for m in markers.iterdir()]
        assert sorted(workers) == sorted(p.pid for p in worker_children(proc.pid))
        return proc, tmpdir, workers

    yield start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    shutil.rmtree(tmpdir, ignore_errors=True)


def left_in(tmpdir: str) -> list[str]:
    return [n for n in os.listdir(tmpdir) if n.startswith("rollfleet-")]


def test_a_group_sigterm_while_the_workers_start_leaves_nothing(job):
    proc, tmpdir, workers = job()
    assert left_in(tmpdir)  # the supervisor's private directory, with its socket
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM  # no handler: it died of it
    # The workers held it through their start, answered it then, and found their supervisor gone.
    assert wait_until(lambda: not alive(workers) and not left_in(tmpdir), SLOW_IMPORT_S + 20), (
        alive(workers), left_in(tmpdir))


def test_a_worker_stopped_while_it_starts_goes_when_its_supervisor_is_killed(job):
    proc, tmpdir, workers = job()
    stopped = workers[0]
    os.kill(stopped, signal.SIGSTOP)
    assert wait_until(lambda: psutil.Process(stopped).status() == psutil.STATUS_STOPPED, 10)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    # The kernel's SIGCONT at the supervisor's death wakes it; it then sees the supervisor gone.
    assert wait_until(lambda: not alive(workers) and not left_in(tmpdir), SLOW_IMPORT_S + 20), (
        [(p, psutil.Process(p).status()) for p in alive(workers)], left_in(tmpdir))


def test_a_sigterm_to_a_starting_worker_alone_is_answered_once_it_has_started(job):
    # Held through the start, then answered as any SIGTERM from someone other than the
    # supervisor: the worker exits, cleanly (code 0, not killed by the signal); a fleet whose
    # worker ends during its start fails to start, and says how it ended.
    proc, tmpdir, workers = job()
    os.kill(workers[0], signal.SIGTERM)
    assert wait_until(lambda: not alive(workers[:1]), SLOW_IMPORT_S + 20), "the held SIGTERM was never answered"
    assert proc.wait(30) != 0
    assert "died during start-up (process exited with code 0)" in proc.err_path.read_text()
    assert wait_until(lambda: not alive(workers) and not left_in(tmpdir), 20)


def test_a_supervisor_that_shuts_down_while_its_workers_start_does_not_wait_for_their_start(job):
    # Its SIGTERM, said on the death pipe to be its own, ends a worker that holds nothing yet at
    # once: not after an import of a minute (the supervisor would wait for it, up to its
    # shutdown_timeout_s of 2 minutes).
    proc, tmpdir, workers = job(slow_import_s=60)
    os.kill(proc.pid, signal.SIGINT)  # the script's asyncio.run ends: the Supervisor shuts down
    assert proc.wait(30) is not None
    assert not alive(workers) and not left_in(tmpdir)
