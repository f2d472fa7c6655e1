"""The trainer side of a weight update: pack, pipeline, broadcast to every worker.

One update, seen from the sender::

    WeightsBegin  -> every worker (buffers and handles shared here, once)
    for each bucket k:   fill buffer k % 2  (while the workers load bucket k-1)
                         WeightsBucket(k) -> every worker; replies awaited before buffer reuse
    WeightsEnd(commit=True) -> every worker; each answers with the version it now holds

With cuda_ipc alone, the begin, the buckets and the end go out without waiting for each
other's replies, and CUDA tensors of the trainer are read in place (no buffer, one copy);
with shm alone, CPU tensors are, once every worker has accepted at the begin: see
WeightSyncConfig.in_place.

A transport "channel" (ShmChannel, CudaIpcChannel, CollectiveChannel) owns the buffers of
the workers that use it; the first channel's buffer is filled from the tensors and the
others get a copy of its bytes. Any failure aborts the update everywhere
(WeightsEnd(commit=False)), frees every buffer and unlinks every segment, and raises
WeightUpdateError naming the worker and the cause.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from ..errors import WeightUpdateError
from ..transport.messages import Message, WeightsBegin, WeightsBucket, WeightsEnd
from . import remote, shm
from .bucket import ALIGN, Bucket, Packer, fill, is_in_place
from .config import WeightSyncConfig, choose_transport

__all__ = ["WorkerLink", "WeightSender", "UpdateReport", "WorkerReport", "release_buffers", "check_version"]

logger = logging.getLogger(__name__)


class WorkerLink(Protocol):
    """How the sender reaches one worker (the supervisor implements it)."""

    worker_id: str
    host: str
    device: str

    async def call(self, msg: Message, timeout: float | None = None) -> dict:
        """Send ``msg``, return the Reply's data; raise a RolloutError on Error/timeout/death."""
        ...


@dataclass(kw_only=True, slots=True)
class WorkerReport:
    worker_id: str
    transport: str
    ok: bool = False
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    gbps: float = 0.0


@dataclass(kw_only=True, slots=True)
class UpdateReport:
    version: int
    ok: bool = False
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    in_place_bytes: int = 0
    """Bytes the engines read straight out of the trainer's tensors (WeightSyncConfig.in_place)."""
    seconds: float = 0.0
    gbps: float = 0.0
    """Bytes of tensor data per second of the whole update, in 1e9 bytes/s."""
    workers: dict[str, WorkerReport] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _LinkFailed(Exception):
    def __init__(self, worker_id: str, cause: BaseException) -> None:
        super().__init__(f"{worker_id}: {type(cause).__name__}: {cause}")
        self.worker_id = worker_id
        self.cause = cause


def check_version(version: Any) -> int:
    """A weight version: an int in [0, 2**63) (it travels as a signed 64-bit int); else ValueError."""
    if type(version) is not int or not 0 <= version < 1 << 63:
        raise ValueError(f"version must be an int in [0, 2**63), got {version!r}")
    return version


def _together(tasks: list) -> asyncio.Future:
    """One future for ``tasks``, made at once (so cancelling it always reaches them): their
    results in order. The first failure cancels the others."""

    def failed(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            for other in tasks:
                other.cancel()

    for task in tasks:
        task.add_done_callback(failed)
    return asyncio.gather(*tasks)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _make_channel(kind: str, links: list, config: WeightSyncConfig, update_id: str, fleet_host: str = "") -> Any:
    if kind == "zmq":
        from .frames import FramesChannel

        return FramesChannel(links, config, update_id)
    if kind == "shm":
        return shm.ShmChannel(links, config, update_id)
    if kind == "cuda_ipc":
        from .cuda_ipc import CudaIpcChannel

        return CudaIpcChannel(links, config, update_id)
    from .collective import CollectiveChannel

    return CollectiveChannel(links, config, update_id, fleet_host)


IN_PLACE_DEPTH = 4
"""Buckets read wholly in place (cuda_ipc) that may be in flight at once."""

_filler: concurrent.futures.ThreadPoolExecutor | None = None
_filler_lock = threading.Lock()


def _fill_executor() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for filling buffers, apart from asyncio's default pool: its torch thread
    count (per thread) is set for each fill without touching the trainer's threads."""
    global _filler
    with _filler_lock:
        if _filler is None:
            _filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollfleet-fill")
        return _filler


def _num_buffers(config: WeightSyncConfig, channels: list) -> int:
    if config.num_buffers:
        return config.num_buffers
    on_gpu = any(getattr(getattr(ch, "device", None), "type", "cpu") == "cuda" for ch in channels)
    return 2 if on_gpu else 3


def _fill_threads(config: WeightSyncConfig) -> int:
    if config.fill_threads:
        return config.fill_threads
    # Half the cores: while one bucket is filled the engines copy the previous one out, and
    # on a small machine more copy threads than cores only slow both sides down.
    return max(1, torch.get_num_threads() // 2)


def release_buffers() -> None:
    """Free the transfer buffers this process keeps between updates (see
    WeightSyncConfig.keep_buffers); receivers drop their mappings at their next update."""
    import sys

    shm.release_kept()
    for name in ("cuda_ipc", "collective"):
        module = sys.modules.get(f"{__package__}.{name}")
        if module is not None:
            module.release_kept()


def check_cuda_here(config: WeightSyncConfig) -> None:
    """ValueError for a transport that needs CUDA in this process when it has none (else torch
    raises a bare AssertionError from deep in the update)."""
    if torch.cuda.is_available():
        return
    if config.transport == "cuda_ipc":
        raise ValueError("transport 'cuda_ipc' needs CUDA in this process (torch.cuda.is_available() is False): "
                         "use 'shm' (or 'auto') for engines on the CPU")
    if config.transport == "collective" and config.collective_backend == "nccl":
        raise ValueError("collective_backend 'nccl' needs CUDA in this process (torch.cuda.is_available() is False): "
                         "use 'gloo' (or 'auto')")


class WeightSender:
    """Pushes named tensors to engine workers. One update at a time per sender."""

    def __init__(self, config: WeightSyncConfig | None = None, *, fleet_host: str = "") -> None:
        """``fleet_host``: the host that workers on other hosts reached the fleet at (its worker
        socket's, when it names one): where they dial the collective's store, unless
        ``config.master_addr`` says otherwise."""
        self.config = config or WeightSyncConfig()
        self.fleet_host = fleet_host
        self._lock = asyncio.Lock()
        self._lora: dict[str, Any] | None = None

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        links: Sequence[WorkerLink],
        *,
        lora: dict[str, Any] | None = None,
    ) -> UpdateReport:
        """Send every tensor to every worker and commit ``version``.

        With ``lora`` ({'name': adapter name, 'config': PEFT adapter config}) the tensors are
        a LoRA adapter's: engines load them as that adapter (and use it for later requests)
        instead of replacing base weights.

        ``named_tensors`` is consumed lazily (at most about two buckets ahead of the workers).
        Raises WeightUpdateError (with ``.report`` and ``.worker_id``, None when the input
        itself was bad) after aborting the update on every worker; ValueError for bad
        arguments before anything is sent.
        """
        check_version(version)
        check_cuda_here(self.config)
        if not links:
            raise ValueError("no workers to update")
        if len({l.worker_id for l in links}) != len(links):
            raise ValueError("duplicate worker ids")
        if lora is not None and (type(lora) is not dict or type(lora.get("name")) is not str):
            raise ValueError("lora must be a map with a string 'name' (and an optional 'config' map)")
        async with self._lock:
            self._lora = lora
            try:
                return await self._update(named_tensors, version, list(links))
            finally:
                self._lora = None

    async def _update(self, named_tensors: Iterable, version: int, links: list) -> UpdateReport:
        cfg = self.config
        uid = "w" + secrets.token_hex(6)
        started = time.perf_counter()
        report = UpdateReport(version=version)
        groups: dict[str, list] = {}
        for link in links:
            kind = choose_transport(link, cfg)
            groups.setdefault(kind, []).append(link)
            report.workers[link.worker_id] = WorkerReport(worker_id=link.worker_id, transport=kind)
        if "shm" in groups:
            stale = shm.sweep_stale()
            if stale:
                logger.warning("removed %d shared-memory segments left by dead processes", len(stale))
        # shm/cuda_ipc first: filling a mapped or device buffer directly is cheapest.
        order = sorted(groups, key=("shm", "cuda_ipc", "collective", "zmq").index)
        channels = [_make_channel(k, groups[k], cfg, uid, self.fleet_host) for k in order]
        # In place needs a single transport. shm in place is provisional: the receivers say at
        # the begin whether they can read this process's memory; if not, the buckets packed
        # so far move into the buffer.
        alone = channels[0].kind if cfg.in_place and len(channels) == 1 else None
        shm_in_place = alone == "shm" and self._lora is None
        in_place = channels[0].in_place if alone == "cuda_ipc" or shm_in_place else None
        packer = Packer(named_tensors, cfg.bucket_bytes, in_place)
        if shm_in_place:
            if remote.huge_pages_pending():
                await asyncio.to_thread(remote.settle_huge_pages)
            channels[0].offer_in_place(packer.capacity)
        buckets = iter(packer)
        loop = asyncio.get_running_loop()
        threads = _fill_threads(cfg)
        inflight: collections.deque[tuple[asyncio.Future, list[torch.Tensor]]] = collections.deque()
        pending: list[asyncio.Future] = []  # a pipelined update's begin and end
        begun = False
        try:
            first = next(buckets, None)
            single = first is None or first.last
            # (shm: room for the tensors offered in place, in case the receivers refuse them)
            need = min(packer.capacity, first.nbytes + (first.in_place_room if channels[0].kind == "shm" else 0)) \
                if first else 0
            size = max(ALIGN, -(-need // ALIGN) * ALIGN) if single and first else packer.capacity
            num_buffers = 1 if single else _num_buffers(cfg, channels)
            for ch in channels:
                ch.allocate(size, num_buffers, packer.capacity)
            begun = True
            # cuda_ipc alone (no buffer names to renegotiate): the begin, the buckets and the
            # end go out without waiting for each other's replies (a worker takes them in
            # order and refuses to commit an update with a failed bucket); a GPU copies a
            # bucket faster than a message makes a round trip.
            pipelined = all(ch.kind == "cuda_ipc" for ch in channels)
            if pipelined:
                pending.append(_together([t for ch in channels for t in self._begin_calls(uid, version, ch, cfg)]))
            else:
                await self._begin(uid, version, channels, cfg)
                if shm_in_place and not channels[0].accepted:
                    if first is not None and any(is_in_place(p.entry) and p.entry["nbytes"] > packer.capacity
                                                 for p in first.parts):
                        # Assumed from the last update; cannot move into a buffer (the next
                        # update will not assume it).
                        raise RuntimeError("a worker refused the in-place reads it accepted at the last update")
                    packer.stop_in_place(first)
            # Buckets in flight, oldest first, with the tensors each has the engines read in
            # place: alive until the bucket is loaded (on failure, until the update is aborted
            # everywhere). A bucket with bytes in a buffer also waits for that buffer's last
            # bucket; one read wholly in place needs no buffer, so more of them may be in
            # flight (the engines' copies then follow each other on the GPU without a gap).
            depth = max(num_buffers, IN_PLACE_DEPTH) if in_place is not None else num_buffers
            last_in: list[asyncio.Future | None] = [None] * num_buffers
            next_slot = 0
            bucket = first
            while bucket is not None:
                pinned = bucket.sources_in_place
                buffered = bucket.nbytes > 0 or not pinned
                while len(inflight) >= depth:
                    await inflight[0][0]
                    inflight.popleft()
                slot = next_slot if buffered else 0
                if buffered:
                    next_slot = (next_slot + 1) % num_buffers
                    if last_in[slot] is not None:
                        await last_in[slot]
                for task in pending:  # fail fast if the begin or an earlier bucket failed
                    if task.done():
                        task.result()
                for task, _ in inflight:
                    if task.done():
                        task.result()
                if pinned and channels[0].kind == "cuda_ipc":
                    # The engines read these now: this thread's (the trainer's) work on them
                    # must be done.
                    torch.cuda.current_stream(channels[0].device).synchronize()
                if buffered:
                    await loop.run_in_executor(_fill_executor(), self._fill, bucket, slot, channels, threads)
                transfers = [ch.transfer(slot, bucket.nbytes) for ch in channels]
                # (header, bucket bytes) for workers on the zmq transport
                frames = {l.worker_id: [ch.frame(slot, bucket.nbytes)]
                          for ch in channels if ch.kind == "zmq" for l in ch.links}
                task = self._deliver(uid, bucket.index, slot, bucket.entries, links, transfers, frames)
                inflight.append((task, pinned))
                if buffered:
                    last_in[slot] = task
                report.num_buckets += 1
                if not buffered:
                    # Nothing was awaited for this bucket: let its messages leave now, not
                    # after the next bucket is packed (the engines would wait for that). One
                    # turn of the loop runs the calls (a link sends, or posts), the next
                    # sends what was posted in the first.
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                bucket = None  # drop the source tensors before pulling more
                bucket = next(buckets, None)
            if pipelined:
                pending.append(self._end(uid, version, links, report, started))
                # The begin first: its failure is the cause of any later one.
                if any(a.get("need_names") for a in await pending[0]):
                    raise RuntimeError("a cuda_ipc receiver asked for buffer names")
            while inflight:
                await inflight[0][0]
                inflight.popleft()
            if pipelined:
                await pending[-1]
            else:
                await self._end(uid, version, links, report, started)
        except BaseException as exc:
            for task in [t for t, _ in inflight] + pending:
                # Its failure is reported through exc already (or is a consequence of it).
                task.add_done_callback(_retrieve)
                task.cancel()
            for ch in channels:
                ch.close()
            if isinstance(exc, GeneratorExit):  # closed unfinished (its loop is gone): nothing can be awaited
                raise
            if begun:
                failed = exc.worker_id if isinstance(exc, _LinkFailed) else None
                await self._abort(uid, version, links, failed)
            if not isinstance(exc, Exception):  # cancelled, or a KeyboardInterrupt / SystemExit from the tensors' generator
                raise
            raise self._error(exc, report, started) from (exc.cause if isinstance(exc, _LinkFailed) else exc)
        finally:
            for ch in channels:
                ch.close()
        report.ok = True
        if shm_in_place and channels[0].accepted and cfg.huge_pages:
            remote.sent_in_place(channels[0].regions)
        report.num_tensors = packer.num_tensors
        report.bytes = packer.nbytes
        report.in_place_bytes = packer.nbytes_in_place
        report.seconds = time.perf_counter() - started
        report.gbps = report.bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
        for w in report.workers.values():
            w.ok, w.bytes = True, packer.nbytes
            w.gbps = w.bytes / w.seconds / 1e9 if w.seconds > 0 else 0.0
        return report

    async def _begin(self, uid: str, version: int, channels: list, cfg: WeightSyncConfig) -> None:
        connects = [asyncio.create_task(ch.connect()) for ch in channels]
        try:
            replies = await asyncio.gather(*(self._begin_channel(uid, version, ch, cfg) for ch in channels), *connects)
            for ch, answers in zip(channels, replies):
                if any(a.get("need_names") for a in answers):
                    # A receiver lacks the kept buffers (restarted, or new): start over with
                    # fresh ones that every receiver of this channel maps by name.
                    ch.renew()
                    answers = await self._begin_channel(uid, version, ch, cfg)
                    if any(a.get("need_names") for a in answers):
                        raise RuntimeError("a receiver refused freshly created buffers")
                ch.after_begin(answers)
        except BaseException:
            for t in connects:
                t.cancel()
            raise

    async def _begin_channel(self, uid: str, version: int, ch: Any, cfg: WeightSyncConfig) -> list[dict]:
        return list(await _together(self._begin_calls(uid, version, ch, cfg)))

    def _begin_calls(self, uid: str, version: int, ch: Any, cfg: WeightSyncConfig) -> list[asyncio.Task]:
        """The begin message of ``ch`` to each of its workers, sent in the order asked
        (every message is sent as its call's task first runs, and tasks run in order)."""
        calls = []
        for rank, link in enumerate(ch.links):
            buffers, options = ch.begin(link, rank)
            if self._lora is not None:
                options = {**options, "lora": {"name": self._lora["name"], "config": dict(self._lora.get("config") or {})}}
            msg = WeightsBegin(
                id=f"{uid}.begin", version=version, transport=ch.kind,
                bucket_bytes=cfg.bucket_bytes, buffers=buffers, options=options,
            )  # fmt: skip
            calls.append(asyncio.create_task(self._call(link, msg)))
        return calls

    def _fill(self, bucket: Bucket, slot: int, channels: list, threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # this thread's own setting (OpenMP is per thread)
        primary = channels[0].buffers[slot]
        fill(bucket, primary)
        for ch in channels[1:]:
            ch.buffers[slot][: bucket.nbytes].copy_(primary[: bucket.nbytes])
        for ch in channels:
            ch.ready(slot)

    def _deliver(self, uid: str, index: int, slot: int, entries: list, links: list, transfers: list,
                 frames: dict[str, list] | None = None) -> asyncio.Future:
        msg = WeightsBucket(id=f"{uid}.{index}", index=index, buffer=slot, tensors=entries)
        frames = frames or {}
        tasks = [asyncio.create_task(self._call(link, msg, frames.get(link.worker_id))) for link in links]
        tasks += [asyncio.ensure_future(t) for t in transfers if t is not None]
        return _together(tasks)

    def _end(self, uid: str, version: int, links: list, report: UpdateReport, started: float) -> asyncio.Future:
        async def one(call: asyncio.Task, link: Any) -> None:
            data = await call
            if data.get("version") != version:
                raise _LinkFailed(link.worker_id, RuntimeError(f"committed version {data.get('version')!r}"))
            report.workers[link.worker_id].seconds = time.perf_counter() - started

        msg = WeightsEnd(id=f"{uid}.end", version=version, commit=True)
        calls = [asyncio.create_task(self._call(link, msg)) for link in links]
        return _together([asyncio.create_task(one(c, l)) for c, l in zip(calls, links)] + calls)

    async def _abort(self, uid: str, version: int, links: list, failed: str | None = None) -> None:
        """``weights_end {commit: false}`` to every worker (PROTOCOL.md 6.8). The one that failed
        is told too, so that it drops what it staged, but not waited for: it may be dead or hung."""
        msg = WeightsEnd(id=f"{uid}.abort", version=version, commit=False)
        waited = []
        for link in links:
            if link.worker_id == failed:
                asyncio.ensure_future(link.call(msg, timeout=self.config.abort_timeout_s)).add_done_callback(_retrieve)
            else:
                waited.append(link)
        links = waited
        results = await asyncio.gather(
            *(link.call(msg, timeout=self.config.abort_timeout_s) for link in links), return_exceptions=True
        )
        for link, res in zip(links, results):
            if isinstance(res, BaseException):
                logger.warning("worker %s did not acknowledge the aborted update: %s", link.worker_id, res)

    async def _call(self, link: Any, msg: Message, buffers: list | None = None) -> dict:
        try:
            if buffers:
                data = await link.call(msg, timeout=self.config.timeout_s, buffers=buffers)
            else:
                data = await link.call(msg, timeout=self.config.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _LinkFailed(link.worker_id, exc) from exc
        return data if isinstance(data, dict) else {}

    def _error(self, exc: BaseException, report: UpdateReport, started: float) -> WeightUpdateError:
        report.seconds = time.perf_counter() - started
        if isinstance(exc, _LinkFailed):
            worker = exc.worker_id
            cause = str(exc.cause)
            if cause.startswith(f"worker {worker}: "):  # a worker's error names it already: once is enough
                cause = cause[len(f"worker {worker}: "):]
            text = f"weight update v{report.version} failed on worker {worker}: {cause}"
            report.workers[worker].error = f"{type(exc.cause).__name__}: {exc.cause}"
        else:
            worker = None
            text = f"weight update v{report.version} failed: {type(exc).__name__}: {exc}"
        err = WeightUpdateError(text)
        err.report = report  # type: ignore[attr-defined]
        err.worker_id = worker  # type: ignore[attr-defined]
        return err
