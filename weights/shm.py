"""POSIX shared-memory segments for the shm transport, with explicit ownership.

Segments are plain files under /dev/shm named ``rf-<creator pid>-<random hex>-<buffer>``,
mapped with mmap (MAP_SHARED | MAP_POPULATE) as uint8 tensors. Python's multiprocessing.shared_memory is
avoided on purpose: its resource tracker unlinks or warns about segments in processes that
merely attached them.

Who unlinks: the sender unlinks its segments as soon as every receiver has mapped them
(after WeightsBegin), so a crash of either side later leaves nothing behind. Only when a
receiver asks to keep the names (an engine that opens them by name in another process)
do they live for the whole update; then the sender unlinks in ``finally``, the receiver
unlinks when it sees the sender die, and ``sweep_stale`` removes leftovers of dead
creators on the next update.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import psutil
import torch

__all__ = ["ShmChannel", "SHM_DIR", "PREFIX", "new_name", "create", "attach", "unlink", "list_segments", "sweep_stale",
           "pid_alive"]

SHM_DIR = "/dev/shm"
PREFIX = "rf-"
_NAME = re.compile(r"^rf-(\d+)-[0-9a-f]{16}-\d+$")


def new_name(buffer: int, token: str | None = None) -> str:
    return f"{PREFIX}{os.getpid()}-{token or secrets.token_hex(8)}-{buffer}"


def _path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"not a rollfleet shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, name)


def create(name: str, size: int) -> torch.Tensor:
    """Create a segment of ``size`` bytes and map it as a uint8 tensor.

    The space is reserved up front (posix_fallocate): a full /dev/shm then fails here with
    OSError instead of killing the process with SIGBUS on first write."""
    path = _path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
            return _map(fd, size)
        finally:
            os.close(fd)
    except BaseException:
        unlink(name)
        raise


def attach(name: str, size: int) -> torch.Tensor:
    """Map an existing segment. ValueError if it is missing or smaller than ``size``
    (from_file would otherwise create a fresh, empty file)."""
    path = _path(name)
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise ValueError(f"shared-memory segment {name} does not exist") from None
    if actual < size:
        raise ValueError(f"shared-memory segment {name} has {actual} bytes, expected {size}")
    fd = os.open(path, os.O_RDWR)
    try:
        return _map(fd, size)
    finally:
        os.close(fd)


def _map(fd: int, size: int) -> torch.Tensor:
    # MAP_POPULATE faults every page in at once, in the kernel: far cheaper than one fault per
    # page on first touch, which otherwise costs as much as a copy of the buffer. The tensor
    # keeps the mmap object alive; the mapping goes away with the last tensor using it.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)


def unlink(name: str) -> bool:
    """Remove a segment's name (mappings stay valid). False if it was already gone."""
    try:
        os.unlink(_path(name))
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
    """Unlink segments whose creator process is gone; returns their names."""
    removed = []
    for name in list_segments():
        pid = int(_NAME.match(name).group(1))  # type: ignore[union-attr]
        if not pid_alive(pid) and unlink(name):
            removed.append(name)
    return removed


class ShmChannel:
    """Sender side of the shm transport: two segments shared by every shm receiver."""

    kind = "shm"

    def __init__(self, links: list, config: object, update_id: str) -> None:
        self.links = links
        self.names: list[str] = []
        self.buffers: list[torch.Tensor] = []
        self._start = psutil.Process().create_time()

    def allocate(self, size: int, num_buffers: int) -> None:
        token = secrets.token_hex(8)
        for i in range(num_buffers):
            name = new_name(i, token)
            self.buffers.append(create(name, size))
            self.names.append(name)

    def begin(self, link: object, rank: int) -> tuple[list[dict], dict]:
        buffers = [{"name": n, "size": b.numel()} for n, b in zip(self.names, self.buffers)]
        return buffers, {"sender_pid": os.getpid(), "sender_start": self._start}

    async def connect(self) -> None:
        return None

    def after_begin(self, replies: list[dict]) -> None:
        # Every receiver has mapped the segments: drop the names now unless one must reopen
        # them by name (descriptor engines), so no later crash can leave them behind.
        if not any(r.get("keep_names") for r in replies):
            for name in self.names:
                unlink(name)

    def ready(self, slot: int) -> None:
        return None

    def transfer(self, slot: int, nbytes: int) -> None:
        return None

    def close(self) -> None:
        for name in self.names:
            unlink(name)
        self.buffers.clear()
