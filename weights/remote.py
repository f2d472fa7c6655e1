"""Reading another process's memory on this host: the shm transport's in-place reads.

A worker that the sender lets read its memory (``process_vm_readv``) copies the sender's
CPU tensors straight into the engine's parameters: one copy, where going through a shared
segment costs two (tensor -> segment in the sender, segment -> parameter in the worker).
The bucket entry of such a tensor carries ``address`` (where its bytes start in the
sender's address space) instead of a place in a buffer, and the engine receives a
``RemoteTensor`` for it: shape and dtype like a tensor, plus ``copy_into`` and ``read``.
Only engines that say so (``Engine.accepts_remote_tensors``) get them.

Permission: the kernel lets a process read another's memory when it could ptrace it (same
user, and with Yama's ptrace_scope 1 only a descendant of a process that allowed it).
``allow_descendants`` makes the sender such a process for the workers it spawned
(``PR_SET_PTRACER`` naming itself); ``probe`` checks, once per update, that the reads work
and reach the right process (the sender puts random bytes at an address and the worker
must read them back), so anything else (another pid namespace, ptrace_scope 2) falls back to
the shared segments.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import secrets
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .bucket import IN_PLACE_MIN_BYTES

__all__ = ["RemoteTensor", "available", "allow_descendants", "Probe", "probe", "read_into", "IN_PLACE_MIN_BYTES",
           "sent_in_place", "huge_pages_pending", "settle_huge_pages"]

MAX_THREADS = 16
"""Threads reading at once: a core copies only 4-9 GB/s this way (the kernel's work per page
included), so a read needs most of a machine's cores to come near one memcpy; the pool's
threads sleep between loads."""

_CHUNK = 16 << 20
"""Reads are split into pieces of about this size across threads."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Any = None
_libc_lock = threading.Lock()


def _load() -> Any:
    global _libc
    with _libc_lock:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.process_vm_readv
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
            libc.prctl.restype = ctypes.c_int
            libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            libc.madvise.restype = ctypes.c_int
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc = libc
        return _libc


def available() -> bool:
    """Whether this platform has process_vm_readv (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _load()
    except (OSError, AttributeError):
        return False
    return True


_PR_SET_PTRACER = 0x59616D61
_allowed = False


def allow_descendants() -> None:
    """Let this process's descendants read its memory under Yama's ptrace_scope 1 (a no-op
    without Yama). Called by a sender that offers in-place reads, once per process."""
    global _allowed
    if _allowed or not available():
        return
    _allowed = True
    # Fails with EINVAL without Yama (nothing to allow); either way the probe tells whether
    # reads work.
    _load().prctl(_PR_SET_PTRACER, os.getpid(), 0, 0, 0)


def _readv(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``remote`` in process ``pid`` to ``local`` here. OSError on failure
    (ESRCH: the process is gone; EFAULT: the range is not mapped there; EPERM: not allowed)."""
    libc = _load()
    done = 0
    while done < nbytes:
        lv = _IoVec(local + done, nbytes - done)
        rv = _IoVec(remote + done, nbytes - done)
        got = libc.process_vm_readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"reading {nbytes} bytes at {remote:#x} of process {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"reading {nbytes} bytes at {remote:#x} of process {pid}: short read")
        done += got


class RemoteTensor:
    """A contiguous tensor of another process (``pid``) at ``address``, read on demand."""

    __slots__ = ("pid", "address", "dtype", "shape", "nbytes")

    def __init__(self, pid: int, address: int, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> None:
        self.pid, self.address, self.dtype = pid, address, dtype
        self.shape = torch.Size(shape)
        self.nbytes = nbytes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def copy_into(self, dst: torch.Tensor) -> None:
        """Read the bytes into ``dst`` (same shape and dtype, CPU). A non-contiguous ``dst``
        gets them through a temporary tensor."""
        if tuple(dst.shape) != tuple(self.shape) or dst.dtype != self.dtype or dst.device.type != "cpu":
            raise ValueError(f"cannot read {tuple(self.shape)} {self.dtype} into {tuple(dst.shape)} "
                             f"{dst.dtype} on {dst.device}")
        if dst.is_contiguous():
            read_into([(self, dst)])
        else:
            dst.copy_(self.read())

    def read(self) -> torch.Tensor:
        """A fresh CPU tensor holding the bytes."""
        out = torch.empty(self.shape, dtype=self.dtype)
        read_into([(self, out)])
        return out

    def __repr__(self) -> str:
        return f"RemoteTensor(pid={self.pid}, address={self.address:#x}, {self.dtype}, {tuple(self.shape)})"


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    # The machine's cores, not torch's threads: an engine that decodes on one thread still
    # has every core for a weight load (generation waits for it; the sender is idle).
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="rollfleet-read")
        return _pool


def read_into(pairs: Sequence[tuple[RemoteTensor, torch.Tensor]], threads: int | None = None) -> None:
    """Read every RemoteTensor into its contiguous CPU destination, in pieces spread over
    ``threads`` (default: this process's cores, at most MAX_THREADS); the system call releases the
    GIL, so the pieces run in parallel. Raises OSError (see RemoteTensor) after every piece
    ended."""
    pieces = []
    for src, dst in pairs:
        if not dst.is_contiguous() or dst.device.type != "cpu":
            raise ValueError("read_into needs contiguous CPU destinations")
        n = dst.numel() * dst.element_size()
        if n != src.nbytes:
            raise ValueError(f"{src!r} has {src.nbytes} bytes, destination {n}")
        for start in range(0, n, _CHUNK):
            pieces.append((src.pid, dst.data_ptr() + start, src.address + start, min(_CHUNK, n - start)))
    workers = min(threads or _threads(), len(pieces))
    if workers <= 1:
        for piece in pieces:
            _readv(*piece)
        return
    # Contiguous runs of pieces, one per thread; this thread takes the first.
    per = -(-len(pieces) // workers)
    runs = [pieces[i : i + per] for i in range(0, len(pieces), per)]

    def run(chunk: list) -> None:
        for piece in chunk:
            _readv(*piece)

    futures = [_executor().submit(run, chunk) for chunk in runs[1:]]
    error: BaseException | None = None
    try:
        run(runs[0])
    except BaseException as exc:
        error = exc
    for fut in futures:
        try:
            fut.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


class Probe:
    """Random bytes in this (the sender's) process for a receiver to read back."""

    def __init__(self) -> None:
        self.value = secrets.token_bytes(16)
        self._buf = ctypes.create_string_buffer(self.value, len(self.value))

    @property
    def address(self) -> int:
        return ctypes.addressof(self._buf)

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "check": self.value}


def probe(pid: int, desc: Any) -> str | None:
    """None when ``desc`` (a Probe's description) reads back right from ``pid``; otherwise
    why not, in words."""
    if not available():
        return "process_vm_readv is not available on this platform"
    if type(desc) is not dict or type(desc.get("address")) is not int or type(desc.get("check")) is not bytes:
        return "malformed probe"
    check = desc["check"]
    if not 0 < len(check) <= 64 or desc["address"] <= 0:
        return "malformed probe"
    out = ctypes.create_string_buffer(len(check))
    try:
        _readv(pid, ctypes.addressof(out), desc["address"], len(check))
    except OSError as exc:
        return str(exc)
    if out.raw != check:
        return f"process {pid} holds other bytes at the probe's address"
    return None


# ---------------------------------------------------------------------------- huge pages
#
# Reading another process's memory costs a page-table walk and a reference per page: on 4 KiB
# pages that, not the copy, bounds process_vm_readv (about half a memcpy per core); on 2 MiB
# pages it runs near memcpy speed. A trainer's parameters live at the same addresses from
# one update to the next, so the sender moves the tensors that two updates in a row read in
# place onto huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1+), in a thread, after
# the second update; the next update waits for that to finish. Tensors gathered afresh for
# each update (FSDP) qualify only where the allocator put two of them at the same address.
# The contents never change; a range the trainer freed meanwhile only makes the call fail,
# which is ignored.

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

_seen: set[tuple[int, int]] = set()
_collapsed: set[tuple[int, int]] = set()
_job: concurrent.futures.Future | None = None
_huge_pool: concurrent.futures.ThreadPoolExecutor | None = None
_huge_lock = threading.Lock()


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _huge_ranges(regions: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
    out = set()
    for address, nbytes in regions:
        start = -(-address // _HUGE) * _HUGE
        end = (address + nbytes) // _HUGE * _HUGE
        if end > start:
            out.add((start, end))
    return out


def _collapse(ranges: list[tuple[int, int]]) -> int:
    """madvise each range onto huge pages; returns how many were collapsed."""
    madvise = _load().madvise
    done = 0
    for start, end in ranges:
        if madvise(start, end - start, _MADV_HUGEPAGE) == 0 and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += 1
    return done


def sent_in_place(regions: Sequence[tuple[int, int]]) -> concurrent.futures.Future | None:
    """After an update: ``regions`` (address, nbytes) were read in place. Those read in place
    by the update before too go onto huge pages in a thread; returns its future (or None)."""
    global _seen, _collapsed, _job, _huge_pool
    current = _huge_ranges(regions)
    with _huge_lock:
        again = sorted((current & _seen) - _collapsed)
        _seen = current
        _collapsed &= current
        if not again or not available() or not _thp_enabled():
            return None
        _collapsed |= set(again)
        if _huge_pool is None:
            _huge_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollfleet-hugepages")
        _job = _huge_pool.submit(_collapse, again)
        return _job


def huge_pages_pending() -> bool:
    return _job is not None and not _job.done()


def settle_huge_pages(timeout: float | None = 60.0) -> None:
    """Wait for the last ``sent_in_place`` job (the next update does, before it starts)."""
    job = _job
    if job is not None:
        try:
            job.result(timeout)
        except Exception:  # pragma: no cover - madvise errors are return codes, not exceptions
            pass
