"""Helpers of the reliability tests: echo fleets, expected tokens, leak checks."""

from __future__ import annotations

import os
import time

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.engines.echo import echo_tokens
from rollfleet.weights.shm import SHM_DIR

from ..helpers import alive, kill_sentinel, sentinel_of, wait_for

__all__ = ["fleet", "expected_tokens", "wait_for", "segments_of", "alive", "assert_clean", "worker_pids", "sentinel_of",
           "kill_sentinel"]


def fleet(num_workers=2, **kw):
    options = kw.pop("engine_options", {})
    return Supervisor(FleetConfig(engine="echo", num_workers=num_workers, engine_options=options, **kw))


expected_tokens = echo_tokens


def worker_pids(sup):
    return {h.pid for h in sup.workers.values()}


def segments_of(pids):
    """rollfleet shared-memory segments in /dev/shm created by any of ``pids``."""
    prefixes = tuple(f"rf-{pid}-" for pid in pids)
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))
    except FileNotFoundError:
        return []


def assert_clean(private_dir, pids, creators=(), within=5.0):
    """No process of ``pids`` alive, the private directory (socket files) gone, and no
    shared-memory segment of this process, ``pids`` or ``creators`` left, once ``within``
    seconds have passed at most (those who clean up may still be at it)."""
    owners = {os.getpid(), *pids, *creators}
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (alive(pids) or segments_of(owners)
                                           or (private_dir is not None and os.path.exists(private_dir))):
        time.sleep(0.05)
    assert not alive(pids), f"orphan processes: {alive(pids)}"
    assert private_dir is None or not os.path.exists(private_dir), f"left behind: {os.listdir(private_dir)}"
    leaked = segments_of(owners)
    assert not leaked, f"leaked shared-memory segments: {leaked}"
