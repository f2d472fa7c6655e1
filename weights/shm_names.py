"""The names of the shm transport's segments (weights/shm.py): files under /dev/shm named
``rf-<creator pid>-<random hex>-<buffer>``. Apart from shm.py so that a supervisor can sweep the
segments of dead creators when it starts without importing torch.

Whether a creator is gone is told by a lock, not by its pid: while a set of segments is named,
its creator holds an exclusive flock on ``rf-<pid>-<the set's hex>.lock`` beside them
(``OwnerLock``). The kernel drops the lock when the holder dies, SIGKILL included, so a sweeper
that can take it knows the creator is gone, wherever it runs: a pid is no proof in another pid
namespace sharing /dev/shm (a container restarted with the same /dev/shm, where the new fleet
is pid 1 again, as the dead one was) nor once recycled. Segments without a lock file (a creator
that could not make one) fall back to the pid."""

from __future__ import annotations

import fcntl
import os
import re
import secrets

import psutil

__all__ = ["SHM_DIR", "PREFIX", "new_name", "path_of", "unlink", "list_segments", "pid_alive", "sweep_stale",
           "OwnerLock", "lock_path"]

SHM_DIR = "/dev/shm"
PREFIX = "rf-"
_NAME = re.compile(r"^rf-(\d+)-([0-9a-f]{16})-\d+$")
_LOCK = re.compile(r"^rf-(\d+)-([0-9a-f]{16})\.lock$")


def new_name(buffer: int, token: str | None = None) -> str:
    return f"{PREFIX}{os.getpid()}-{token or secrets.token_hex(8)}-{buffer}"


def path_of(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"not a rollfleet shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, name)


def unlink(name: str) -> bool:
    """Remove a segment's name (mappings stay valid). False if it was already gone. The last
    of another process's set to go takes the set's lock file with it when nobody holds the lock
    (a receiver unlinking what a dead sender offered); this process's own sets drop theirs with
    their OwnerLock."""
    if not _unlink_name(name):
        return False
    pid, token = _NAME.match(name).groups()  # type: ignore[union-attr]
    lock = lock_path(int(pid), token)
    if int(pid) != os.getpid() and os.path.exists(lock) and not list_segments(int(pid), token) \
            and _holder_gone(lock):
        _unlink_quietly(lock)
    return True


def _unlink_name(name: str) -> bool:
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False


def lock_path(pid: int, token: str) -> str:
    """The lock file of the set of segments ``rf-<pid>-<token>-*``."""
    return os.path.join(SHM_DIR, f"{PREFIX}{pid}-{token}.lock")


class OwnerLock:
    """The flock this process holds on a set's lock file while the set is named (see the module
    docstring). Taken before the segments are made, so that a live set always has one."""

    def __init__(self, token: str) -> None:
        self.path = lock_path(os.getpid(), token)
        self.fd: int | None = None
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it for an instant at most
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)  # a sweeper took it for a dead one's between open and flock: again

    def release(self) -> None:
        """Unlink the lock file and drop the lock (after the set's names are gone). Idempotent."""
        if self.fd is not None:
            _unlink_quietly(self.path)
            os.close(self.fd)
            self.fd = None


def _holder_gone(path: str) -> bool | None:
    """Whether nobody holds the lock at ``path`` (its holder died, or let go); None if there is
    no such file. A lock held by this very process counts as held: flock locks belong to open
    files, and this opens another."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError:  # not ours to open: somebody's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # BlockingIOError: held
        return False
    finally:
        os.close(fd)  # and with it our lock, if we took it


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def list_segments(pid: int | None = None, token: str | None = None) -> list[str]:
    """rollfleet segments in /dev/shm, optionally only those created by ``pid`` (and of the set
    ``token``). Lock files are not segments."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and (pid is None or int(m.group(1)) == pid) and (token is None or m.group(2) == token):
            out.append(name)
    return sorted(out)


def pid_alive(pid: int, start_time: float | None = None) -> bool:
    """Whether ``pid`` runs and, when ``start_time`` is given, is the same process (not a
    recycled pid). Zombies count as dead."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return start_time is None or abs(proc.create_time() - start_time) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: it exists
        return True


def sweep_stale() -> list[str]:
    """Unlink this user's segments whose creator is gone (a sender killed with its receivers,
    whom nobody was left to unlink them for), and the lock files nobody holds; returns the
    segments' names. Gone: nobody holds the set's lock; where the set has no lock file, its
    creator's pid runs no more."""
    removed = []
    me = os.getuid()
    verdicts: dict[tuple[str, str], bool] = {}  # per set: its names share one lock
    for name in list_segments():
        pid, token = _NAME.match(name).groups()  # type: ignore[union-attr]
        try:
            if os.stat(path_of(name)).st_uid != me:
                continue
            gone = verdicts.get((pid, token))
            if gone is None:
                gone = _holder_gone(lock_path(int(pid), token))
                if gone is None:
                    gone = not pid_alive(int(pid))
                verdicts[(pid, token)] = gone
            if gone and _unlink_name(name):  # (their lock files go in the pass below)
                removed.append(name)
        except OSError:  # gone meanwhile, or not ours to unlink
            continue
    try:
        locks = [n for n in os.listdir(SHM_DIR) if _LOCK.match(n)]
    except OSError:
        locks = []
    for name in locks:  # a set whose segments went before its lock (a crash in between)
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == me and _holder_gone(path):
                _unlink_quietly(path)
        except OSError:
            continue
    return removed
