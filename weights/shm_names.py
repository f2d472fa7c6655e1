"""The names of the shm transport's segments (weights/shm.py): files under /dev/shm named
``rf-<creator pid>-<random hex>-<buffer>``. Apart from shm.py so that a supervisor can sweep the
segments of dead creators when it starts without importing torch."""

from __future__ import annotations

import os
import re
import secrets

import psutil

__all__ = ["SHM_DIR", "PREFIX", "new_name", "path_of", "unlink", "list_segments", "pid_alive", "sweep_stale"]

SHM_DIR = "/dev/shm"
PREFIX = "rf-"
_NAME = re.compile(r"^rf-(\d+)-[0-9a-f]{16}-\d+$")


def new_name(buffer: int, token: str | None = None) -> str:
    return f"{PREFIX}{os.getpid()}-{token or secrets.token_hex(8)}-{buffer}"


def path_of(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"not a rollfleet shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, name)


def unlink(name: str) -> bool:
    """Remove a segment's name (mappings stay valid). False if it was already gone."""
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False


def list_segments(pid: int | None = None) -> list[str]:
    """rollfleet segments in /dev/shm, optionally only those created by ``pid``."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and (pid is None or int(m.group(1)) == pid):
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
    """Unlink this user's segments whose creator process is gone (a sender killed with its
    receivers, whom nobody was left to unlink them for); returns their names."""
    removed = []
    me = os.getuid()
    for name in list_segments():
        pid = int(_NAME.match(name).group(1))  # type: ignore[union-attr]
        try:
            if os.stat(path_of(name)).st_uid == me and not pid_alive(pid) and unlink(name):
                removed.append(name)
        except OSError:  # gone meanwhile, or not ours to unlink
            continue
    return removed
