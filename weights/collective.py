"""A private torch.distributed group between the trainer side (rank 0) and engine workers.

The group is built straight from a ``PrefixStore`` over a ``TCPStore`` with the backend's
own class (``ProcessGroupGloo`` / ``ProcessGroupNCCL``). ``new_group`` is not used: it needs
the default group, which belongs to the trainer and must stay untouched (a trainer's default
group may not even exist, and if it does, adding engine ranks to it is impossible).

Rendezvous: the sender opens a TCPStore on a free port and sends ``{'addr', 'port',
'world_size', 'rank', 'backend', 'prefix', 'timeout_s'}`` in WeightsBegin.options; every
rank then constructs the group (this blocks until all ranks joined, so the sender builds
its side concurrently with the WeightsBegin calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..transport.sockets import is_loopback_host, route_source, route_to

__all__ = ["CollectiveChannel", "release_kept", "open_store", "make_group", "broadcast", "close_group", "release_group",
           "in_thread", "local_address", "rendezvous_address"]


def local_address(peer: str) -> str:
    """The address of this host on the route to ``peer`` (no packet is sent)."""
    if peer in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return route_to(peer) or socket.gethostbyname(socket.gethostname())


def rendezvous_address(links: list, fleet_host: str = "") -> str:
    """Where the collective's workers dial this process's store: 127.0.0.1 when every one of them
    is on this host; else ``fleet_host`` (the host they reached the fleet's worker socket at, when
    the fleet names one other than a loopback one); else this host's address (IPv4 or IPv6) on
    the route to the first of their hosts that resolves here; else this host's fully qualified
    name. ``WeightSyncConfig.master_addr``, when set, goes before all of these."""
    from .config import is_local_host

    remote = [l.host for l in links if not is_local_host(l.host)]
    if not remote:
        return "127.0.0.1"
    if fleet_host and not is_loopback_host(fleet_host):
        return fleet_host  # (a loopback one is no address of this host for them: a tunnel's, say)
    for host in remote:
        source = route_source(host)
        if source is not None:
            return source
    return socket.getfqdn()


def open_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of rank 0, on a free port (``store.port``)."""
    return dist.TCPStore(addr, 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def make_group(options: dict[str, Any], store: dist.Store | None = None) -> Any:
    """Build this rank's side of the group described by ``options``; blocks until every rank
    has joined. Rank 0 passes its own store; the others connect to ``addr:port``."""
    try:
        addr, port, rank, size = options["addr"], int(options["port"]), int(options["rank"]), int(options["world_size"])
        backend, prefix = options["backend"], str(options["prefix"])
        timeout = datetime.timedelta(seconds=float(options["timeout_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad collective rendezvous options: {exc}") from None
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside world of {size}")
    if store is None:
        store = dist.TCPStore(addr, port, None, False, timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(addr))]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    raise ValueError(f"unknown collective backend {backend!r}")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast from rank 0 into ``tensor``; returns the Work (call ``.wait()``)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def close_group(group: Any) -> None:
    """Release a group; safe to call on a group whose peers are gone."""
    if group is None:
        return
    for name in ("shutdown", "abort"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # a group broken by a dead peer may refuse either; both are best effort
                continue


def in_thread(fn: Callable[..., Any], *args: Any) -> "asyncio.Future[Any]":
    """Run ``fn(*args)``, a call that blocks on the group's peers (its rendezvous, a broadcast's
    wait), on a thread of its own; its result on a future of the running loop. Not on the loop's
    executor: held up by a peer that is stopped or gone, such a call lasts until the group's
    timeout, and a few of them would hold every thread of the executor that long. Not a daemon
    thread either: the process's exit, cut short in gloo's C++ code, would be an abort; it waits
    for the call to end instead."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():  # given up on meanwhile
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as err:
            result, exc = None, err
        with contextlib.suppress(RuntimeError):  # the loop is closed: no one waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="rollfleet-collective").start()
    return fut


def release_group(group: Any) -> None:
    """``close_group``, and the group let go of on a thread of its own once the caller's
    references to it are gone: a gloo group's destructor waits until its peers have taken what
    it sent (a broadcast that a peer gave up on, or never joined, holds it until the group's
    timeout, though rank 0's side of it ended long before), and must not hold the event loop
    that long. Not a daemon thread: an exit cut short in gloo's C++ code would be an abort."""
    if group is None:
        return
    close_group(group)
    holder = [group]
    del group

    def drop() -> None:
        deadline = time.monotonic() + 5.0
        # 2: the holder's reference and getrefcount's own; the caller's (an attribute it has
        # cleared, a local of its frame) go within moments.
        while sys.getrefcount(holder[0]) > 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        holder.clear()

    threading.Thread(target=drop, name="rollfleet-collective-release").start()


# Rank 0's buffers kept between updates (fresh memory costs a page fault per page).
_kept: list[torch.Tensor] = []
_kept_busy = False
_kept_lock = threading.Lock()


def _take(device: torch.device, size: int, count: int, capacity: int) -> list[torch.Tensor]:
    global _kept_busy
    with _kept_lock:
        if (not _kept_busy and len(_kept) >= count and all(b.device == device for b in _kept)
                and size <= _kept[0].numel() <= max(size, capacity)):
            _kept_busy = True
            return _kept[:count]
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]


def _give_back(buffers: list[torch.Tensor], keep: bool) -> None:
    global _kept, _kept_busy
    with _kept_lock:
        mine = bool(buffers) and bool(_kept) and buffers[0] is _kept[0]
        if mine:
            _kept_busy = False
            if not keep:
                _kept = []
        elif keep and not _kept_busy and buffers:
            _kept = list(buffers)


def release_kept() -> None:
    """Free the buffers this process keeps between updates."""
    global _kept
    with _kept_lock:
        if not _kept_busy:
            _kept = []


class CollectiveChannel:
    """Sender side of the collective transport: rank 0 of a private group, broadcasting each
    bucket from a local buffer to every collective receiver."""

    kind = "collective"

    def __init__(self, links: list, config: Any, update_id: str, fleet_host: str = "") -> None:
        self.links = links
        self.timeout_s = config.timeout_s
        backend = config.collective_backend
        if backend == "auto":
            cuda = torch.cuda.is_available() and all(str(l.device).startswith("cuda") for l in links)
            backend = "nccl" if cuda else "gloo"
        self.backend = backend
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device(config.device or f"cuda:{torch.cuda.current_device()}")
        self.addr = config.master_addr or rendezvous_address(links, fleet_host)
        self.prefix = f"rollfleet/{update_id}"
        self.keep = bool(getattr(config, "keep_buffers", True))
        self.buffers: list[torch.Tensor] = []
        self.store: Any = None
        self.group: Any = None

    def allocate(self, size: int, num_buffers: int, capacity: int | None = None) -> None:
        self.buffers = _take(self.device, size, num_buffers, capacity or size)
        self.store = open_store(self.addr, self.timeout_s)

    def _options(self, rank: int) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "port": self.store.port,
            "world_size": len(self.links) + 1,
            "rank": rank,
            "backend": self.backend,
            "prefix": self.prefix,
            "timeout_s": self.timeout_s,
        }

    def begin(self, link: Any, rank: int) -> tuple[list[dict], dict]:
        buffers = [{"size": b.numel()} for b in self.buffers]
        return buffers, self._options(rank + 1)

    def renew(self) -> None:  # buffers are private to each rank; never asked for
        return None

    async def connect(self) -> None:
        self.group = await in_thread(make_group, self._options(0), self.store)

    def after_begin(self, replies: list[dict]) -> None:
        return None

    def ready(self, slot: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def transfer(self, slot: int, nbytes: int) -> Any:
        """Start the broadcast now (so ranks see buckets in order); returns an awaitable."""
        if nbytes == 0:
            return None
        work = broadcast(self.group, self.buffers[slot][:nbytes])
        return in_thread(self._wait, work)

    def _wait(self, work: Any) -> None:
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        group, self.group = self.group, None
        release_group(group)
        self.store = None
        buffers, self.buffers = self.buffers, []
        _give_back(buffers, self.keep)
