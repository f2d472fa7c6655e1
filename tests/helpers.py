"""Helpers shared by the test folders: waiting, a process's workers and sentinel, and a stand-in
fleet frontend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import psutil
import zmq
import zmq.asyncio


async def wait_for(pred, timeout: float = 5.0, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``pred`` (a function or a coroutine function) every ``interval`` seconds until it is
    true; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred() if asyncio.iscoroutinefunction(pred) else pred():
            return True
        await asyncio.sleep(interval)
    return False


def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Blocking: poll ``cond`` until it is true; its last value on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def children_running(pid, module):
    """The children of the process ``pid`` that run ``python -m <module>``."""
    out = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            if module in " ".join(child.cmdline()):
                out.append(child)
    return out


def worker_children(pid):
    """The worker processes (``python -m rollfleet.actors.boot``) the process ``pid`` started."""
    return children_running(pid, "rollfleet.actors.boot")


def sentinel_of(pid):
    """The pid of the sentinel process (actors.sentinel) that the process ``pid`` started, or None."""
    try:
        found = children_running(pid, "rollfleet.actors.sentinel")
    except psutil.NoSuchProcess:
        return None
    return found[0].pid if found else None


def alive(pids):
    """Those of ``pids`` that still run (a zombie, waiting to be reaped, does not)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_sentinel(pid):
    """SIGKILL the sentinel of the process ``pid`` (as a kill of every process of the job, a
    container stopped, say, takes it too) and wait until it is gone; returns its pid."""
    sentinel = sentinel_of(pid)
    assert sentinel is not None, f"process {pid} has no sentinel"
    os.kill(sentinel, signal.SIGKILL)
    assert wait_until(lambda: not alive([sentinel])), f"sentinel {sentinel} outlived SIGKILL"
    return sentinel


@contextlib.asynccontextmanager
async def stand_in_fleet(answer: Callable[[bytes], bytes | None]) -> AsyncIterator[str]:
    """A stand-in for a fleet's frontend, for clients tested against a peer that behaves in a
    way no real fleet does (one from before a protocol feature, one that stops answering): a
    ROUTER on a random local TCP port. Each frame a client sends is given to ``answer``, which
    returns the frame to send back to that client or None for no answer. Yields its address."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            identity, frame = await router.recv_multipart()
            reply = answer(frame)
            if reply is not None:
                await router.send_multipart([identity, reply])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close(0)
        ctx.term()
