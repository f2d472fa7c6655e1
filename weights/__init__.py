"""Weight updates from the trainer to engine workers, in pipelined fixed-size buckets.

``WeightSender`` (trainer side) packs an iterable of (name, tensor) into buckets and moves
them over shared memory, CUDA IPC or a private torch.distributed group; ``WeightReceiver``
(engine worker side) turns each bucket back into tensors and hands them to the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import WeightSyncConfig, choose_transport

# The rest needs torch: imported on first use, so that checking a WeightSyncConfig does not.
_LAZY = {"Assembler": "bucket", "Packer": "bucket", "fill": "bucket", "unpack": "bucket",
         "WeightReceiver": "receiver", "UpdateReport": "sender", "WeightSender": "sender",
         "WorkerLink": "sender", "WorkerReport": "sender", "release_buffers": "sender"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "WeightSyncConfig",
    "choose_transport",
    "WeightSender",
    "WorkerLink",
    "UpdateReport",
    "WorkerReport",
    "release_buffers",
    "WeightReceiver",
    "Packer",
    "Assembler",
    "fill",
    "unpack",
]
