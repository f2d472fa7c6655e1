"""Sharing a CUDA buffer with another process on the same host, without pickle.

``torch.multiprocessing.reductions.reduce_tensor`` gives the arguments of
``rebuild_cuda_tensor``: sizes, a cudaIpcMemHandle, the ref-counter file and event handle
(bytes and ints) plus a few Python objects (classes, a dtype). ``share`` turns them into a
plain msgpack-able map; ``open_shared`` rebuilds the tensor from it. torch's own IPC
ref-counting keeps the sender's memory alive until every receiver has dropped its view.

The device index inside a handle is the sender's; processes may number GPUs differently
(CUDA_VISIBLE_DEVICES), so the map also carries the GPU's UUID and the receiver looks up
its own index for that UUID.

Reuse: allocating and sharing a buffer, and above all opening a handle in the receiver
(cudaIpcOpenMemHandle maps the memory anew), cost far more than a bucket's copy. So the
sender keeps its buffers after an update and sends the same handles again, tagged with a
token; receivers keep the tensors they opened, keyed by that token (``open_cached``).
A handle stays valid as long as the sender's memory lives, so a receiver that does not
hold the token (a restarted worker) simply opens it.

In place (one copy instead of two): a contiguous CUDA tensor of the trainer need not go
through a buffer at all. ``export`` finds the allocation that holds it (the caching
allocator's segment) and that allocation's IPC handle, both through the CUDA driver API;
the bucket entry then says "segment k, offset o" and the engine copies straight out of
the trainer's memory. Allocations exported once are remembered (``_Exports``) for as long
as the storage exported lives, so later tensors in them, at this update or the next, cost
no driver call. ``Segments`` is the receiver's side: it maps each segment once and
keeps the mapping while updates keep naming it (opening and closing a mapping costs about
as much as copying 100 MB), closing the others at the end of each update. Memory the
driver cannot export (``expandable_segments``, other allocators) goes through the buffers.
"""

from __future__ import annotations

import bisect
import ctypes
import secrets
import threading
import weakref
from typing import Any

import torch

from .bucket import IN_PLACE_MIN_BYTES, dtype_from_name, dtype_name

__all__ = ["CudaIpcChannel", "Segments", "export", "share", "open_shared", "device_uuid", "release_kept"]

_STORAGE_CLASSES = {"UntypedStorage": torch.UntypedStorage, "TypedStorage": torch.storage.TypedStorage}


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(tensor: torch.Tensor) -> dict[str, Any]:
    """A msgpack-able description of a CUDA tensor that another process can open."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError("cuda_ipc can only share CUDA tensors")
    _, args = reduce_tensor(tensor)
    (_tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return {
        "tensor_size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "storage_cls": storage_cls.__name__,
        "dtype": dtype_name(dtype),
        "device": int(device),
        "uuid": device_uuid(int(device)),
        "handle": bytes(handle),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync_required),
    }


def _local_index(desc: dict[str, Any], fallback: int | None) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == desc.get("uuid"):
            return i
    return fallback if fallback is not None else int(desc["device"])


def open_shared(desc: dict[str, Any], device_index: int | None = None) -> torch.Tensor:
    """Rebuild a tensor shared by ``share`` in another process. ``device_index`` is used when
    the sender's GPU UUID is not visible here."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        storage_cls = _STORAGE_CLASSES[desc["storage_cls"]]
        args = (
            torch.Tensor,
            torch.Size(desc["tensor_size"]),
            tuple(desc["stride"]),
            int(desc["offset"]),
            storage_cls,
            dtype_from_name(desc["dtype"]),
            _local_index(desc, device_index),
            bytes(desc["handle"]),
            int(desc["storage_size"]),
            int(desc["storage_offset"]),
            False,
            bytes(desc["ref_counter_handle"]),
            int(desc["ref_counter_offset"]),
            bytes(desc["event_handle"]) if desc.get("event_handle") is not None else None,
            bool(desc["event_sync_required"]),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad cuda_ipc buffer description: {exc}") from None
    return rebuild_cuda_tensor(*args)


# ---------------------------------------------------------------- driver API (in place)

HANDLE_BYTES = 64
_MAX_PTR = 1 << 64


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class _Driver:
    """The few CUDA driver calls the in-place path needs, through ctypes (libcuda.so.1)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, uint, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER
        self.get_range = lib.cuMemGetAddressRange_v2
        self.get_range.argtypes = [ptr(u64), ptr(size_t), u64]
        self.get_handle = lib.cuIpcGetMemHandle
        self.get_handle.argtypes = [ptr(_Handle), u64]
        self.open_handle = lib.cuIpcOpenMemHandle_v2
        self.open_handle.argtypes = [ptr(u64), _Handle, uint]
        self.close_handle = lib.cuIpcCloseMemHandle
        self.close_handle.argtypes = [u64]
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.retain.argtypes = [ptr(ctypes.c_void_p), ctypes.c_int]
        self.push = lib.cuCtxPushCurrent_v2
        self.push.argtypes = [ctypes.c_void_p]
        self.pop = lib.cuCtxPopCurrent_v2
        self.pop.argtypes = [ptr(ctypes.c_void_p)]
        self.current = lib.cuCtxGetCurrent
        self.current.argtypes = [ptr(ctypes.c_void_p)]
        self._contexts: dict[int, ctypes.c_void_p] = {}

    def context(self, device: int) -> ctypes.c_void_p:
        """The primary context of ``device`` (the one torch uses), retained once."""
        ctx = self._contexts.get(device)
        if ctx is None:
            ctx = ctypes.c_void_p()
            _check(self.retain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = ctx
        return ctx


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed (CUresult {result})")


class _Current:
    """Makes a device's primary context current on this thread for a few driver calls
    (usually it is already: torch made it so)."""

    def __init__(self, drv: _Driver, device: int) -> None:
        self.drv, self.ctx = drv, drv.context(device)
        self.pushed = False

    def __enter__(self) -> None:
        now = ctypes.c_void_p()
        if self.drv.current(ctypes.byref(now)) == 0 and now.value == self.ctx.value:
            return
        _check(self.drv.push(self.ctx), "cuCtxPushCurrent")
        self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            self.pushed = False
            self.drv.pop(ctypes.byref(ctypes.c_void_p()))


def export(tensor: torch.Tensor) -> tuple[bytes, int, int, int] | None:
    """(IPC handle of the allocation holding ``tensor``, the allocation's base address, the
    tensor's byte offset in it, the allocation's size), or None when the driver cannot
    export that memory (not a plain cudaMalloc allocation, e.g. with ``expandable_segments``)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        return None
    try:
        drv = _get_driver()
        base, size, handle = ctypes.c_uint64(), ctypes.c_size_t(), _Handle()
        ptr = tensor.data_ptr()
        with _Current(drv, tensor.device.index):
            if drv.get_range(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
                return None
            if drv.get_handle(ctypes.byref(handle), base.value) != 0:
                return None
    except (OSError, RuntimeError, AttributeError):
        return None
    return bytes(handle), base.value, ptr - base.value, size.value


class _Exports:
    """Allocations exported before, so that their tensors need no driver call (two per
    tensor, ~15 us) at every update: sorted [(base, end, handle, weak reference to the
    storage exported)]. An entry holds while that storage lives: a live storage keeps its
    block, hence the whole allocation, allocated, so any tensor lying in [base, end) lies in
    that same allocation (and the handle still names it). Once the storage is gone the
    allocation may have been freed and its addresses reused, so the next tensor there is
    exported afresh. Nothing here keeps memory alive."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, bytes, weakref.ref]] = []
        self._lock = threading.Lock()

    def find(self, tensor: torch.Tensor, nbytes: int) -> tuple[bytes, int] | None:
        """(handle, offset in the allocation) for a contiguous CUDA tensor, or None."""
        ptr = tensor.data_ptr()
        with self._lock:
            k = bisect.bisect_right(self._ranges, (ptr, _MAX_PTR)) - 1
            if k >= 0:
                base, end, handle, storage = self._ranges[k]
                if ptr + nbytes <= end and storage() is not None:
                    return handle, ptr - base
        exported = export(tensor)
        if exported is None:
            return None
        handle, base, offset, size = exported
        with self._lock:
            self._ranges = [r for r in self._ranges if r[3]() is not None and (r[1] <= base or r[0] >= base + size)]
            bisect.insort(self._ranges, (base, base + size, handle, weakref.ref(tensor.untyped_storage())))
        return handle, offset


_exports = _Exports()


class _Array:
    """A device pointer in the ``__cuda_array_interface__`` form torch.as_tensor takes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class Segments:
    """The receiver's mappings of the sender's segments, by handle, kept across updates.

    ``open`` maps a segment (or returns the mapping it already has) as a flat uint8 tensor;
    ``end_update`` closes the mappings the update just ended did not use; ``close`` closes
    all. Views handed to the engine must not outlive the update (the engine copies)."""

    def __init__(self, device_index: int) -> None:
        self.device = device_index
        self._mapped: dict[bytes, tuple[int, torch.Tensor]] = {}
        self._used: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._mapped)

    def open(self, handle: bytes) -> torch.Tensor:
        if type(handle) is not bytes or len(handle) != HANDLE_BYTES:
            raise ValueError(f"a segment handle must be {HANDLE_BYTES} bytes")
        held = self._mapped.get(handle)
        if held is None:
            drv = _get_driver()
            ptr, base, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
            with _Current(drv, self.device):
                result = drv.open_handle(ctypes.byref(ptr), _Handle.from_buffer_copy(handle), 1)  # lazy peer access
                if result != 0:
                    raise ValueError(f"cannot open the sender's CUDA memory (CUresult {result})")
                if drv.get_range(ctypes.byref(base), ctypes.byref(size), ptr.value) != 0:
                    drv.close_handle(ptr.value)
                    raise ValueError("cannot size the sender's CUDA memory")
            flat = torch.as_tensor(_Array(ptr.value, size.value), device=f"cuda:{self.device}")
            held = self._mapped[handle] = (ptr.value, flat)
        self._used.add(handle)
        return held[1]

    def holds(self, handle: Any, flat: torch.Tensor) -> bool:
        held = self._mapped.get(handle) if type(handle) is bytes else None
        return held is not None and held[1] is flat

    def end_update(self) -> None:
        for handle in [h for h in self._mapped if h not in self._used]:
            self._close(handle)
        self._used = set()

    def close(self) -> None:
        for handle in list(self._mapped):
            self._close(handle)
        self._used = set()

    def _close(self, handle: bytes) -> None:
        ptr, _ = self._mapped.pop(handle)
        try:
            drv = _get_driver()
            with _Current(drv, self.device):
                drv.close_handle(ptr)
        except (OSError, RuntimeError) as exc:  # the context may be gone at exit
            import logging

            logging.getLogger(__name__).debug("closing a CUDA IPC mapping failed: %s", exc)


# ---------------------------------------------------------------- transfer buffers


class _Buffers:
    def __init__(self, device: torch.device, size: int, count: int) -> None:
        self.token = secrets.token_hex(8)
        self.device = device
        self.size = size
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        self.shared = [{**share(b), "size": size, "pool": self.token, "index": i} for i, b in enumerate(self.buffers)]

    def fits(self, device: torch.device, size: int, count: int, capacity: int) -> bool:
        return self.device == device and len(self.buffers) >= count and size <= self.size <= max(size, capacity)


_kept: _Buffers | None = None
_kept_busy = False
_kept_lock = threading.Lock()


def release_kept() -> None:
    """Free the CUDA buffers this process keeps between updates."""
    global _kept
    with _kept_lock:
        if not _kept_busy:
            _kept = None
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # frees shared blocks the receivers have let go of


class CudaIpcChannel:
    """Sender side of the cuda_ipc transport: two CUDA buffers whose handles go out once per
    update, kept (with their handles) for the next update unless ``keep_buffers`` is off."""

    kind = "cuda_ipc"

    def __init__(self, links: list, config: Any, update_id: str) -> None:
        self.links = links
        self.device = torch.device(config.device or f"cuda:{torch.cuda.current_device()}")
        self.keep = bool(getattr(config, "keep_buffers", True))
        self.buffers: list[torch.Tensor] = []
        self._set: _Buffers | None = None
        self._count = 0
        self._segments: dict[bytes, int] = {}

    def in_place(self, tensor: torch.Tensor) -> dict[str, Any] | None:
        """Where the receivers can read ``tensor`` in place ({'segment', 'offset'}, and
        'handle' the first time this update names the segment), or None: then it goes
        through the buffers. Only contiguous tensors of IN_PLACE_MIN_BYTES or more on this
        channel's device: below that a copy into the buffer costs less than a view."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device != self.device or nbytes < IN_PLACE_MIN_BYTES or not tensor.is_contiguous():
            return None
        exported = _exports.find(tensor, nbytes)
        if exported is None:
            return None
        handle, offset = exported
        index = self._segments.get(handle)
        if index is None:
            index = self._segments[handle] = len(self._segments)
            return {"segment": index, "offset": offset, "handle": handle}
        return {"segment": index, "offset": offset}

    def allocate(self, size: int, num_buffers: int, capacity: int | None = None) -> None:
        global _kept_busy
        with _kept_lock:
            if _kept is not None and not _kept_busy and _kept.fits(self.device, size, num_buffers, capacity or size):
                _kept_busy = True
                self._set = _kept
        if self._set is None:
            self._set = _Buffers(self.device, size, num_buffers)
        self._count = num_buffers
        self.buffers = self._set.buffers[:num_buffers]

    def begin(self, link: Any, rank: int) -> tuple[list[dict], dict]:
        assert self._set is not None
        return list(self._set.shared[: self._count]), {}

    async def connect(self) -> None:
        return None

    def after_begin(self, replies: list[dict]) -> None:
        return None

    def renew(self) -> None:  # receivers open handles themselves; never asked for
        return None

    def ready(self, slot: int) -> None:
        # Receivers read the buffer on their own streams: the fill (issued on this thread's
        # current stream) must be complete first. Only that stream is waited for, not the
        # whole device, so the trainer's unrelated work on other streams does not stall it.
        torch.cuda.current_stream(self.device).synchronize()

    def transfer(self, slot: int, nbytes: int) -> None:
        return None

    def close(self) -> None:
        global _kept, _kept_busy
        buffers, self._set = self._set, None
        self.buffers = []
        if buffers is None:
            return
        with _kept_lock:
            if _kept is buffers:
                _kept_busy = False
                if not self.keep:
                    _kept = None
            elif self.keep and not _kept_busy:
                _kept = buffers
            kept = _kept is buffers
        if not kept:
            buffers.buffers.clear()
            buffers.shared.clear()
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()
