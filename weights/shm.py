"""POSIX shared-memory segments for the shm transport, with explicit ownership.

Segments are plain files under /dev/shm named ``rf-<creator pid>-<random hex>-<buffer>``,
mapped with mmap (MAP_SHARED | MAP_POPULATE) as uint8 tensors. Python's multiprocessing.shared_memory is
avoided on purpose: its resource tracker unlinks or warns about segments in processes that
merely attached them.

Who unlinks: the sender unlinks its segments as soon as every receiver has mapped them
(after WeightsBegin), so a crash of either side later leaves nothing behind; a supervisor
that dies before that has its workers unlink its names as they exit. Only when a
receiver asks to keep the names (an engine that opens them by name in another process)
do they live for the whole update; then the sender unlinks in ``finally``, the receiver
unlinks when it sees the sender die, and ``sweep_stale`` removes leftovers of dead
creators on the next update.

Reuse: creating a segment costs far more than filling it (the kernel must allocate and
zero every page; on a virtual machine each first touch also traps to the host), so the
sender keeps its segments after an update (``Segments`` checked back in) and receivers
keep their mappings, keyed by the segments' token. By then the names are gone: what stays
is memory mapped by live processes only, which the kernel frees when the last of them
unmaps or exits, so nothing can be left behind. A receiver that does not hold the token
(a restarted worker) answers ``need_names`` and the sender starts over with fresh
segments.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading

import psutil
import torch

from . import remote
from .shm_names import PREFIX, SHM_DIR, OwnerLock, list_segments, new_name, pid_alive, sweep_stale, unlink
from .shm_names import path_of as _path

__all__ = ["ShmChannel", "Segments", "SHM_DIR", "PREFIX", "new_name", "create", "attach", "unlink", "list_segments",
           "sweep_stale", "pid_alive", "release_kept"]

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


class Segments:
    """A set of equal-sized segments created together; named until ``unlink_names``."""

    def __init__(self, size: int, count: int) -> None:
        self.token = secrets.token_hex(8)
        self.size = size
        self.names = [new_name(i, self.token) for i in range(count)]
        self.buffers: list[torch.Tensor] = []
        self.named = True
        # Held while the names are: a sweeper tells a dead creator by taking it (shm_names).
        self._owner: OwnerLock | None = None
        try:
            self._owner = OwnerLock(self.token)
        except OSError:  # no lock file: sweepers go by this process's pid instead
            pass
        try:
            for name in self.names:
                self.buffers.append(create(name, size))
        except BaseException:
            self.unlink_names()
            raise

    def fits(self, size: int, count: int, capacity: int) -> bool:
        # Exactly one bucket's capacity, or more than a single short bucket needs: a bigger
        # set left by an update with larger buckets is freed, not kept alongside.
        return len(self.buffers) >= count and size <= self.size <= max(size, capacity)

    def unlink_names(self) -> None:
        if self.named:
            for name in self.names:
                unlink(name)
            self.named = False
        if self._owner is not None:
            self._owner.release()
            self._owner = None


# The segments kept between updates by this (sender) process, and whether an update uses them.
_kept: Segments | None = None
_kept_busy = False
_kept_lock = threading.Lock()


def _checkout(size: int, count: int, capacity: int) -> tuple[Segments, bool]:
    """Segments for one update and whether they are the kept ones (already mapped by the
    receivers of an earlier update, names gone). Creates fresh, named ones otherwise."""
    global _kept, _kept_busy
    with _kept_lock:
        if _kept is not None and not _kept_busy and not _kept.named and _kept.fits(size, count, capacity):
            _kept_busy = True
            return _kept, True
    return Segments(size, count), False


def _checkin(segs: Segments, keep: bool) -> None:
    """End of an update: keep ``segs`` for the next one (names must be gone) or drop them."""
    global _kept, _kept_busy
    segs.unlink_names()
    with _kept_lock:
        if _kept is segs:
            _kept_busy = False
            if not keep:
                _kept = None
        elif keep and not _kept_busy:
            _kept = segs  # replaces (frees) an older set
        segs_kept = _kept is segs
    if not segs_kept:
        segs.buffers.clear()


def release_kept() -> None:
    """Free the segments this process keeps between updates (the next update creates new ones)."""
    global _kept
    with _kept_lock:
        if not _kept_busy:
            _kept = None


# Workers that accepted in-place reads from this process at their last begin: worker id ->
# that worker's pid. An update to the same processes assumes they still do, so that even its
# first bucket (packed before the begin's replies) may hold tensors larger than a bucket.
_accepted: dict[str, int] = {}


class ShmChannel:
    """Sender side of the shm transport: one set of segments shared by every shm receiver of
    this process (each fill is read by all of them), kept between updates when allowed.

    In place (``offer_in_place``): the begin also offers the receivers reads straight out of
    this process's memory (remote.py); tensors that ``in_place`` accepts then skip the
    segments, provisionally until every receiver has said yes (``accepted``)."""

    kind = "shm"

    def __init__(self, links: list, config: object, update_id: str) -> None:
        self.links = links
        self.keep = bool(getattr(config, "keep_buffers", True))
        self.segs: Segments | None = None
        self.count = 0
        self.buffers: list[torch.Tensor] = []
        self._start = psutil.Process().create_time()
        self.capacity = 0  # of a bucket, set by offer_in_place
        self.probe: remote.Probe | None = None
        self.accepted = False
        self.assumed = False
        self.regions: list[tuple[int, int]] = []  # (address, nbytes) offered in place

    def offer_in_place(self, capacity: int) -> None:
        """Offer in-place reads in the begin (where this platform has them), for buckets of
        ``capacity`` bytes."""
        self.capacity = capacity
        if remote.available():
            remote.allow_descendants()
            self.probe = remote.Probe()
            self.assumed = all(getattr(link, "pid", None) is not None and _accepted.get(link.worker_id) == link.pid
                               for link in self.links)

    def in_place(self, tensor: torch.Tensor) -> dict | None:
        """``{'address': ...}`` for a tensor the receivers may read where it lies: a plain,
        contiguous CPU tensor of IN_PLACE_MIN_BYTES or more (up to a bucket until the
        receivers have accepted, so that the buckets packed before can move into the
        buffers, unless the same worker processes accepted last time). None otherwise."""
        if self.probe is None or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return None  # (a subclass, e.g. DTensor, need not hold its values at data_ptr)
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
            return None
        if tensor.is_conj() or tensor.is_neg():
            return None  # lazily conjugated or negated: the bytes are not the values
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < remote.IN_PLACE_MIN_BYTES or nbytes > self.capacity and not (self.accepted or self.assumed):
            return None
        self.regions.append((tensor.data_ptr(), nbytes))
        return {"address": tensor.data_ptr()}

    @property
    def names(self) -> list[str]:
        return self.segs.names[: self.count] if self.segs is not None else []

    def allocate(self, size: int, num_buffers: int, capacity: int | None = None) -> None:
        self.segs, _ = _checkout(size, num_buffers, capacity or size)
        self.count = num_buffers
        self.buffers = self.segs.buffers[:num_buffers]
        self._size = size
        self._capacity = capacity or size

    def renew(self) -> None:
        """Fresh, named segments: some receiver does not hold the kept ones."""
        old, self.segs = self.segs, None
        if old is not None:
            _checkin(old, keep=False)
        self.segs = Segments(self._size, self.count)
        self.buffers = self.segs.buffers[: self.count]

    def begin(self, link: object, rank: int) -> tuple[list[dict], dict]:
        segs = self.segs
        assert segs is not None
        buffers = []
        for i in range(self.count):
            desc = {"size": segs.size, "pool": segs.token, "index": i}
            if segs.named:
                desc["name"] = segs.names[i]
            buffers.append(desc)
        options: dict = {"sender_pid": os.getpid(), "sender_start": self._start}
        if self.probe is not None:
            options["in_place"] = self.probe.describe()
        return buffers, options

    async def connect(self) -> None:
        return None

    def after_begin(self, replies: list[dict]) -> None:
        self.accepted = self.probe is not None and all(r.get("in_place") is True for r in replies)
        if self.probe is not None:
            for link, reply in zip(self.links, replies):
                pid = getattr(link, "pid", None)
                if reply.get("in_place") is True and pid is not None:
                    _accepted[link.worker_id] = pid
                else:
                    _accepted.pop(link.worker_id, None)
        # Every receiver has mapped the segments: drop the names now unless one must reopen
        # them by name (descriptor engines), so no later crash can leave them behind.
        if any(r.get("keep_names") for r in replies):
            self.keep = False  # such receivers need names every time: nothing to gain
        elif self.segs is not None:
            self.segs.unlink_names()

    def ready(self, slot: int) -> None:
        return None

    def transfer(self, slot: int, nbytes: int) -> None:
        return None

    def close(self) -> None:
        segs, self.segs = self.segs, None
        if segs is not None:
            _checkin(segs, keep=self.keep)
        self.buffers = []
