"""Shared memory that engines' own processes make through Python's multiprocessing must not
outlive them when they are killed (actors/process.py), and what a fleet's process leaves goes
with its private directory (the sweep, the sentinel: actors/sentinel.py). Real processes, real
/dev/shm."""

import contextlib
import os
import subprocess
import sys

import psutil
import pytest

from rollfleet.actors.process import (is_resource_tracker, kill_tree, record_shm, shm_names_mapped, shm_names_now,
                                      sweep_shm_lists)

from ..helpers import wait_until

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

# A stand-in for an engine process: multiprocessing shared memory and a spawn-context lock
# (a named semaphore, registered with a resource tracker this process starts), then it waits.
CHILD = """
import multiprocessing, sys
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 16)
lock = multiprocessing.get_context("spawn").Lock()
sem = lock._semlock.name.lstrip("/").replace("mp-", "sem.mp-", 1)
if len(sys.argv) > 1:
    from rollfleet.actors.process import record_shm
    record_shm(sys.argv[1], {seg.name, sem})
print(seg.name, sem, flush=True)
sys.stdin.readline()
"""


def start_child(*args: str) -> tuple[subprocess.Popen, str, str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    seg, sem = child.stdout.readline().split()
    return child, seg, sem


def test_names_listed_by_a_killed_engine_process_are_unlinked_by_the_sweep(tmp_path):
    child, seg, sem = start_child(str(tmp_path))
    try:
        assert {seg, sem} <= shm_names_now()
        assert sweep_shm_lists(str(tmp_path)) == []  # its process still runs: left alone
        assert {seg, sem} <= shm_names_now()
        kill_tree(child.pid)  # its resource tracker first: nobody cleans up after it
        child.wait(10)
        assert {seg, sem} <= shm_names_now()
        assert sorted(sweep_shm_lists(str(tmp_path))) == sorted([seg, sem])
        assert not {seg, sem} & shm_names_now() and os.listdir(tmp_path) == []
    finally:
        kill_tree(child.pid)
        child.wait(10)
    # Names that are not multiprocessing's, or that hold a path, are never touched.
    record = tmp_path / f"shm-{2 ** 22 + 12345}.list"
    record.write_text("rf-1-0000000000000000-0\n../etc/passwd\npsm_/x\n")
    assert sweep_shm_lists(str(tmp_path), everything=True) == [] and not record.exists()


def test_the_names_a_process_made_itself_are_among_those_it_maps():
    # glibc makes a semaphore under a temporary name and links it as sem.mp-* afterwards: its
    # creator's mapping shows only the temporary name (vLLM's model worker makes one, tqdm's
    # lock, and nobody else opens it), and a name left unlisted outlives a killed job.
    child, seg, sem = start_child()
    try:
        assert {seg, sem} <= shm_names_mapped([child.pid])
    finally:
        kill_tree(child.pid, spare=is_resource_tracker)  # its tracker unlinks both
        child.wait(10)
    assert wait_until(lambda: not ({seg, sem} & shm_names_now()))


def test_a_spared_resource_tracker_unlinks_what_the_killed_processes_registered(tmp_path):
    child, seg, sem = start_child()
    tracker = None
    try:
        assert wait_until(lambda: any(is_resource_tracker(p) for p in psutil.Process(child.pid).children()))
        tracker = next(p for p in psutil.Process(child.pid).children() if is_resource_tracker(p))
        assert {seg, sem} <= shm_names_now()
        kill_tree(child.pid, spare=is_resource_tracker)
        child.wait(10)
        # Nobody writes to the tracker any more: it unlinks both and exits.
        assert wait_until(lambda: not ({seg, sem} & shm_names_now()))
        assert wait_until(lambda: not tracker.is_running() or tracker.status() == psutil.STATUS_ZOMBIE)
    finally:
        kill_tree(child.pid)
        if tracker is not None and tracker.is_running():
            tracker.kill()
        child.wait(10)


def test_record_shm_writes_one_name_a_line_its_own_openmp_registration_among_them(tmp_path):
    path = record_shm(str(tmp_path), {"psm_b", "psm_a"})
    assert os.path.basename(path) == f"shm-{os.getpid()}.list"
    assert open(path).read() == f"__KMP_REGISTERED_LIB_{os.getpid()}_{os.getuid()}\npsm_a\npsm_b\n"


def test_private_dirs_of_dead_supervisors_and_those_left_half_made_are_swept(tmp_path):
    from rollfleet.actors.process import OWNER_FILE, UNCLAIMED_AGE_S, claim_private_dir, sweep_private_dirs

    old = os.stat(tmp_path).st_mtime - UNCLAIMED_AGE_S - 5
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dirs = {name: tmp_path / name for name in ("rollfleet-dead", "rollfleet-mine", "rollfleet-empty-old",
                                                "rollfleet-halfowner-old", "rollfleet-empty-new", "rollfleet-model")}
    for d in dirs.values():
        d.mkdir()
    (dirs["rollfleet-dead"] / OWNER_FILE).write_text(f"{dead.stdout.strip()} 1.0\n")  # its owner has exited
    (dirs["rollfleet-dead"] / "workers.sock").write_text("")
    claim_private_dir(str(dirs["rollfleet-mine"]))  # alive: this process
    (dirs["rollfleet-halfowner-old"] / OWNER_FILE).write_text("")  # killed while writing its owner file
    (dirs["rollfleet-model"] / "config.json").write_text("{}")  # not a supervisor's: no owner file
    for name in ("rollfleet-empty-old", "rollfleet-halfowner-old", "rollfleet-model"):
        os.utime(dirs[name], (old, old))
    removed = sweep_private_dirs(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["rollfleet-dead", "rollfleet-empty-old",
                                                            "rollfleet-halfowner-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollfleet-empty-new", "rollfleet-mine", "rollfleet-model"]


def test_paths_asked_to_go_with_a_dead_supervisors_dir_go_with_it_unless_replaced(tmp_path):
    from rollfleet.actors.process import OWNER_FILE, remove_with, sweep_private_dirs

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    private = root / "rollfleet-dead"
    private.mkdir()
    (private / OWNER_FILE).write_text(f"{dead.stdout.strip()} 1.0\n")  # its owner has exited
    ready, model, replaced, kept = (outside / n for n in ("ready", "model dir\nx", "replaced", "kept"))
    ready.write_text("ipc:///x\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    replaced.write_text("old")
    kept.write_text("not listed")
    for path in (ready, model, replaced):
        remove_with(str(private), str(path))
    newer = outside / "replaced.tmp"  # another fleet's ready file, written as serve writes one
    newer.write_text("a new file in its place")
    os.replace(newer, replaced)  # another inode there now: not the one listed
    assert [os.path.basename(p) for p in sweep_private_dirs(str(root))] == ["rollfleet-dead"]
    assert not private.exists() and not ready.exists() and not model.exists()
    assert replaced.read_text() == "a new file in its place" and kept.exists()


def test_a_released_sentinel_exits_and_removes_nothing(tmp_path):
    from rollfleet.actors.process import claim_private_dir
    from rollfleet.actors.sentinel import Sentinel

    private = tmp_path / "rollfleet-x"
    private.mkdir()
    claim_private_dir(str(private))
    sentinel = Sentinel(str(private))
    assert os.getpgid(sentinel.pid) != os.getpgid(0)  # a signal to this process group does not reach it
    sentinel.close(timeout=30)
    assert sentinel.exited() and sentinel.popen.returncode == 0
    assert private.exists() and (private / "owner").exists()


def test_a_sentinel_whose_pipe_closes_unasked_removes_the_dir_but_spares_its_living_parents_segments(tmp_path):
    # The pipe's end closed without the word (here by hand; in life with the supervisor's process,
    # however it ended): the directory and what it lists go. Shared memory named after its parent
    # goes only once that process is gone: this one lives on (another fleet of it may be using it).
    from rollfleet.actors.process import claim_private_dir, remove_with
    from rollfleet.actors.sentinel import Sentinel

    private = tmp_path / "rollfleet-x"
    private.mkdir()
    claim_private_dir(str(private))
    (private / "workers.sock").write_text("")
    ready = tmp_path / "ready"
    ready.write_text("ipc:///x\n")
    remove_with(str(private), str(ready))
    segment = f"/dev/shm/rf-{os.getpid()}-{os.urandom(8).hex()}-0"
    with open(segment, "wb"):
        pass
    try:
        sentinel = Sentinel(str(private))
        os.close(sentinel._write_end)
        sentinel._write_end = -1
        sentinel.popen.wait(timeout=60)
        assert not private.exists() and not ready.exists()
        assert os.path.exists(segment)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment)
