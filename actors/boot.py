"""A worker process's first steps, taken before anything heavy is imported.

The Supervisor starts each worker as ``python -m rollfleet.actors.boot``. Importing the worker
(asyncio, ZeroMQ, msgpack, psutil, the engines' package) takes a quarter of a second on an idle
machine and seconds on a busy one; until the worker's handlers are in place a signal would end
the process with no cleanup, and a supervisor that dies meanwhile would leave its private
directory to the next fleet. So:

- the supervisor starts the process with SIGTERM, SIGHUP, SIGQUIT and SIGINT blocked, and they
  are unblocked here only once their handling is in place: none is lost, however early;
- SIGINT is ignored (the supervisor decides what a Ctrl-C means); SIGTERM, SIGHUP and SIGQUIT
  are held, and ``actors.worker.main`` answers each one held once its handlers are in place. A
  SIGTERM the supervisor said is its own (a byte on the death pipe) ends the process at once:
  it holds nothing yet;
- the kernel is asked for a SIGCONT when the supervisor dies (PR_SET_PDEATHSIG), so that a
  worker stopped even this early wakes up to notice.

This module imports nothing of rollfleet's but the worker, last; the package's ``__init__``
imports its modules only when their names are used.
"""

from __future__ import annotations

import os
import signal
from typing import Any

CONFIG_ENV = "ROLLFLEET_WORKER_CONFIG"
"""The environment variable that holds a worker's config (JSON)."""

HELD = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals a worker answers itself (actors.worker._on_sigterm)."""

BLOCKED_AT_SPAWN = (*HELD, signal.SIGINT)
"""What the supervisor blocks while it starts a worker, which inherits the mask."""

pending: list[str] = []
"""Names of the held signals that came before the worker's handlers were in place."""


def continue_on_parent_death() -> None:
    """Have the kernel send SIGCONT when the parent dies (harmless to a running process)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGCONT), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker's watch threads notice once it runs again
        pass


_death_fd: int | None = None
"""The death pipe's read end (the worker's config says which), read by boot() before any held
signal can come."""


def _read_death_fd() -> int | None:
    try:
        import json

        fd = json.loads(os.environ[CONFIG_ENV]).get("death_fd")
    except (KeyError, ValueError, AttributeError):  # no config, or not a map: main says so
        return None
    return fd if type(fd) is int else None


def _supervisor_asked() -> bool:
    """Whether the supervisor wrote on the death pipe that the SIGTERM it sends is its own."""
    if _death_fd is None:
        return False
    try:
        import select

        if not select.select([_death_fd], [], [], 0)[0]:
            return False
        return bool(os.read(_death_fd, 64))  # b"": the pipe's end, the supervisor gone (cleaned up after, later)
    except (ValueError, OSError):
        return False


def _hold(signum: int, _frame: Any) -> None:
    if signum == signal.SIGTERM and _supervisor_asked():
        os._exit(0)  # its shutdown, while this process still starts: nothing to release yet
    pending.append(signal.Signals(signum).name)


def hold_signals() -> None:
    # Ctrl-C reaches the terminal's whole process group: left at its default it would end the
    # worker in a KeyboardInterrupt, with no cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in HELD:
        # The default action of each would end the worker with no cleanup at all. One the job
        # ignores (nohup: SIGHUP), inherited, stays ignored.
        if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _hold)


def boot() -> None:
    global _death_fd
    _death_fd = _read_death_fd()
    hold_signals()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED_AT_SPAWN)  # what came meanwhile arrives now
    continue_on_parent_death()
    from .worker import main

    main(pending)


if __name__ == "__main__":
    # As the package's module, not this __main__ copy: the worker imports that one, and the
    # signals held must be in the list it answers.
    from rollfleet.actors import boot as _module

    _module.boot()
