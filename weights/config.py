"""Settings of a weight update, and the per-worker choice of transport."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from ..fielddoc import document_fields

__all__ = ["WeightSyncConfig", "TRANSPORTS", "choose_transport", "is_local_host"]

TRANSPORTS = ("shm", "cuda_ipc", "collective", "zmq")


@document_fields
@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    bucket_bytes: int = 256 << 20
    """Size of one bucket (and of each transfer buffer). Rounded down to 64 bytes."""
    transport: str = "auto"
    """'auto' (per worker, see choose_transport), 'shm', 'cuda_ipc', 'collective', or 'zmq' (bucket
    bytes as frames on the control socket: needs nothing shared; never chosen by 'auto')."""
    timeout_s: float = 120.0
    """Longest wait for one worker's answer to one message (also the collective's timeout)."""
    abort_timeout_s: float = 5.0
    """Longest wait for a worker to acknowledge an aborted update (WeightsEnd commit=False)."""
    collective_backend: str = "auto"
    """'gloo', 'nccl', or 'auto': nccl when this process and the workers have CUDA, else gloo."""
    master_addr: str = ""
    """Address the workers use to reach this process's rendezvous store for the collective
    transport; '' means 127.0.0.1 when every collective worker is local, else the host of the
    fleet's worker socket when it is bound to one that is not loopback (the address those
    workers dialled; for a wildcard bind, the host it was published under), else this host's
    address on the route to the first of their hosts that resolves here, else this host's fully
    qualified name (see weights.collective.rendezvous_address)."""
    num_buffers: int = 0
    """Transfer buffers of an update (2 or more): the sender fills one while the engines load
    the others. 0: three when every buffer is in host memory (shm, zmq, gloo), so the sender
    can run a bucket ahead of a slow load (about 1.3x the throughput of two on a 2-core
    machine), two when they are on a GPU, where memory is dearer."""
    keep_buffers: bool = True
    """Keep the transfer buffers (shm segments, CUDA buffers) in this process after an
    update, and let receivers keep their mappings of them, so the next update with the same
    bucket size skips allocating, mapping and faulting them in. Between updates they hold
    num_buffers x bucket_bytes of memory; ``False`` frees them after every update."""
    fill_threads: int = 0
    """CPU threads that copy tensors into a bucket's buffer; 0: half of torch's threads (at
    least 1), leaving the rest to the engines, which copy the previous bucket meanwhile."""
    in_place: bool = True
    """Engines copy the trainer's big tensors straight out of its memory, one copy instead of
    two (into a buffer, out of it). cuda_ipc: contiguous CUDA tensors of 1 MiB or more on the
    sender's device (through their allocation's IPC handle). shm: contiguous CPU tensors of
    1 MiB or more, read by the workers with process_vm_readv when every worker of the update
    can (Linux; the engine must take them: the torch engine on CPU does; under Yama's
    ptrace_scope 1 the sender lets its own descendants read it, see weights/remote.py).
    Such tensors are kept alive only until their bucket is loaded, and up to four buckets
    read wholly in place may be in flight. False: every byte goes through the buffers.
    Updates that mix transports, and LoRA updates over shm, use the buffers."""
    huge_pages: bool = True
    """shm in place: trainer tensors read in place by two updates in a row are moved onto
    2 MiB pages (madvise MADV_HUGEPAGE + MADV_COLLAPSE, in a thread after the update; the
    next update waits for it), which makes the workers' reads about twice as fast. Only
    the page size of that memory changes, never its contents or addresses."""
    device: str = ""
    """CUDA device of the sender's buffers for cuda_ipc and nccl; '' means the current device."""

    def __post_init__(self) -> None:
        if type(self.bucket_bytes) is not int or not 64 <= self.bucket_bytes < 1 << 63:
            # (the wire's ints are signed 64-bit, PROTOCOL 3)
            raise ValueError(f"bucket_bytes must be an int >= 64 and < 2**63, got {self.bucket_bytes!r}")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got {self.transport!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.abort_timeout_s > 0:
            raise ValueError(f"abort_timeout_s must be > 0, got {self.abort_timeout_s}")
        if self.collective_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"collective_backend must be auto, gloo or nccl, got {self.collective_backend!r}")
        if type(self.fill_threads) is not int or self.fill_threads < 0:
            raise ValueError(f"fill_threads must be an int >= 0, got {self.fill_threads!r}")
        if type(self.num_buffers) is not int or self.num_buffers not in range(2, 17) and self.num_buffers != 0:
            raise ValueError(f"num_buffers must be 0 (auto) or an int from 2 to 16, got {self.num_buffers!r}")
        if type(self.in_place) is not bool:
            raise ValueError(f"in_place must be a bool, got {self.in_place!r}")
        if type(self.huge_pages) is not bool:
            raise ValueError(f"huge_pages must be a bool, got {self.huge_pages!r}")
        if type(self.keep_buffers) is not bool:
            raise ValueError(f"keep_buffers must be a bool, got {self.keep_buffers!r}")
        if self.device and not self.device.startswith("cuda"):
            raise ValueError(f"device must be a CUDA device ('cuda', 'cuda:N') or '', got {self.device!r}")


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine. An empty host counts as local: workers that the
    supervisor spawned itself may register without one."""
    return host in ("", "localhost", "127.0.0.1", "::1", socket.gethostname())


def choose_transport(link: Any, config: WeightSyncConfig) -> str:
    """The transport for one worker: config.transport when set, else cuda_ipc on the same host
    with a CUDA worker and CUDA here, shm on the same host otherwise, collective across hosts."""
    if config.transport != "auto":
        return config.transport
    if not is_local_host(link.host):
        return "collective"
    if str(link.device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return "cuda_ipc"
    return "shm"
