"""The command line as a user meets it: bad options are one line and exit 2, failures one line
and exit 1, and `rollfleet serve` on an ipc:// address neither takes it from a live fleet nor
leaves its socket file behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from .helpers import wait_until, worker_children

CLI = [sys.executable, "-m", "rollfleet"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args", [
    ("demo", "--requests", "-3"),
    ("demo", "--workers", "0"),
    ("demo", "--max-tokens", "x"),
    ("demo", "--engine", "echo", "--model", "/tmp"),
    ("demo", "--model", "/nonexistent"),
    ("stats",),
    ("bogus",),
    (),
    ("serve", "--engine", "nope"),
    ("serve", "--bogus"),
    ("--log-level", "bogus", "keys", "/nonexistent/k"),
    ("stats", "tcp://127.0.0.1:1", "--timeout", "0"),
    ("stats", "notanaddress"),
    ("stats", "nonsense://x"),
    ("stats", "tcp://127.0.0.1:0"),
    ("serve", "--engine", "echo", "--bind", "tcp://127.0.0.1:99999"),
    ("serve", "--engine", "echo", "--bind", ""),
    ("serve", "--engine", "echo", "--bind", "127.0.0.1:5556"),
    ("serve", "--engine", "echo", "--keys-dir", "/nonexistent"),
    ("serve", "--model", "/nonexistent"),
    ("serve", "--engine", "echo", "--ready-file", "/nonexistent/dir/ready"),
    ("serve", "--engine", "echo", "--engine-option", "tokens_per_sec=5"),
    ("serve", "--engine", "vllm", "--engine-option", "max_len=64"),
    ("serve", "--engine", "echo", "--start-timeout", "nan"),
    ("serve", "--engine", "echo", "--workers", "0"),
    ("serve", "--engine", "echo", "--report-interval", "0"),
    ("serve", "--engine", "echo", "--report-interval", "inf"),
    ("serve", "--engine", "echo", "--stall-timeout", "0.5"),  # named the config's fields, not the flags
    ("serve", "--engine", "echo", "--client-send-hwm", "-1"),
    ("serve", "--engine", "echo", "--max-client-message-bytes", "100"),
    ("serve", "--engine", "echo", "--max-client-message-bytes", str((1 << 30) + 1)),
    ("serve", "--engine", "echo", "--devices", "cpu,"),
    ("serve", "--engine", "echo", "--workers", "2", "--devices", "cpu"),
    ("serve", "--engine", "echo", "--devices", ""),
    ("serve", "--engine", "echo", "--store-bind", "127.0.0.1:0"),
    ("serve", "--engine", "echo", "--worker-bind", "tcp://127.0.0.1:0"),
    ("serve", "--engine", "echo", "--advertise-host", "node1"),
    ("serve", "--engine", "echo", "--keys-dir", "/", "--store-bind", "nohost"),
    ("serve", "--engine", "echo", "--keys-dir", "/", "--store-bind", "127.0.0.1:70000"),
    ("serve", "--engine", "echo", "--keys-dir", "/", "--store-bind", "127.0.0.1:0", "--worker-bind", "ipc:///tmp/w"),
    ("serve", "--engine", "echo", "--keys-dir", "/", "--store-bind", "127.0.0.1:0", "--worker-bind", "tcp://h"),
])
def test_bad_options_exit_2_with_one_line_and_no_traceback(args):
    out = run(*args)
    assert out.returncode == 2, (args, out.stderr)
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # no usage block: --help is for that
    assert out.stderr.startswith("rollfleet"), out.stderr
    flags = [a for a in args if a.startswith("--") and a not in ("--engine", "--log-level")]
    flag = "--devices" if "--devices" in flags else next(iter(flags), None)
    for named in ("--worker-bind", "--advertise-host", "--store-bind"):  # the one at fault, however ordered
        if named in flags:
            flag = named
            break
    if args[:1] == ("serve",) and flag in ("--start-timeout", "--workers", "--client-send-hwm", "--max-client-message-bytes",
                                           "--devices", "--report-interval", "--store-bind", "--worker-bind",
                                           "--advertise-host"):
        assert flag in out.stderr, out.stderr  # said as the flag, not as the FleetConfig field behind it


def test_log_level_takes_any_case_and_numbers():
    for level in ("info", "DEBUG", "10"):
        out = run("--log-level", level, "stats", "tcp://127.0.0.1:1", "--timeout", "0.2")
        assert out.returncode == 1 and "Traceback" not in out.stderr  # no fleet there: one line, exit 1
        # The hint names the command's own option, not the library's parameter.
        assert "given them: --keys-dir DIR)" in out.stderr and "curve_keys" not in out.stderr, out.stderr


def test_a_numeric_log_level_without_a_name_reaches_the_workers():
    # 15 and 5 have no name ('Level 15'): the workers must still start, at that level.
    for level in ("15", "5"):
        out = run("--log-level", level, "demo", "--engine", "echo", "--workers", "1", "--requests", "2",
                  "--max-tokens", "4", "--no-update")
        assert out.returncode == 0, out.stderr
        assert "fleet shut down cleanly" in out.stdout


def test_keys_where_none_can_be_written_is_one_line_exit_1(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for target in (str(a_file), "/proc/nokeys"):
        out = run("keys", target, "--force")
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1 and "--force" not in out.stderr, out.stderr


def test_stats_with_missing_keys_is_one_line(tmp_path):
    # No such directory: a bad option, exit 2 as serve's --keys-dir; a directory without keys: exit 1.
    out = run("stats", "tcp://127.0.0.1:1", "--timeout", "0.2", "--keys-dir", "/nonexistent")
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert "--keys-dir /nonexistent: not a directory (`rollfleet keys DIR` makes one)" in out.stderr
    out = run("stats", "tcp://127.0.0.1:1", "--timeout", "0.2", "--keys-dir", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert "rollfleet keys DIR" in out.stderr, out.stderr


def test_stats_of_an_ipc_address_no_process_serves_says_so_at_once(tmp_path):
    # Not after --timeout: a missing socket file, or one left by a process that died, has no fleet.
    stale = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(stale))  # bound, never listened on, then closed: a file nobody answers on
    left.close()
    for path, why in ((tmp_path / "none.sock", "no such socket file"), (stale, "a socket file no process serves")):
        start = time.monotonic()
        out = run("stats", f"ipc://{path}", "--timeout", "30")
        assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert f"ipc://{path}: no fleet serves it ({why})" in out.stderr, out.stderr
        assert time.monotonic() - start < 25  # (generous: the command's start; the wait would be 30 s)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Kill ``proc`` at the end of the block if it still runs (a failed check leaves no process)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_file(path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return open(path).read().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_serve_on_ipc_refuses_an_address_in_use_and_removes_its_socket_file(tmp_path):
    sock = tmp_path / "front.sock"
    ready = tmp_path / "ready"
    first = subprocess.Popen([*CLI, "serve", "--engine", "echo", "--bind", f"ipc://{sock}", "--ready-file", str(ready)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with reaped(first):
        assert wait_file(ready) == f"ipc://{sock}"
        second = run("serve", "--engine", "echo", "--bind", f"ipc://{sock}")
        assert second.returncode == 1 and "served by another process" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        stats = run("stats", f"ipc://{sock}", "--json")
        assert stats.returncode == 0, stats.stderr  # the first fleet still answers there
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        assert not sock.exists() and not ready.exists()


def serve_and_its_workers(tmp_path, *args: str, **popen):
    """A ``serve`` of 2 echo workers on an ipc:// address (and ``args``), once ready: (process,
    workers, socket file)."""
    sock, ready = tmp_path / "front.sock", tmp_path / "ready"
    proc = subprocess.Popen([*CLI, "serve", "--engine", "echo", "--workers", "2", "--bind", f"ipc://{sock}",
                             "--ready-file", str(ready), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, **popen)
    assert wait_file(ready) == f"ipc://{sock}"
    workers = worker_children(proc.pid)
    assert len(workers) == 2
    return proc, workers, sock


def test_sighup_to_the_process_group_of_serve_shuts_down_cleanly_and_the_workers_follow(tmp_path):
    # A terminal that closes sends SIGHUP to its whole process group: serve and its workers.
    # The workers' default action (exit at once) would leave the fleet's files behind.
    import psutil

    proc, workers, sock = serve_and_its_workers(  # SIGHUP as a terminal's job has it (this run may be nohup's)
        tmp_path, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    with reaped(proc):
        os.killpg(proc.pid, signal.SIGHUP)
        assert proc.wait(30) == 0, proc.stderr.read()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive and not sock.exists() and not (tmp_path / "ready").exists()


def test_serve_started_ignoring_sighup_keeps_serving_after_one(tmp_path):
    proc, workers, sock = serve_and_its_workers(
        tmp_path, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    with reaped(proc):
        os.killpg(proc.pid, signal.SIGHUP)  # nohup's job: its terminal closed
        time.sleep(1.5)
        assert proc.poll() is None and all(w.is_running() for w in workers)
        assert run("stats", f"ipc://{sock}", "--json").returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_serve_killed_outright_leaves_no_frontend_socket_file_nor_ready_file(tmp_path):
    # SIGKILL: serve removes nothing; its workers see it die and remove its socket file and its
    # ready file (which would otherwise name a fleet that is gone).
    import psutil

    proc, workers, sock = serve_and_its_workers(tmp_path)
    ready = tmp_path / "ready"
    assert ready.exists()
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    deadline = time.monotonic() + 5
    while (sock.exists() or ready.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sock.exists() and not ready.exists()


def test_python_dash_m_rollfleet_is_the_command():
    out = run("--help")
    assert out.returncode == 0 and "serve" in out.stdout


@pytest.mark.parametrize("command, says", [
    ("demo", "Run a demo: a fleet, a batch of rollouts"),
    ("stats", "Print the stats of a running fleet"),
    ("keys", "Create CurveZMQ keys for a fleet"),
    ("serve", "serve its client-facing ZeroMQ ROUTER socket"),
    ("node", "Run this node's rollfleet workers for a fleet on another host"),
])
def test_the_help_of_each_command_says_what_it_does(command, says):
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert says in " ".join(out.stdout.split()), out.stdout  # not only its usage and options


@pytest.mark.parametrize("args", [
    ("--store", "bogus"),
    ("--store", "127.0.0.1:1", "--engine-options", "{bad"),
    ("--store", "127.0.0.1:1", "--workers", "0"),
    ("--store", "127.0.0.1:1", "--log-level", "nope"),
    ("--store", "127.0.0.1:1", "--engine", "torch", "--engine-options", '{"max_batchsize": 4}'),
    ("--store", "127.0.0.1:1", "--engine", "tensorrt"),
    ("--store", "127.0.0.1:1", "--timeout", "nan"),  # was taken: a wait without end
    ("--store", "127.0.0.1:1", "--supervisor-timeout", "inf"),
    ("--store", "127.0.0.1:1", "--devices", "cpu,cpu"),  # was refused only once a store answered
    ("--store", "127.0.0.1:0"),
    ("--store", "127.0.0.1:1", "--name", ""),
    ("--store", "127.0.0.1:1", "--name", "a/b"),
])
@pytest.mark.parametrize("command", ["python -m rollfleet.actors.node", "rollfleet node"])
def test_node_agent_checks_its_options_before_reaching_the_store(args, command):
    if command == "rollfleet node":
        if "--log-level" in args:  # an option of rollfleet itself, given before the command
            i = args.index("--log-level")
            args = ("--log-level", args[i + 1], "node", *args[:i], *args[i + 2:])
        else:
            args = ("node", *args)
        out = run(*args)
        prog = "rollfleet" if args[0] == "--log-level" else "rollfleet node"
    else:
        out = subprocess.run([sys.executable, "-m", "rollfleet.actors.node", *args], capture_output=True, text=True,
                             timeout=60)
        prog = command
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"{prog}: error:"), out.stderr


@pytest.mark.parametrize("command", [[sys.executable, "-m", "rollfleet.actors.node"], [*CLI, "node"]])
def test_node_agent_without_a_store_is_one_line_exit_1(command):
    out = subprocess.run([*command, "--store", "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    # One line: nothing of torch's own retries and C++ traces.
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("rollfleet node: 127.0.0.1:1: ConnectionError: nothing answers there after 1 s")


def test_demo_whose_worker_cannot_start_says_why_then_shows_the_workers_output(tmp_path):
    out = run("demo", "--workers", "1", "--model", str(tmp_path))  # a directory with no model in it
    assert out.returncode == 1 and "Traceback (most recent call last)" not in out.stderr.splitlines()[0], out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("rollfleet demo: WorkerStartError: worker w0-0 failed to start: engine failed to "
                               "start: ValueError"), out.stderr
    assert str(tmp_path) in lines[0], out.stderr  # why: the model directory it could not load
    # The end of the worker's own output follows: its traceback, down to the error it ended with.
    assert "Traceback (most recent call last):" in lines[1:], out.stderr
    assert lines[-1].startswith("ValueError: ") and str(tmp_path) in lines[-1], out.stderr


def test_an_unknown_option_is_said_by_the_command_it_was_given_to():
    out = run("serve", "--bogus")
    assert out.returncode == 2 and out.stderr.strip() == (
        "rollfleet serve: error: unrecognized arguments: --bogus (see rollfleet serve --help)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_serve_writes_its_default_model_exits_0_and_removes_it(tmp_path, sig):
    # vllm's default model is written to a temporary directory before any worker starts (a
    # second or more): a signal then is the same as later, exit 0 and nothing left behind.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([*CLI, "serve", "--engine", "vllm", "--bind", "tcp://127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with reaped(proc):
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("rollfleet-serve-model-*")) and proc.poll() is None:
            assert time.monotonic() < deadline, "serve never started writing its model"
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in err and "never retrieved" not in err, (proc.returncode, err)
        assert not list(tmp_path.glob("rollfleet-serve-model-*"))


def test_serve_on_an_ipc_path_that_is_a_plain_file_refuses_and_keeps_the_file(tmp_path):
    # ZeroMQ binds an ipc:// address by unlinking whatever is at its path: a typo that names
    # a file of the user's deleted it.
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    out = run("serve", "--engine", "echo", "--bind", f"ipc://{precious}")
    assert out.returncode == 1 and "not a socket" in out.stderr, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert precious.read_text() == "keep me"


def test_demo_interrupted_mid_batch_says_so_in_one_line(tmp_path):
    # SIGINT as a terminal gives it: a runner started in the background (nohup ... &) passes it on ignored.
    proc = subprocess.Popen([*CLI, "demo", "--engine", "echo", "--max-tokens", "4000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    with reaped(proc):
        assert "fleet ready" in proc.stdout.readline() + proc.stdout.readline()
        time.sleep(1.0)  # the rollouts (10 s each at the demo's 400 tokens/s) are running
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert err.strip() == "rollfleet demo: interrupted", err  # no error per rollout left running


@pytest.mark.parametrize("interval", ["5", "0.05"])
def test_serve_report_interval_sets_how_much_a_dead_workers_request_keeps(tmp_path, interval):
    # 200 tokens at 100 tokens/s, its worker killed 0.6 s in: with reports every 0.05 s the fleet
    # holds some tokens by then and the resumed request keeps them (a second segment, starting
    # there); with reports every 5 s none was reported yet and it starts over (one segment).
    import asyncio

    from rollfleet.actors import RemoteClient
    from rollfleet.engines.echo import echo_tokens
    from rollfleet.transport.messages import SamplingParams

    sock, ready = tmp_path / "front.sock", tmp_path / "ready"
    proc = subprocess.Popen([*CLI, "serve", "--engine", "echo", "--tokens-per-s", "100", "--bind", f"ipc://{sock}",
                             "--ready-file", str(ready), "--report-interval", interval], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)

    async def go():
        async with RemoteClient(f"ipc://{sock}") as client:
            task = asyncio.create_task(client.generate("r", [5], SamplingParams(max_tokens=200)))
            pid = (await client.stats())["workers"][0]["pid"]
            await asyncio.sleep(0.6)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(task, 60)

    with reaped(proc):
        assert wait_file(ready) == f"ipc://{sock}"
        r = asyncio.run(go())
        assert r.token_ids == echo_tokens([5], 200) and r.num_preemptions == 1, r
        if interval == "5":
            assert r.weight_versions == [0] and r.weight_version_starts == [0], r
        else:
            assert r.weight_versions == [0, 0] and 10 <= r.weight_version_starts[1] < 200, r
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_serve_whose_store_address_is_taken_says_so_and_exits_1(tmp_path):
    from rollfleet.transport.auth import make_keys

    keys = str(tmp_path / "keys")
    make_keys(keys)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = run("serve", "--engine", "echo", "--keys-dir", keys, "--store-bind", f"127.0.0.1:{port}")
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith(f"rollfleet serve: --store-bind 127.0.0.1:{port}: "), out.stderr
    assert "Traceback" not in out.stderr


def test_stats_into_a_pipe_its_reader_closed_is_no_traceback(tmp_path):
    # `rollfleet stats ADDR --json | head -1`: the reader goes away before the output is written.
    proc, workers, sock = serve_and_its_workers(tmp_path)
    with reaped(proc):
        stats = subprocess.Popen([*CLI, "stats", f"ipc://{sock}", "--json"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        stats.stdout.close()
        err = stats.stderr.read()
        assert stats.wait(60) == 1
        assert "Traceback" not in err and "BrokenPipeError" not in err, err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (False once it is gone)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch" in maps.read()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_node_agent_waiting_for_its_store_stops_on_a_signal_with_exit_0(sig):
    # Nothing answers at the store's address yet (its fleet is still starting): a signal ends
    # the wait at once, as README says, with nothing started and nothing on stderr.
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([*CLI, "node", "--store", f"127.0.0.1:{port}", "--timeout", "120"],
                            stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        # Past the imports, into the wait: torch loads after the agent took the signals over.
        assert wait_until(lambda: proc.poll() is not None or torch_loaded(proc.pid), 60)
        time.sleep(1)
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(15) == 0
        assert proc.stderr.read() == ""


def test_node_agent_given_a_store_whose_router_is_garbage_says_so_in_one_line_exit_1():
    import datetime

    import torch

    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                                       wait_for_workers=False)
    store.set("rollfleet/router", "not json")
    out = subprocess.run([*CLI, "node", "--store", f"127.0.0.1:{store.port}", "--timeout", "10"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"rollfleet node: 127.0.0.1:{store.port}: cannot join the fleet: "), out.stderr
    del store


def test_serve_metrics_port_serves_prometheus_metrics_and_says_where(tmp_path):
    pytest.importorskip("prometheus_client")
    import urllib.request

    sock = tmp_path / "front.sock"
    proc = subprocess.Popen([*CLI, "serve", "--engine", "echo", "--workers", "2", "--bind", f"ipc://{sock}",
                             "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        first, second = proc.stdout.readline().split(), proc.stdout.readline().split()
        assert first[:3] == ["rollfleet", "metrics", "on"] and second == ["rollfleet", "serving", "on", f"ipc://{sock}"]
        url = first[3]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        with urllib.request.urlopen(url, timeout=10) as page:
            text = page.read().decode()
        assert len([line for line in text.splitlines() if line.startswith("rollfleet_worker_up{")]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
    assert run("serve", "--metrics-port", "70000").returncode == 2


def test_stats_answers_in_time_with_a_worker_hung_and_says_which(tmp_path):
    # A stopped worker answers nothing until the fleet kills it for its silence (30 s): the
    # stats answer waits for its engine stats 5 s, within the command's default 10 s.
    proc, workers, sock = serve_and_its_workers(tmp_path)
    with reaped(proc):
        hung = workers[0]
        hung.suspend()
        try:
            out = run("stats", f"ipc://{sock}")
        finally:
            hung.resume()
        assert out.returncode == 0, out.stderr
        rows = [line for line in out.stdout.splitlines() if line.startswith(("w0-", "w1-"))]
        assert len(rows) == 2 and [str(hung.pid) in row for row in rows].count(True) == 1
        assert all(("no stats:" in row) == (str(hung.pid) in row) for row in rows)
        assert "aborted: 0" in out.stdout and "cancelled: 0" in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_serve_worker_nice_and_stall_timeout_reach_the_fleet(tmp_path):
    import psutil

    sock, ready = tmp_path / "front.sock", tmp_path / "ready"
    proc = subprocess.Popen([*CLI, "serve", "--engine", "echo", "--workers", "2", "--bind", f"ipc://{sock}",
                             "--ready-file", str(ready), "--worker-nice", "5", "--stall-timeout", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        assert wait_file(ready) == f"ipc://{sock}"
        workers = worker_children(proc.pid)
        assert len(workers) == 2 and {w.nice() for w in workers} == {psutil.Process(proc.pid).nice() + 5}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
    # Within two reports (0.5 s each): refused as FleetConfig refuses it, with one line naming the flags.
    out = run("serve", "--engine", "echo", "--stall-timeout", "0.5")
    assert out.returncode == 2 and "twice --report-interval" in out.stderr and len(out.stderr.splitlines()) == 1
    assert run("serve", "--worker-nice", "20").returncode == 2


def test_serve_inflight_call_heartbeat_and_restart_limits_reach_the_fleet(tmp_path):
    import asyncio

    import psutil

    from rollfleet.actors import RemoteClient
    from rollfleet.errors import Overloaded, RequestTimeout

    proc, workers, sock = serve_and_its_workers(
        tmp_path, "--tokens-per-s", "5", "--max-inflight-per-client", "2", "--call-timeout", "2",
        "--heartbeat-timeout", "8", "--max-restarts", "0")
    stopped = workers[0]

    async def main() -> None:
        async with RemoteClient(f"ipc://{sock}", call_timeout_s=30) as client:
            running = [asyncio.create_task(client.generate(f"r{i}", [1, 2], {"max_tokens": 1000})) for i in range(2)]
            await asyncio.sleep(0.5)
            with pytest.raises(Overloaded):  # a third request of this client
                await client.generate("r2", [3], {"max_tokens": 1})
            await client.abort_all()
            await asyncio.gather(*running)
            # A stopped worker holds a control call --call-timeout (2 s, not 60 s): it is given
            # up on while still alive, before --heartbeat-timeout (8 s) has it killed.
            stopped.suspend()
            with pytest.raises(RequestTimeout, match="did not answer control in 2.0s"):
                await client.control("clear_kv_cache")
            assert stopped.status() == psutil.STATUS_STOPPED

    with reaped(proc):
        asyncio.run(main())
        # Silent past --heartbeat-timeout (8 s, not 30 s): killed; with --max-restarts 0 it
        # stays dead (a restart would come within 0.5 s) and the other serves alone.
        stopped.wait(25)
        time.sleep(3)
        alive = worker_children(proc.pid)
        assert [p.pid for p in alive] == [workers[1].pid]
        out = run("stats", f"ipc://{sock}")
        assert out.returncode == 0 and "dead" in out.stdout, out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
    for args in (("--heartbeat-timeout", "1"), ("--max-restarts", "-1"), ("--max-inflight-per-client", "0"),
                 ("--call-timeout", "0")):
        out = run("serve", "--engine", "echo", *args)
        assert out.returncode == 2 and args[0] in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_an_import_error_inside_a_command_is_raised_once_not_run_again():
    # The loop's runner is chosen by importing uvloop; an ImportError of the command itself used to
    # be taken for that one, and the spent coroutine run again ("cannot reuse already awaited
    # coroutine", raised over the command's own error).
    from rollfleet import cli

    runs = []

    async def command():
        runs.append(1)
        import rollfleet_no_such_module  # noqa: F401

    with pytest.raises(ImportError, match="rollfleet_no_such_module"):
        cli._run(command())
    assert runs == [1]


def test_stats_interrupted_while_it_waits_for_an_answer_says_so_in_one_line():
    # A port nothing answers on (a listening socket that never speaks ZeroMQ): stats waits for
    # up to --timeout. Ctrl-C there printed a traceback of some forty lines.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen([*CLI, "stats", address, "--timeout", "60"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        with reaped(proc):
            time.sleep(3)  # imported, connected, waiting
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 130, err
            assert err.strip() == "rollfleet stats: interrupted", err
