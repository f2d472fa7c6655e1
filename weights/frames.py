"""The ``zmq`` transport: bucket bytes travel as an extra frame of the weights_bucket message.

For a worker that shares no memory with the sender and is not in a collective group (a
remote node without a torch.distributed route, a container without /dev/shm). The sender
fills its own buffers as usual; each bucket message carries ``buffer[:nbytes]`` as
frame 1, sent with copy=False; the worker reads the tensors straight out of that frame.
Slower than shared memory or NCCL, but it needs nothing but the control socket.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FramesChannel"]


class FramesChannel:
    kind = "zmq"

    def __init__(self, links: list, config: Any, update_id: str) -> None:
        self.links = links
        self.buffers: list[torch.Tensor] = []

    def allocate(self, size: int, num_buffers: int, capacity: int | None = None) -> None:
        self.buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(num_buffers)]

    def begin(self, link: Any, rank: int) -> tuple[list[dict], dict]:
        return [{"size": b.numel()} for b in self.buffers], {}

    async def connect(self) -> None:
        return None

    def after_begin(self, replies: list[dict]) -> None:
        return None

    def renew(self) -> None:
        return None

    def ready(self, slot: int) -> None:
        return None

    def transfer(self, slot: int, nbytes: int) -> None:
        return None

    def frame(self, slot: int, nbytes: int) -> memoryview:
        """The bucket's bytes, as the extra frame of its message (no copy)."""
        return memoryview(self.buffers[slot][:nbytes].numpy()).cast("B")

    def close(self) -> None:
        self.buffers = []
