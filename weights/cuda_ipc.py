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
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import torch

from .bucket import dtype_from_name, dtype_name

__all__ = ["CudaIpcChannel", "share", "open_shared", "device_uuid", "release_kept"]

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
        self._stream: Any = None

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
