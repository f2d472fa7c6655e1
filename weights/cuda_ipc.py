"""Sharing a CUDA buffer with another process on the same host, without pickle.

``torch.multiprocessing.reductions.reduce_tensor`` gives the arguments of
``rebuild_cuda_tensor``: sizes, a cudaIpcMemHandle, the ref-counter file and event handle
(bytes and ints) plus a few Python objects (classes, a dtype). ``share`` turns them into a
plain msgpack-able map; ``open_shared`` rebuilds the tensor from it. torch's own IPC
ref-counting keeps the sender's memory alive until every receiver has dropped its view.

The device index inside a handle is the sender's; processes may number GPUs differently
(CUDA_VISIBLE_DEVICES), so the map also carries the GPU's UUID and the receiver looks up
its own index for that UUID.
"""

from __future__ import annotations

from typing import Any

import torch

from .bucket import dtype_from_name, dtype_name

__all__ = ["CudaIpcChannel", "share", "open_shared", "device_uuid"]

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


class CudaIpcChannel:
    """Sender side of the cuda_ipc transport: two CUDA buffers whose handles go out once."""

    kind = "cuda_ipc"

    def __init__(self, links: list, config: Any, update_id: str) -> None:
        self.links = links
        self.device = torch.device(config.device or f"cuda:{torch.cuda.current_device()}")
        self.buffers: list[torch.Tensor] = []
        self._shared: list[dict[str, Any]] = []

    def allocate(self, size: int, num_buffers: int) -> None:
        for _ in range(num_buffers):
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.buffers.append(buf)
            self._shared.append({**share(buf), "size": size})

    def begin(self, link: Any, rank: int) -> tuple[list[dict], dict]:
        return list(self._shared), {}

    async def connect(self) -> None:
        return None

    def after_begin(self, replies: list[dict]) -> None:
        return None

    def ready(self, slot: int) -> None:
        # Receivers read the buffer on their own streams: the fill must be complete first.
        torch.cuda.synchronize(self.device)

    def transfer(self, slot: int, nbytes: int) -> None:
        return None

    def close(self) -> None:
        self.buffers.clear()
        self._shared.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
