"""Weight updates from the trainer to engine workers, in pipelined fixed-size buckets.

``WeightSender`` (trainer side) packs an iterable of (name, tensor) into buckets and moves
them over shared memory, CUDA IPC or a private torch.distributed group; ``WeightReceiver``
(engine worker side) turns each bucket back into tensors and hands them to the engine.
"""

from .bucket import Assembler, Packer, fill, unpack
from .config import WeightSyncConfig, choose_transport
from .receiver import WeightReceiver
from .sender import UpdateReport, WeightSender, WorkerLink, WorkerReport, release_buffers

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
