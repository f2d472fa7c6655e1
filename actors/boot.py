"""A worker process's first steps, taken before anything heavy is imported.

The Supervisor starts each worker as ``python -m rollfleet.actors.boot``. Importing the worker
(asyncio, ZeroMQ, msgpack, psutil, the engines' package) takes a quarter of a second on an idle
machine and seconds on a busy one; until the worker's handlers are in place a signal would end
the process with no cleanup, and a supervisor that dies meanwhile would leave its private
directory to the next fleet. So, first:

- the kernel is asked for a SIGCONT when the supervisor dies (PR_SET_PDEATHSIG), so that a
  worker stopped even this early wakes up to notice;
- SIGINT is ignored (the supervisor decides what a Ctrl-C means), and SIGTERM, SIGHUP and
  SIGQUIT are held: ``actors.worker.main`` answers each one held once its handlers are in place.

This module imports nothing of rollfleet's but the worker, last; the package's ``__init__``
imports its modules only when their names are used.
"""

from __future__ import annotations

import signal
from typing import Any

HELD = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals a worker answers itself (actors.worker._on_sigterm)."""

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


def _hold(signum: int, _frame: Any) -> None:
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
    continue_on_parent_death()
    hold_signals()
    from .worker import main

    main(pending)


if __name__ == "__main__":
    boot()
