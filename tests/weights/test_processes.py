"""Sender and receivers in separate processes, over ZeroMQ with the wire codec."""

import json
import os
import signal
import time

import pytest

from rollfleet.weights import shm

from ..helpers import wait_until


def wait_line(proc, prefix, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if not line and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {prefix!r} line in {timeout}s")


@pytest.fixture
def addr(tmp_path):
    return f"ipc://{tmp_path}/hub.sock"


def run_sender(procs, addr, *args):
    sender = procs("sender", "--addr", addr, *args)
    result = json.loads(wait_line(sender, "RESULT ", timeout=120))
    assert sender.wait(30) == 0
    return result


def test_shm_update_reaches_two_worker_processes_bit_exact(procs, addr):
    procs("worker", "--addr", addr, "--id", "w0")
    procs("worker", "--addr", addr, "--id", "w1")
    result = run_sender(procs, addr, "--workers", "w0,w1", "--transport", "shm", "--bucket", "8192",
                        "--big", "40000", "--version", "5")
    assert result["report"]["ok"] and result["report"]["num_buckets"] > 4
    for wid in ("w0", "w1"):
        assert result["received"][wid]["version"] == 5
        assert result["received"][wid]["digests"] == result["expected"]


def test_gloo_collective_leaves_the_senders_default_group_alone(procs, addr, tmp_path):
    procs("worker", "--addr", addr, "--id", "w0")
    result = run_sender(procs, addr, "--transport", "collective", "--bucket", "8192", "--big", "30000",
                        "--version", "3", "--default-group", str(tmp_path / "pg"))
    assert result["report"]["workers"]["w0"]["transport"] == "collective"
    assert result["received"]["w0"]["digests"] == result["expected"]
    assert result["received"]["w0"]["version"] == 3
    assert result["default_world"] == 1 and result["default_allreduce"] == [1.0] * 4


def start_slow_transfer(procs, addr, engine):
    worker = procs("worker", "--addr", addr, "--id", "w0", "--engine", engine, "--delay", "0.02")
    sender = procs("sender", "--addr", addr, "--transport", "shm", "--bucket", "4096", "--big", "400000",
                   "--slow", "0.01")
    wait_line(sender, "STARTED")
    time.sleep(0.5)  # well inside the transfer: about a hundred buckets at 20 ms each
    assert sender.poll() is None
    return sender, worker


@pytest.mark.parametrize("order", ["sender_first", "receiver_first"])
def test_killing_either_side_mid_transfer_leaves_no_segments(procs, addr, order):
    sender, worker = start_slow_transfer(procs, addr, "store")
    first, second = (sender, worker) if order == "sender_first" else (worker, sender)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    assert shm.list_segments(sender.pid) == []


def test_descriptor_path_segments_are_unlinked_by_the_receiver_when_the_sender_dies(procs, addr):
    sender, worker = start_slow_transfer(procs, addr, "descriptor")
    assert len(shm.list_segments(sender.pid)) == 3  # names kept alive for the engine to open (3 buffers on CPU)
    os.kill(sender.pid, signal.SIGKILL)
    sender.wait()
    assert wait_until(lambda: shm.list_segments(sender.pid) == [], timeout=10)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert shm.list_segments(sender.pid) == []


def test_sweep_removes_segments_of_dead_creators(procs, addr):
    sender, worker = start_slow_transfer(procs, addr, "descriptor")
    os.kill(worker.pid, signal.SIGKILL)  # nobody left to watch the sender
    os.kill(sender.pid, signal.SIGKILL)
    sender.wait()
    worker.wait()
    leftovers = shm.list_segments(sender.pid)
    assert leftovers  # nobody alive could unlink them
    removed = shm.sweep_stale()
    assert set(leftovers) <= set(removed) and shm.list_segments(sender.pid) == []
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"rf-{sender.pid}-")]  # its lock file too


def test_sweep_tells_a_dead_creator_by_its_lock_not_by_its_pid():
    # A creator that was pid 1 in a pid namespace sharing /dev/shm (a container restarted with the
    # same /dev/shm), or whose pid was recycled: its pid runs (init here, the new fleet there), but
    # nobody holds the lock it held while its segments were named, so they are a dead one's.
    from rollfleet.weights.shm_names import lock_path

    token = "0123456789abcdef"
    dead = [f"rf-1-{token}-{i}" for i in range(2)]
    for name in dead:
        shm.create(name, 4096)
    open(lock_path(1, token), "w").close()  # the lock file its creator held, the lock gone with it
    live = shm.Segments(4096, 2)  # this process's: its lock is held, so they stay
    try:
        removed = shm.sweep_stale()
        assert set(dead) <= set(removed) and not os.path.exists(lock_path(1, token))
        assert set(live.names) <= set(shm.list_segments(os.getpid()))
        assert os.path.exists(lock_path(os.getpid(), live.token))
    finally:
        for name in dead:
            shm.unlink(name)
        live.unlink_names()
    assert not os.path.exists(lock_path(os.getpid(), live.token))  # dropped with the names


def test_segments_of_a_sender_killed_with_its_receivers_go_when_the_next_fleet_starts(procs, addr, tmp_path):
    # Killed together (a process group sent SIGKILL), sender and receivers leave the segments
    # named; only the next shm update swept them, so a fleet that never made one (serve, a
    # colocated fleet, cuda_ipc) kept them, hundreds of MiB, until the machine restarted.
    import asyncio

    from rollfleet.actors import FleetConfig, Supervisor

    sender, worker = start_slow_transfer(procs, addr, "descriptor")
    os.kill(worker.pid, signal.SIGKILL)
    os.kill(sender.pid, signal.SIGKILL)
    sender.wait()
    worker.wait()
    leftovers = shm.list_segments(sender.pid)
    assert leftovers
    mine = shm.Segments(4096, 1)  # a live creator's: kept

    async def start_and_stop():
        async with Supervisor(FleetConfig(engine="echo", private_dir_root=str(tmp_path))):
            pass

    try:
        asyncio.run(start_and_stop())
        assert shm.list_segments(sender.pid) == []
        assert set(mine.names) <= set(shm.list_segments(os.getpid()))
    finally:
        mine.unlink_names()
