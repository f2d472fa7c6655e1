"""The engine side of a weight update; runs inside the engine worker process.

The worker hands every WeightsBegin / WeightsBucket / WeightsEnd to ``handle`` and answers
with ``Reply(data=<what handle returned>)``, or with ``Error(code=exc.code)`` when it raises a
RolloutError (InvalidRequest for malformed or out-of-order messages, EngineFailed when the
engine's loader raised).

Per bucket the receiver turns the entries into complete (name, tensor) pairs (whole tensors
are views of the shared buffer; split tensors are assembled once all their parts arrived)
and awaits ``engine.load_weights(pairs)``. Every tensor handed over is valid only during
that call: the engine copies what it keeps, and with CUDA tensors it has either read them
when it returns or queued its reads on the current CUDA stream (the bucket's reply waits for
that stream to get past them). This is what lets the receiver keep its
mappings of the sender's buffers (shm segments, CUDA IPC handles) and the assembly buffers
of split tensors from one update to the next instead of paying for fresh memory each time;
``close`` frees them. A bucket the engine fails to load (not staged, not a LoRA adapter
being collected) sets ``version`` to -1, a mix of two versions, unless the engine refused it
whole (``WeightsRefused``) before any other bucket of the update reached it; the update's
later buckets are then refused without reaching the engine.

shm in place: when the begin offers it (``options.in_place``), the engine takes
RemoteTensors (``Engine.accepts_remote_tensors``) and the probe reads back right, the
begin's reply says ``in_place: true`` and entries with ``address`` reach the engine as
``remote.RemoteTensor`` values, read out of the sender's memory during load_weights.

Descriptor path: an engine that must read the buffer in another process (vLLM reads in
its own worker process) defines ``load_weights_from_descriptor(descriptor)``; with the shm
transport it is called once per bucket with ``{'shm_name', 'size', 'tensors'}``, where
``tensors`` are the raw entries (split parts not joined: use ``bucket.Assembler`` on that
side) and ``shm_name`` is a file in /dev/shm to map with ``shm.attach``. The segment names
then stay alive for the whole update; this receiver unlinks them if the sender dies.

Staging: an engine with ``commit_weights`` and ``discard_weights`` (vLLM) is handed the
buckets staged (``commit=False``, or ``stage_weights(pairs)`` on the other transports) and
applies them all at the end's commit, since a bucket may hold only part of a fused layer
(q/k/v, gate/up) and vLLM rebuilds a layer from what one reload carries.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engines.base import WeightsRefused
from ..errors import EngineFailed, InvalidRequest, RolloutError, Unsupported
from ..transport.messages import WeightsBegin, WeightsBucket, WeightsEnd
from . import remote, shm
from .bucket import Assembler, bucket_nbytes, check_whole, is_in_place
from .config import TRANSPORTS

__all__ = ["WeightReceiver"]

logger = logging.getLogger(__name__)

INTERRUPT_GRACE_S = 2.0
"""How long the collective calls of an update its sender ended may still take (``interrupt``)."""

FINISH_POLL_S = 0.02
"""How long the oldest bucket's GPU copies are polled (see ``watch``) before a thread waits
for them."""


class _Done:
    """Stands for GPU work that is already complete."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


_DONE = _Done()


def _strides(shape: list[int]) -> list[int]:
    """A contiguous tensor's strides, in elements."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return strides[::-1]


def _update_id(msg_id: str) -> str:
    return msg_id.rsplit(".", 1)[0]


@dataclass(slots=True)
class _Update:
    uid: str
    version: int
    transport: str
    buffers: list[torch.Tensor] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    descriptor: bool = False
    sender_pid: int | None = None
    sender_start: float | None = None
    group: Any = None
    watchdog: asyncio.Task | None = None
    assembler: Assembler = field(default_factory=Assembler)
    nbytes: int = 0
    num_buckets: int = 0
    applied: bool = False
    """Tensors of it reached the engine's load_weights (not staged, not collected for a LoRA
    adapter): they cannot be taken back."""
    staged: bool = False
    """Buckets went to the engine's stage_weights: applied together by commit_weights at the end."""
    lora: dict[str, Any] | None = None
    """Set when the update carries a LoRA adapter: its tensors are collected, not loaded."""
    lora_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    segments: list[torch.Tensor] = field(default_factory=list)
    """cuda_ipc in place: the sender's segments this update named, by number."""
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """... and seen as each dtype read from them."""
    failed: bool = False
    """A bucket failed: the update cannot be committed (a sender may send the end without
    waiting for the buckets' replies)."""
    on_gpu: bool = False
    """Buckets were copied on the GPU (their copies may still run when a bucket's reply is due)."""
    remote_pid: int | None = None
    """shm in place: the sender's pid, when this worker reads its tensors where they lie."""


class WeightReceiver:
    """Applies weight updates to one engine. ``version`` is the last committed version."""

    def __init__(self, engine: Any, *, device: str = "cpu", watch_interval_s: float = 0.5) -> None:
        self.engine = engine
        self.device = torch.device(device)
        self.version = 0
        self.watch_interval_s = watch_interval_s
        self._update: _Update | None = None
        # Buffers kept between updates: the sender's, by (token, index), and assembly space.
        self._mapped: dict[tuple[str, int], torch.Tensor] = {}
        self._assembler = Assembler(keep=True)
        self._segments: Any = None  # cuda_ipc.Segments: the sender's memory, mapped in place
        self._refused: str | None = None  # why in-place shm reads were last refused
        # Engines that read buckets in another process and can hold them until the end (vLLM).
        self._can_stage = callable(getattr(engine, "commit_weights", None)) and callable(
            getattr(engine, "discard_weights", None)
        )
        # ... and that can hold the tensors of buckets without segments too (zmq, collective,
        # cuda_ipc), which would otherwise reach load_weights one bucket at a time.
        self._stage_pairs = self._can_stage and callable(getattr(engine, "stage_weights", None))
        self._staged_left = False  # buckets were staged and neither committed nor discarded since
        # Buckets of one update must be handled in order (collectives pair up by order);
        # asyncio.Lock wakes waiters first-come first-served.
        self._lock = asyncio.Lock()
        # GPU work of started buckets, oldest first: (event, done, since); see watch.
        self._watched: collections.deque[tuple[Any, Callable[[EngineFailed | None], None], float]] = \
            collections.deque()
        self._poller: asyncio.Task | None = None
        # While a collective call (a rendezvous, a bucket's broadcast) holds the lock: a future
        # that gives it up, and its update's id; and what the last message that ended an update
        # said: (its id, whether it ends every other update instead, until when calls may run).
        self._abandon: tuple[asyncio.Future[None], str] | None = None
        self._cutoff: tuple[str, bool, float] | None = None

    async def handle(self, msg: WeightsBegin | WeightsBucket | WeightsEnd, buffers: list[Any] | None = None) -> dict[str, Any]:
        """Apply one weights message; returns the Reply data. ``buffers`` are the message's
        extra frames (the bucket bytes, on the zmq transport). Raises RolloutError."""
        data, pending = await self.start(msg, buffers)
        await self.finish(pending)
        return data

    async def start(self, msg: WeightsBegin | WeightsBucket | WeightsEnd,
                    buffers: list[Any] | None = None) -> tuple[dict[str, Any], Any]:
        """``handle`` in two halves, so that the next bucket can start while this one's copies
        still run on the GPU: (the Reply data, the GPU work still pending or None). Reply only
        once that work is done (``watch`` or ``finish``): the sender reuses the buffer (and
        lets go of tensors read in place) once it has the reply."""
        async with self._lock:
            self._reap()  # buckets done meanwhile are answered before this one starts
            if isinstance(msg, WeightsBucket):
                try:
                    return await self._bucket(msg, buffers or [])
                except BaseException as exc:
                    self._failed(msg.id)
                    if isinstance(exc, ValueError):
                        raise InvalidRequest(f"{msg.TYPE.value}: {exc}") from exc
                    raise
            return await self._handle(msg), None

    def interrupt(self, msg: Any) -> bool:
        """Hear of a message as it arrives, before it waits its turn. One that ends an update (its
        sender's abort, or the begin of another: the sender gave that one up) leaves that
        update's collective calls (a rendezvous, a broadcast) ``INTERRUPT_GRACE_S`` to end, the
        one that holds the receiver now and those of its buckets still queued: the broadcasts
        the sender started end within that, while one that a peer stopped or gone holds up would
        last until the group's timeout, and the abort with it. Such a call's message then fails,
        and the abort is answered. Whether a call was under way."""
        if isinstance(msg, WeightsEnd) and not msg.commit:
            uid, others = _update_id(msg.id), False
        elif isinstance(msg, WeightsBegin):
            uid, others = _update_id(msg.id), True  # every update but this one
        else:
            return False
        loop = asyncio.get_running_loop()
        self._cutoff = (uid, others, loop.time() + INTERRUPT_GRACE_S)
        pending = self._abandon
        if pending is None or pending[0].done() or not self._cut(pending[1]):
            return False
        loop.call_later(INTERRUPT_GRACE_S, lambda: pending[0].done() or pending[0].set_result(None))
        return True

    def _cut(self, uid: str) -> float | None:
        """When a collective call of update ``uid`` is given up (``interrupt``); None: never."""
        if self._cutoff is None:
            return None
        ended, others, deadline = self._cutoff
        return deadline if (uid != ended if others else uid == ended) else None

    async def _collective(self, call: "asyncio.Future[Any]", uid: str, what: str) -> Any:
        """Wait for ``call`` (``collective.in_thread``) unless ``interrupt`` gives it up first."""
        loop = asyncio.get_running_loop()
        abandon: asyncio.Future[None] = loop.create_future()
        self._abandon = (abandon, uid)
        cut = self._cut(uid)
        try:
            await asyncio.wait((call, abandon), return_when=asyncio.FIRST_COMPLETED,
                               timeout=None if cut is None else max(0.0, cut - loop.time()))
        finally:
            self._abandon = None
        if call.done():
            return call.result()
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end, whenever, is no one's
        # Its thread may still write into this update's buffers: none of them is reused.
        self._mapped = {}
        raise InvalidRequest(f"{what} given up: the update was ended by its sender while it waited")

    def watch(self, pending: Any, done: Callable[[EngineFailed | None], None]) -> None:
        """Call ``done(None)`` once the GPU work ``pending`` (from ``start``) is complete, or
        ``done(EngineFailed)`` if it failed; in the order of ``watch`` calls.

        ``done`` is called straight from the receiver's polling, not from a task woken
        later: buckets that arrived together start one after another without yielding, and
        a task woken meanwhile would only run after all of them; polling also happens at
        every ``start``, so a bucket's reply leaves as soon as its copies are done. A
        bucket's copies take a millisecond or so: the oldest event is polled between the
        loop's other work, and only a longer wait goes to a thread (a thread's wake-up, GIL
        included, would cost more than the copy)."""
        if pending is None:
            if not self._watched:
                done(None)
                return
            pending = _DONE  # answered in order, after the buckets before it
        self._watched.append((pending, done, time.monotonic()))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())

    async def finish(self, pending: Any) -> None:
        """Wait for what ``start`` left running on the GPU. Raises EngineFailed if it failed."""
        if pending is None:
            return
        fut = asyncio.get_running_loop().create_future()

        def done(exc: EngineFailed | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

        self.watch(pending, done)
        await fut

    def _reap(self) -> None:
        watched = self._watched
        while watched:
            pending, done, _ = watched[0]
            try:
                if not pending.query():
                    return
                failure = None
            except Exception as exc:
                self.version = -1
                if self._update is not None:
                    self._update.failed = True
                failure = EngineFailed(f"engine failed copying a bucket on the GPU: {type(exc).__name__}: {exc}")
                failure.__cause__ = exc
            watched.popleft()
            try:
                done(failure)
            except Exception:  # an answer that cannot go out must not stop the others
                logger.exception("answering a bucket failed")

    async def _poll(self) -> None:
        while self._watched:
            self._reap()
            if not self._watched:
                return
            pending, _, since = self._watched[0]
            if time.monotonic() - since > FINISH_POLL_S:
                try:
                    await asyncio.to_thread(pending.synchronize)
                except Exception:  # noqa: S110 - the next query raises it again, and says so
                    pass
            else:
                await asyncio.sleep(0)

    async def _handle(self, msg: WeightsBegin | WeightsEnd) -> dict[str, Any]:
        try:
            if isinstance(msg, WeightsBegin):
                return await self._begin(msg)
            up = self._update
            if isinstance(msg, WeightsEnd) and msg.commit and up is not None and up.failed and up.uid == _update_id(msg.id):
                if self._can_stage and (up.descriptor or up.staged):
                    await self.engine.discard_weights()
                    self._staged_left = False
                self._drop(sender_gone=False)
                raise EngineFailed(f"update to v{msg.version} not committed: a bucket of it failed")
            if isinstance(msg, WeightsEnd) and msg.commit and self._update is not None and self._update.lora:
                up = self._current(msg.id)
                try:
                    await self.engine.load_lora(up.lora["name"], up.lora_tensors, dict(up.lora.get("config") or {}))
                    activate = getattr(self.engine, "set_active_lora", None)
                    if callable(activate):
                        activate(up.lora["name"])
                except RolloutError:
                    self._drop(sender_gone=False)
                    raise
                except Exception as exc:
                    self._drop(sender_gone=False)
                    raise EngineFailed(f"engine failed to load LoRA adapter: {type(exc).__name__}: {exc}") from exc
                return self._end(msg)
            if isinstance(msg, WeightsEnd):
                staged = self._can_stage and self._update is not None and (self._update.descriptor
                                                                           or self._update.staged)
                if staged and not msg.commit:
                    await self.engine.discard_weights()
                    self._staged_left = False
                if staged and msg.commit:
                    self._current(msg.id)  # refuse an end that does not match the update
                    try:
                        self._staged_left = False  # committed, or dropped by the refusal
                        await self.engine.commit_weights()
                    except Exception as exc:
                        self._drop(sender_gone=False)
                        raise EngineFailed(f"engine failed to apply the update: {type(exc).__name__}: {exc}") from exc
                return self._end(msg)
        except RolloutError:
            raise
        except ValueError as exc:
            raise InvalidRequest(f"{msg.TYPE.value}: {exc}") from exc
        raise InvalidRequest(f"not a weights message: {type(msg).__name__}")

    def close(self) -> None:
        """Release everything held; unlinks kept shm names only if their sender is gone."""
        if self._poller is not None:
            self._poller.cancel()
        self._watched.clear()
        if self._update is not None:
            self._drop(sender_gone=not self._sender_alive(self._update))
        self._mapped.clear()
        self._assembler.release()
        if self._segments is not None:
            self._segments.close()
            self._segments = None

    def unlink_orphans(self) -> None:
        """Unlink the shm names kept for an update whose sender is gone. Plain system calls
        only, so it is safe from any thread, e.g. when the worker's parent dies."""
        up = self._update
        if up is not None and up.names and not self._sender_alive(up):
            for name in up.names:
                shm.unlink(name)

    # ------------------------------------------------------------------ messages

    async def _begin(self, msg: WeightsBegin) -> dict[str, Any]:
        uid = _update_id(msg.id)
        if self._update is not None:
            if self._update.uid != uid:  # the same update begun again (fresh buffers) is expected
                logger.warning("weight update %s abandoned; starting %s", self._update.uid, uid)
            self._drop(sender_gone=not self._sender_alive(self._update))
        if self._staged_left:
            # An update abandoned after some of its buckets were staged (its sender died, or
            # began again): they must not be applied with this one's commit.
            await self.engine.discard_weights()
            self._staged_left = False
        if msg.transport not in TRANSPORTS:
            raise InvalidRequest(f"unknown weights transport {msg.transport!r}")
        if not 0 <= msg.version < 1 << 63:  # (-1 is what a worker reports for partly applied weights)
            raise InvalidRequest(f"weights_begin: version must be in [0, 2**63), got {msg.version}")
        up = _Update(uid=uid, version=msg.version, transport=msg.transport, assembler=self._assembler)
        lora = msg.options.get("lora")
        if lora is not None:
            if type(lora) is not dict or type(lora.get("name")) is not str:
                raise InvalidRequest("options.lora must be a map with a string 'name'")
            if "lora" not in self.engine.capabilities():
                raise Unsupported(f"the {self.engine.name} engine does not support LoRA adapters")
            up.lora = lora
        try:
            sizes = [b.get("size", b.get("nbytes")) if type(b) is dict else None for b in msg.buffers]
            if not sizes or not all(type(s) is int and s > 0 for s in sizes):
                raise ValueError("every buffer needs a positive 'size'")
            up.sizes = sizes
            if msg.transport == "shm":
                if not await self._open_shm(up, msg):
                    return {"need_names": True, "version": self.version}
            elif msg.transport == "zmq":
                pass  # the bytes come with each bucket message
            elif msg.transport == "cuda_ipc":
                from .cuda_ipc import open_shared

                index = self.device.index if self.device.type == "cuda" else None
                up.buffers = self._reuse(msg.buffers, lambda b: open_shared(b, index))
            else:
                await self._open_collective(up, msg)
        except BaseException:
            self._release(up, unlink=False)
            raise
        up.assembler.start()
        self._update = up
        reply: dict[str, Any] = {"keep_names": up.descriptor, "version": self.version}
        if msg.transport == "shm":
            reply["in_place"] = up.remote_pid is not None
        return reply

    def _reuse(self, descs: list[dict], open_one: Any) -> list[torch.Tensor]:
        """The buffers of ``descs``: those mapped by an earlier update (same token and size)
        as they are, the others opened with ``open_one``. Mappings not named here are dropped."""
        mapped: dict[tuple[str, int], torch.Tensor] = {}
        out = []
        for i, desc in enumerate(descs):
            token = desc.get("pool")
            key = (token, int(desc.get("index", i))) if type(token) is str else None
            buf = self._mapped.get(key) if key is not None else None
            if buf is None or buf.numel() != desc["size"]:
                buf = open_one(desc)
            if key is not None:
                mapped[key] = buf
            out.append(buf)
        self._mapped = mapped
        return out

    async def _open_shm(self, up: _Update, msg: WeightsBegin) -> bool:
        """Map the update's segments; False when a segment is neither mapped already nor named."""
        names = [b.get("name") for b in msg.buffers]
        pid, start = msg.options.get("sender_pid"), msg.options.get("sender_start")
        up.sender_pid = pid if type(pid) is int else None
        up.sender_start = float(start) if type(start) in (int, float) else None
        # A LoRA adapter is collected here and handed over whole, so no descriptor path for it.
        up.descriptor = up.lora is None and callable(getattr(self.engine, "load_weights_from_descriptor", None))
        held = {(b.get("pool"), b.get("index", i)) for i, b in enumerate(msg.buffers)} <= self._mapped.keys()
        if None in names and (up.descriptor or not held):
            return False  # the sender starts over with fresh, named segments
        for name in names:
            if name is not None:
                shm._path(name)  # validates: only rollfleet names, nothing outside /dev/shm
        up.names = [n for n in names if n is not None]
        offer = msg.options.get("in_place")
        if offer is not None and up.sender_pid is not None and not up.descriptor and up.lora is None:
            if not getattr(self.engine, "accepts_remote_tensors", False):
                why: str | None = f"the {self.engine.name} engine does not take them"
            else:
                why = remote.probe(up.sender_pid, offer)
            if why is None:
                up.remote_pid = up.sender_pid
            elif why != self._refused:
                self._refused = why  # said once, not on every update
                logger.info("weights through shared memory, not read in place: %s", why)
        if up.descriptor:
            # Names must outlive this message; if the sender dies, nobody else unlinks them.
            if up.sender_pid is not None:
                up.watchdog = asyncio.create_task(self._watch(up))
        else:
            up.buffers = self._reuse(msg.buffers, lambda b: shm.attach(b["name"], b["size"]))
        return True

    async def _open_collective(self, up: _Update, msg: WeightsBegin) -> None:
        from .collective import in_thread, make_group

        backend = msg.options.get("backend")
        device = self.device if backend == "nccl" else torch.device("cpu")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("nccl needs a receiver on a CUDA device")
        # Private buffers, kept like the shm mappings: fresh memory each update costs a fault per page.
        descs = [{"size": s, "pool": f"local:{device}", "index": i} for i, s in enumerate(up.sizes)]
        up.buffers = self._reuse(descs, lambda d: torch.empty(d["size"], dtype=torch.uint8, device=device))
        up.group = await self._collective(in_thread(make_group, dict(msg.options)), up.uid,
                                          "the collective's rendezvous")

    async def _skip_broadcast(self, up: _Update, msg: WeightsBucket) -> None:
        """Join the broadcast of a bucket of a failed collective update all the same, into its
        buffer, unused: the sender started that broadcast as it sent the bucket (before it heard
        of the failure), and unpaired it would hold the sender, and every other rank, until the
        group's timeout."""
        if up.transport != "collective" or up.group is None:
            return
        try:
            entries = [e for e in msg.tensors if not is_in_place(e)]
            nbytes = bucket_nbytes(entries)
            buf = up.buffers[msg.buffer]
        except (TypeError, KeyError, IndexError, AttributeError):
            return  # a bucket that says no size: the sender's broadcast cannot be matched
        if 0 < nbytes <= buf.numel():
            from .collective import broadcast, in_thread

            work = broadcast(up.group, buf[:nbytes])
            await self._collective(in_thread(work.wait), up.uid, f"bucket {msg.index}'s broadcast")

    async def _bucket(self, msg: WeightsBucket, buffers: list[Any] | None = None) -> tuple[dict[str, Any], Any]:
        buffers = buffers or []
        up = self._current(msg.id)
        if up.failed:
            # It cannot be committed: applying more of it would only mix more of it in.
            await self._skip_broadcast(up, msg)
            raise InvalidRequest(f"bucket {msg.index} not applied: an earlier bucket of update {up.uid} failed")
        if msg.index != up.num_buckets:  # one update's buckets come in order, each once
            raise ValueError(f"bucket index {msg.index} out of order: bucket {up.num_buckets} comes next")
        if not 0 <= msg.buffer < len(up.sizes):
            raise ValueError(f"buffer {msg.buffer} out of range")
        entries = msg.tensors
        if not all(type(e) is dict and type(e.get("offset")) is int and type(e.get("nbytes")) is int for e in entries):
            raise ValueError("every tensor entry needs int 'offset' and 'nbytes'")
        in_place = [e for e in entries if is_in_place(e)]
        if in_place:
            if up.transport != "cuda_ipc" and any("segment" in e for e in in_place):
                raise ValueError("tensors read in place ('segment') need the cuda_ipc transport")
            if (up.transport != "shm" or up.remote_pid is None) and any("address" in e for e in in_place):
                raise ValueError("tensors read in place ('address') need an shm update whose worker "
                                 "accepted in-place reads")
            entries = [e for e in entries if not is_in_place(e)]
        nbytes = bucket_nbytes(entries)
        if not 0 <= nbytes <= up.sizes[msg.buffer]:
            raise ValueError(f"tensor entries need {nbytes} bytes, buffer has {up.sizes[msg.buffer]}")
        if up.transport == "zmq":
            up.buffers = [torch.empty(0, dtype=torch.uint8)] * len(up.sizes)
            if nbytes:
                if len(buffers) != 1 or len(buffers[0]) < nbytes:
                    raise ValueError(f"zmq transport: bucket needs one frame of {nbytes} bytes")
                with warnings.catch_warnings():  # the frame is read-only; the engine copies out of it
                    warnings.simplefilter("ignore", UserWarning)
                    up.buffers[msg.buffer] = torch.frombuffer(buffers[0], dtype=torch.uint8, count=nbytes)
        if up.transport == "collective" and nbytes:
            from .collective import broadcast, in_thread

            work = broadcast(up.group, up.buffers[msg.buffer][:nbytes])
            await self._collective(in_thread(work.wait), up.uid, f"bucket {msg.index}'s broadcast")
        if not in_place:
            views = []
        elif up.transport == "shm":
            views = self._remote(up, in_place)
        else:
            views = self._in_place(up, in_place)
        num = len(entries) + len(views)
        pending = None
        try:
            if up.descriptor:
                desc = {"shm_name": up.names[msg.buffer], "size": up.sizes[msg.buffer], "tensors": entries}
                # Staged until WeightsEnd when the engine can (vLLM): a bucket may hold only part
                # of a fused layer, and applying it alone would corrupt the model.
                if self._can_stage:
                    self._staged_left = True
                    result = self.engine.load_weights_from_descriptor(desc, commit=False)
                else:
                    result = self.engine.load_weights_from_descriptor(desc)
                if inspect.isawaitable(result):
                    await result
            else:
                buf = up.buffers[msg.buffer]
                if not views:
                    pairs = up.assembler.add(buf, entries) if entries else []
                else:  # in the bucket's order: of a name given twice, the engine must load the last
                    placed = iter(views)
                    pairs = []
                    for e in msg.tensors:
                        if is_in_place(e):
                            pairs.append(next(placed))
                        else:
                            pairs += up.assembler.add(buf, [e])
                num = len(pairs)
                if up.lora is not None:
                    # Views of a buffer the sender reuses: keep copies until the adapter is loaded.
                    up.lora_tensors.extend((name, t.clone()) for name, t in pairs)
                elif pairs and self._stage_pairs:
                    # As with segments: a bucket may hold only part of a fused layer (vLLM's q/k/v).
                    self._staged_left = up.staged = True
                    await self.engine.stage_weights(pairs)
                elif pairs:
                    await self.engine.load_weights(pairs)
                    up.applied = True
                if buf.is_cuda or (views and up.transport == "cuda_ipc"):
                    # The copies out of this bucket run on: what the reply waits for.
                    pending = torch.cuda.Event()
                    pending.record(torch.cuda.current_stream(buf.device if buf.is_cuda else views[0][1].device))
                    up.on_gpu = True
        except BaseException as exc:
            if not up.descriptor and up.lora is None and (up.applied or not (isinstance(exc, WeightsRefused)
                                                                             or self._stage_pairs)):
                # The engine may have applied part of this bucket (or earlier ones) already; one
                # that refused it whole (WeightsRefused) applied none of it.
                self.version = -1
            if isinstance(exc, (RolloutError, ValueError)) or not isinstance(exc, Exception):
                raise
            raise EngineFailed(f"engine failed to load bucket {msg.index}: {type(exc).__name__}: {exc}") from exc
        up.nbytes += sum(e["nbytes"] for e in entries) + sum(e["nbytes"] for e in in_place)
        up.num_buckets += 1
        return {"index": msg.index, "num_tensors": num}, pending

    def _in_place(self, up: _Update, entries: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
        """Views of the sender's own tensors for entries with 'segment' (cuda_ipc in place):
        the first entry naming a segment in an update carries its 'handle'."""
        from .cuda_ipc import Segments

        if self._segments is None:
            index = self.device.index if self.device.type == "cuda" else None
            self._segments = Segments(index if index is not None else torch.cuda.current_device())
        out = []
        for entry in entries:
            name, dtype, shape, offset, nbytes = check_whole(entry)
            k = entry["segment"]
            if type(k) is not int or not 0 <= k <= len(up.segments):
                raise ValueError(f"{name}: segment {k!r} was never named in this update")
            handle = entry.get("handle")
            if k == len(up.segments):
                if handle is None:
                    raise ValueError(f"{name}: segment {k} needs its 'handle' the first time")
                up.segments.append(self._segments.open(handle))
            elif handle is not None and not self._segments.holds(handle, up.segments[k]):
                raise ValueError(f"{name}: segment {k} was named with another handle")
            flat = up.segments[k]
            if offset + nbytes > flat.numel():
                raise ValueError(f"{name}: bytes [{offset}, {offset + nbytes}) lie outside segment {k} "
                                 f"({flat.numel()} bytes)")
            # One view op a tensor (each costs microseconds, and a bucket may name hundreds):
            # the segment seen as this dtype (its whole items), kept for the update. The
            # tensor's bytes lie within those items: offset and nbytes are multiples of its size.
            typed = up.typed.get((k, dtype))
            if typed is None:
                typed = up.typed[k, dtype] = flat[: flat.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
            out.append((name, typed.as_strided(shape, _strides(shape), offset // dtype.itemsize)))
        return out

    @staticmethod
    def _remote(up: _Update, entries: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        """RemoteTensors for entries with 'address' (shm in place): the sender's tensors,
        which the engine reads during its load_weights."""
        assert up.remote_pid is not None
        out: list[tuple[str, Any]] = []
        for entry in entries:
            name, dtype, shape, offset, nbytes = check_whole(entry)
            address = entry["address"]
            if type(address) is not int or address <= 0:
                raise ValueError(f"{name}: 'address' must be an int > 0")
            out.append((name, remote.RemoteTensor(up.remote_pid, address + offset, dtype, shape, nbytes)))
        return out

    def _end(self, msg: WeightsEnd) -> dict[str, Any]:
        up = self._update
        if up is not None and up.on_gpu:
            torch.cuda.synchronize(self.device if self.device.type == "cuda" else None)  # every bucket's copies
            self._reap()  # their answers go out before this one
        if not msg.commit:
            if up is not None and up.uid == _update_id(msg.id):
                # Buckets already handed to the engine (not staged, not a LoRA being collected)
                # cannot be taken back: the weights are now a mix, and the version says so.
                if up.applied:
                    self.version = -1
                self._drop(sender_gone=False)
            return {"version": self.version, "aborted": True}
        up = self._current(msg.id)
        try:
            if msg.version != up.version:
                raise ValueError(f"end version {msg.version} != begin version {up.version}")
            if up.assembler.incomplete:
                raise ValueError(f"update ended with incomplete tensors: {up.assembler.incomplete[:5]}")
        except ValueError:
            self._drop(sender_gone=False)
            raise
        self.version = msg.version
        self._drop(sender_gone=False)
        return {"version": self.version, "bytes": up.nbytes, "num_buckets": up.num_buckets}

    # ------------------------------------------------------------------ state

    def _failed(self, msg_id: str) -> bool:
        up = self._update
        if up is not None and up.uid == _update_id(msg_id):
            up.failed = True
            return True
        return False

    def refuse(self, msg_id: str) -> bool:
        """A message of the open update could not even be read (a bucket whose fields are of the
        wrong types, say): the update is not committed. Whether ``msg_id`` is of the open update."""
        return self._failed(msg_id)

    def _current(self, msg_id: str) -> _Update:
        up = self._update
        if up is None:
            raise InvalidRequest("no weight update in progress")
        if up.uid != _update_id(msg_id):
            raise InvalidRequest(f"message {msg_id!r} does not belong to update {up.uid!r}")
        return up

    def _drop(self, *, sender_gone: bool) -> None:
        up, self._update = self._update, None
        if up is not None:
            self._release(up, unlink=sender_gone)

    def _release(self, up: _Update, *, unlink: bool) -> None:
        if up.watchdog is not None and up.watchdog is not asyncio.current_task():
            up.watchdog.cancel()
        up.buffers = []
        up.segments = []
        up.typed = {}
        if self._segments is not None:
            self._segments.end_update()  # the mappings this update did not name are closed
        up.assembler.clear()  # partial tensors; completed assembly space is kept for reuse
        if up.group is not None:
            from .collective import release_group

            group, up.group = up.group, None
            release_group(group)  # (not on this loop: its destructor may wait for a peer)
        if unlink:
            for name in up.names:
                if shm.unlink(name):
                    logger.info("unlinked %s left by dead sender %s", name, up.sender_pid)

    @staticmethod
    def _sender_alive(up: _Update) -> bool:
        return up.sender_pid is None or shm.pid_alive(up.sender_pid, up.sender_start)

    async def _watch(self, up: _Update) -> None:
        while self._sender_alive(up):
            await asyncio.sleep(self.watch_interval_s)
        logger.warning("weight sender %s died during update %s; dropping it", up.sender_pid, up.uid)
        if self._update is up:
            self._update = None
        self._release(up, unlink=True)
