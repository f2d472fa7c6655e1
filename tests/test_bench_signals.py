"""A bench script stopped by a signal cleans up: its temporary directories and child processes go,
and it exits 128 + the signal's number with one line on stderr, no traceback (bench/common.py's
stop_signals and run_main)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def wait_for(pattern: str, proc: subprocess.Popen, count: int = 1, timeout: float = 120) -> None:
    """Until ``count`` paths match ``pattern`` at once."""
    deadline = time.monotonic() + timeout
    while len(glob.glob(pattern)) < count:
        assert proc.poll() is None, f"the script ended before {pattern} appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{count} of {pattern} did not appear within {timeout} s"
        time.sleep(0.05)


def leftovers(tmp_path) -> list[str]:
    """What the run left in its TMPDIR, but torch's compile cache (kept across runs on purpose)."""
    return [n for n in os.listdir(tmp_path / "tmp") if not n.startswith("torchinductor_")]


def alive(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.cmdline())[:200])
        except psutil.NoSuchProcess:
            pass
    return left


def stop_mid_run(tmp_path, script: str, args: list[str], ready: str, sig: int,
                 count: int = 1) -> tuple[int, str, list[str]]:
    """Start ``script`` in a session of its own with TMPDIR in ``tmp_path``; once ``count`` paths
    match ``ready`` (a glob under TMPDIR), send ``sig`` to its process group, as bench/run_all's --timeout and a
    Ctrl-C do. Returns its exit status, its stderr and the processes it had that are still there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, os.path.join(BENCH, script), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        wait_for(str(tmp / ready), proc, count)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)  # let the children the script stopped be reaped
    return proc.returncode, err, alive(children)


RPC = ["--quick", "--no-ray"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_bench_rpc_stopped_by_sigterm_or_sighup_leaves_no_temp_dir_or_process(tmp_path, sig):
    # Once a fleet is up (its private dir under TMPDIR): the raw server, the fleets' workers and
    # the temporary socket folders must all go.
    rc, err, left = stop_mid_run(tmp_path, "bench_rpc.py", RPC, "rollfleet-*", sig)
    assert rc == 128 + sig, err
    assert leftovers(tmp_path) == [], err
    assert left == []
    assert "Traceback" not in err, err


@pytest.mark.timeout(300)
def test_bench_rpc_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path):
    # Once the RemoteClient child process runs (its fleet's frontend is up): the child ignores the
    # Ctrl-C and is stopped by its parent, so the parent never reads a half answer.
    rc, err, left = stop_mid_run(tmp_path, "bench_rpc.py", RPC, "rollfleet-*", signal.SIGINT)
    assert rc == 130, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == ["bench_rpc.py: stopped by SIGINT; cleaned up"], err
    assert leftovers(tmp_path) == []
    assert left == []


@pytest.mark.timeout(300)
def test_bench_weights_stopped_by_sigterm_removes_its_checkpoint(tmp_path):
    # The checkpoint folder (450 MB at --quick; small here) is a TemporaryDirectory.
    args = ["--quick", "--total-gb", "0.05", "--buckets-mb", "16", "--transports", "shm"]
    rc, err, left = stop_mid_run(tmp_path, "bench_weights.py", args, "rf-bench-model-*/*", signal.SIGTERM)
    assert rc == 143, err
    assert leftovers(tmp_path) == [], err
    assert left == []
    assert "Traceback" not in err, err


@pytest.mark.timeout(300)
def test_bench_scaling_stopped_with_rank_processes_running_leaves_none_behind(tmp_path):
    # The ranks run is the only fleet here; each rank is a child process with a fleet of its own.
    args = ["--quick", "--workers", "2", "--receivers", "", "--paced-batches", "0", "--running-intervals", "0",
            "--calls", "300", "--clients", "0", "--ranks", "2"]
    # Two fleets' private dirs at once: the two ranks' (the 2-worker fleet measured first is one).
    rc, err, left = stop_mid_run(tmp_path, "bench_scaling.py", args, "rollfleet-*", signal.SIGTERM, count=2)
    assert rc == 143, err
    assert leftovers(tmp_path) == [], err
    assert left == []
    assert "Traceback" not in err, err
