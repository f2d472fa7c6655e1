"""A fleet's last cleaner: a small process that outlives its supervisor only to clean up after it.

A supervisor killed outright (SIGKILL) leaves its cleanup to its workers, which notice its death
and remove its private directory (socket files, logs, what ``remove_with`` named) and the shared
memory of its weight updates. With no worker alive (one between restarts, a restart policy that
gave up), or with the workers killed together with it (SIGKILL to the process group), nobody was
left to do it until the next fleet started in the same place. The sentinel is that somebody.

The supervisor starts it as ``python -m rollfleet.actors.sentinel CONFIG`` before its first worker,
in a session of its own (a signal to the supervisor's process group does not reach it), with the
read end of a pipe as its stdin. It imports nothing heavy and waits:

- a ``q`` on the pipe is the supervisor's own shutdown, which cleans up itself: the sentinel exits;
- EOF without one (the supervisor's end closed with its process, however it ended), or a new
  parent pid (the supervisor is gone though a forked copy of it holds the pipe): the sentinel
  removes the private directory as a worker would, and, once its parent is gone, the shared-memory
  segments the supervisor created (``rf-<pid>-*``), then exits.

CONFIG is JSON: ``{"parent_pid": int, "private_dir": str}``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from .boot import continue_on_parent_death

__all__ = ["Sentinel"]

POLL_S = 0.5  # how often the parent pid is checked while the pipe stays open
QUIT = b"q"


class Sentinel:
    """The supervisor's side: start the process, and at shutdown tell it to go."""

    def __init__(self, private_dir: str):
        read_end, self._write_end = os.pipe()
        self._lock = threading.Lock()  # release() may come from another thread (Supervisor.abandon)
        config = {"parent_pid": os.getpid(), "private_dir": private_dir}
        try:
            self.popen = subprocess.Popen([sys.executable, "-m", "rollfleet.actors.sentinel", json.dumps(config)],
                                          stdin=read_end, stdout=subprocess.DEVNULL, close_fds=True,
                                          start_new_session=True)
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self.pid = self.popen.pid

    def release(self) -> None:
        """Tell the sentinel that this is an orderly end (it cleans nothing) and close our end.
        Harmless to call twice."""
        with self._lock:
            if self._write_end < 0:
                return
            try:
                os.write(self._write_end, QUIT)
            except OSError:  # it is gone already
                pass
            os.close(self._write_end)
            self._write_end = -1

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def kill(self) -> None:
        """Last resort, once released: it did not exit."""
        if not self.exited():
            self.popen.kill()
            self.popen.wait()

    def close(self, timeout: float = 2.0) -> None:
        """``release`` and wait for the process to exit (killed after ``timeout`` seconds)."""
        self.release()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def _parent_gone(parent: int) -> bool:
    """Whether the supervisor is gone: this process has a new parent, or (Linux) the supervisor's
    threads have all ended and only its zombie is left, waiting for its own parent. (The worker's
    check asks psutil; importing it here would hold 17 MB more for the sentinel's whole life.)"""
    if os.getppid() != parent:
        return True
    try:
        with open(f"/proc/{parent}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return os.path.isdir("/proc")  # no /proc at all: the parent pid is all there is to go by
    except (OSError, IndexError):
        return False


def _wait(parent: int) -> bool:
    """Block until the supervisor says quit (True) or is gone (False)."""
    while True:
        try:
            ready, _, _ = select.select([0], [], [], POLL_S)
        except InterruptedError:
            continue
        if ready:
            data = os.read(0, 64)
            if QUIT in data:
                return True
            if not data:
                return False
        elif _parent_gone(parent):
            return False


def _say(text: str) -> None:
    """A line where the supervisor's errors went; nothing if nobody reads them any more (its
    stderr a pipe whose reader was killed with it)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _clean(config: dict[str, Any]) -> None:
    """What a worker does when its supervisor dies, less killing its own children."""
    from .process import remove_private_dir, unlink_segments_of

    parent = int(config["parent_pid"])
    private_dir = config["private_dir"]
    removed = os.path.isdir(private_dir)
    if removed:
        remove_private_dir(private_dir)
    # The pipe may close with the process still exiting: its segments are its own until it is gone
    # (another fleet of the same process may be updating weights through its own).
    deadline = time.monotonic() + 5.0
    while not _parent_gone(parent) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _parent_gone(parent):
        unlink_segments_of(parent)
    if removed:  # said last: nothing it could raise stops the cleanup
        _say(f"rollfleet: process {parent} is gone; its sentinel removed {private_dir}")


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    # A sentinel stopped (SIGSTOP) is in a session of its own, where no terminal or group signal
    # would ever wake it: the kernel's SIGCONT at its parent's death does (a parent gone before
    # this: _wait sees it within POLL_S).
    continue_on_parent_death()
    if _wait(int(config["parent_pid"])):
        return 0
    try:
        _clean(config)
    except Exception as exc:
        _say(f"rollfleet sentinel: cleanup failed: {exc!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
