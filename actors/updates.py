"""Weight updates seen from the supervisor: pause, interrupt, send, resume, catch up.

The Supervisor owns one WeightSync. An update:

1. pauses dispatching (new requests wait in the pending queue);
2. interrupts every running request: resumable ones keep their partial tokens and are
   queued to continue; hard-abort ones finish now with finish_reason 'abort';
3. waits until no request is bound to a worker;
4. sends the tensors to every ready worker (weights.WeightSender);
5. resumes dispatching, whatever happened, so a failed update never leaves the fleet stuck.

A worker restarted later is brought to the current version before it serves: its engine
loads its initial weights, then gets every tensor sent since, each as last sent. These are kept
on the CPU when ``keep_last_weights`` (one copy of each name ever sent, merged update after
update, so that a partial update or an empty one restores the whole current version; each
update writes into scratch copies, so a failed one never damages the kept ones), or come from
the callable the last full update was given as (plus what tensor updates sent after it). A
worker left with partly applied weights by a failed update is restored the same way when all
the failed update reached is among what is kept; else (the fleet's first update, a tensor no
update sent before, or ``keep_last_weights=False`` with tensors that are not a callable) it is
restarted, which loads its initial weights (version 0), never left serving a mix. So is a
worker at its initial weights for want of anything to catch it up with, when an update does
not send again every tensor earlier updates sent: it would hold a mix at the update's version.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import FleetClosed, Unsupported, WeightUpdateError
from .handle import WorkerHandle, WorkerState
from .inflight import State

if TYPE_CHECKING:
    from ..weights.sender import UpdateReport
    from .supervisor import Supervisor

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, Any]]


class WeightSync:
    def __init__(self, supervisor: "Supervisor", *, keep_last_weights: bool = True, drain_timeout_s: float = 30.0):
        self.sup = supervisor
        self.keep_last_weights = keep_last_weights
        self.drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()
        self._source: Callable[[], NamedTensors] | None = None
        # Every name sent by a committed update since the initial weights (or since _source's
        # update), with its last tensor: the initial weights plus these are the current version.
        self._last: dict[str, Any] | None = None
        self._spare: dict[str, Any] | None = None  # copies no longer kept, reused as scratch
        self._last_lora: dict[str, Any] | None = None
        # The names committed updates sent since the initial weights: what a worker left at its
        # initial weights (nothing kept to catch it up) needs sent again to be at a version.
        self._names_ever_sent: set[str] = set()
        self.last_report: "UpdateReport | None" = None
        self.num_updates = 0
        self.drained: asyncio.Event = asyncio.Event()

    def _sender(self, **overrides: Any) -> Any:
        from ..weights import WeightSender, WeightSyncConfig

        cfg = dict(self.sup.config.weights or {})
        cfg["transport"] = self.sup.config.weight_transport()
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        return WeightSender(WeightSyncConfig(**cfg), fleet_host=self.sup.worker_host)

    # ------------------------------------------------------------------ catch-up
    def needs_catch_up(self, handle: WorkerHandle) -> bool:
        # (a source exists once a base update has committed: sent again, it is never wrong)
        has_source = self._source is not None or self._last is not None
        return has_source and (handle.weight_version != self.sup.weight_version or handle.initial_weights)

    async def catch_up(self, handle: WorkerHandle) -> None:
        """Bring a (re)started worker to the fleet's current version before it serves."""
        async with self._lock:
            await self._catch_up_locked(handle)

    async def _catch_up_locked(self, handle: WorkerHandle) -> None:
        if not self.needs_catch_up(handle):
            return
        version = self.sup.weight_version
        logger.info("bringing worker %s to weight version %d", handle.worker_id, version)
        await self._sender().update(self._restore(), version, [handle])
        handle.weight_version = version
        handle.initial_weights = False

    def _restore(self) -> NamedTensors:
        """What brings a worker from its initial weights to the current version."""
        from ..weights.bucket import named_pairs

        kept = dict(self._last or {})
        if self._source is None:
            return list(kept.items())
        source = self._source

        def from_source() -> Iterator[tuple[str, Any]]:
            for name, tensor in named_pairs(source()):
                if name not in kept:  # sent again since: the kept copy is the newer
                    yield name, tensor
            yield from kept.items()

        return from_source()

    def _can_restore(self, sent: set[str]) -> bool:
        """Whether every tensor a failed update may have reached a worker with can be put back."""
        return self._source is not None or (self._last is not None and sent <= self._last.keys())

    async def _repair_to_the_end(self, links: list[WorkerHandle], sent: set[str]) -> None:
        """``_repair``, run to its end though the caller be cancelled meanwhile (a timeout that
        fires as the update fails): the cancel is raised once it is done. Stopped half-way, it
        left workers holding part of the failed update to serve once the fleet went on."""
        repair = asyncio.ensure_future(self._repair(links, sent))
        cancelled = False
        while not repair.done():
            try:
                await asyncio.shield(repair)
            except asyncio.CancelledError:
                cancelled = cancelled or not repair.done()  # (its own cancel, at shutdown, ends the wait)
        if cancelled:
            repair.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise asyncio.CancelledError
        repair.result()

    async def _repair(self, links: list[WorkerHandle], sent: set[str]) -> None:
        """After a failed update that had sent the tensors ``sent``: a worker that applied part
        of it before the failure reports version -1 (its weights are a mix), one that committed
        it the update's version; bring it back to the last good version, or restart it when that
        cannot be rebuilt (a restart loads the initial weights)."""
        from ..transport.messages import WeightsEnd

        for handle in links:
            if not handle.alive:
                continue
            try:
                # An abort of no update, asked behind the update's own messages (a worker takes
                # weights messages in turn, stats at once): its answer says what the worker holds
                # once it has dealt with every one of them, buckets still queued and the abort
                # included (a stalled worker answered stats with the version before, then applied
                # its queued buckets and served them).
                check = WeightsEnd(id=handle.next_call_id(), version=self.sup.weight_version, commit=False)
                data = await handle.call(check, self.sup.config.call_timeout_s)
            except Exception as exc:  # dead or hung: the death path takes it from here
                logger.warning("could not check worker %s after a failed update: %s", handle.worker_id, exc)
                continue
            handle.weight_version = int(data.get("version", handle.weight_version))
            if handle.weight_version == self.sup.weight_version:
                continue
            # At -1 it holds part of the update; at another version, all of it (it committed while
            # another worker's part failed): either way, what the update sent must be put back.
            if (handle.weight_version == -1 or sent) and not self._can_restore(sent):
                held = "partly applied weights" if handle.weight_version == -1 else "the weights of a failed update"
                self._restart(handle, f"left with {held}, and no copy of the last good ones is kept for all of them")
                continue
            try:
                await self._catch_up_locked(handle)
            except Exception as exc:
                self._restart(handle, f"left with partly applied weights and could not be restored: {exc}")

    def _restart(self, handle: WorkerHandle, reason: str) -> None:
        """Take a worker out at once (no request is sent to it from here on) and have it
        restarted: its engine loads its initial weights, and it is caught up before it serves."""
        logger.error("worker %s: %s; restarting it", handle.worker_id, reason)
        self.sup._on_worker_dead(handle, reason)

    async def _wait_for_a_ready_worker(self) -> None:
        """With no worker ready but some restarting (e.g. right after a failed first update
        restarted them), wait for one, up to ``start_timeout_s``: an update is not refused for
        a restart in progress. Outside the lock, which a restarted worker's catch-up takes."""
        sup = self.sup
        deadline = time.monotonic() + sup.config.start_timeout_s
        while (not sup.closed and time.monotonic() < deadline and sup.restarting()
               and not any(h.state is WorkerState.READY for h in sup.workers.values())):
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ update
    async def update(
        self,
        named_tensors: NamedTensors | Callable[[], NamedTensors],
        version: int,
        *,
        transport: str | None = None,
        bucket_bytes: int | None = None,
        lora: dict[str, Any] | None = None,
    ) -> "UpdateReport":
        sup = self.sup
        if sup.closed:
            raise FleetClosed("the fleet is not running")
        if sup.config.mode == "colocated":
            raise Unsupported("a colocated fleet takes no weight updates (mode='colocated')")
        from ..weights.bucket import check_pair, named_pairs
        from ..weights.sender import check_cuda_here, check_version

        # Bad arguments fail here, before any request is interrupted.
        check_version(version)
        from torch.nn import Module

        if isinstance(named_tensors, Module):
            # A module is callable: it would be taken for a callable that yields the tensors, and
            # called with no input (the model's forward pass then fails with its own message).
            raise ValueError(f"update_weights takes (name, tensor) pairs, not a module ({type(named_tensors).__name__}): "
                             "pass model.named_parameters() or model.state_dict()")
        if isinstance(named_tensors, (list, tuple, Mapping)):
            # Built already: checked whole here, not as the sender reaches each (a generator's
            # or a callable's items still fail the update then, interrupted requests resuming).
            for item in named_pairs(named_tensors):
                check_pair(item)
        sender = self._sender(transport=transport, bucket_bytes=bucket_bytes)
        check_cuda_here(sender.config)
        await self._wait_for_a_ready_worker()
        async with self._lock:
            if lora is not None:
                lacking = [h.worker_id for h in sup.workers.values()
                           if h.state is WorkerState.READY and "lora" not in h.capabilities]
                if lacking:
                    raise Unsupported(f"LoRA adapters are not supported by the {sup.config.engine} engine "
                                      f"of workers {', '.join(lacking)}")
                keep_lora = True
            else:
                keep_lora = False
            # What restores a worker (the kept copy or the callable) changes only when this
            # update commits: a failed one is repaired from the last good version's.
            source = named_tensors if callable(named_tensors) else None
            tensors: NamedTensors = named_pairs(named_tensors() if source is not None else named_tensors)
            # Adapters are not base weights: they are not kept for catching up restarted workers.
            keep: list[tuple[str, Any]] | None = (
                [] if self.keep_last_weights and source is None and not keep_lora else None
            )
            sent: set[str] = set()  # names handed to the sender: what a failure may have reached
            if keep is not None:
                # This update's copies go into scratch tensors, never into kept ones, so the last
                # good version stays intact whatever happens to this update.
                tensors = _tee(tensors, keep, self._spare or {}, sent)
            else:
                tensors = _names_into(tensors, sent)
            sup._paused = True
            try:
                await self._interrupt_and_drain()
                if sup.closed:  # shut down while the update drained the fleet's requests
                    raise FleetClosed(f"the fleet shut down before weight version {version} was sent")
                links = [h for h in sup.workers.values() if h.state is WorkerState.READY]
                if not links:
                    raise WeightUpdateError("no ready worker to update")
                # Ready below the fleet's version: restarted with nothing kept to catch it up.
                behind = [h for h in links if h.weight_version != sup.weight_version
                          or (h.initial_weights and self._names_ever_sent)]
                try:
                    report = await sender.update(tensors, version, links, lora=lora)
                except WeightUpdateError as exc:
                    self.last_report = getattr(exc, "report", None)
                    if sup.closed:  # its workers left because the fleet shut down: nothing to repair
                        raise FleetClosed(f"the fleet shut down during the update to weight version {version}") from exc
                    logger.error("weight update to version %d failed: %s", version, exc)
                    await self._repair_to_the_end(links, sent if lora is None else set())
                    raise
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    # The caller gave up on it (a timeout, say, or a Ctrl-C in its generator):
                    # the sender abandoned it on the workers, which may hold part of it, as
                    # after a failure.
                    logger.warning("weight update to version %d was given up (%s)", version, type(sys.exc_info()[1]).__name__)
                    await self._repair_to_the_end(links, sent if lora is None else set())
                    raise
                for h in links:
                    h.weight_version = version
                    if not keep_lora:
                        h.initial_weights = False
                sup.weight_version = version
                if not keep_lora:
                    missed = self._names_ever_sent - sent if behind else set()
                    self._names_ever_sent |= sent
                    if missed:
                        # Its initial weights plus part of the updates match no version; restarted,
                        # it serves its initial weights again, as its results say (version 0).
                        shown = ", ".join(sorted(missed)[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
                        for h in [h for h in behind if h.alive]:
                            self._restart(h, f"served its initial weights, and weight version {version} did not send "
                                             f"again what earlier updates sent ({shown}): it would serve a mix (no copy "
                                             "is kept: keep_last_weights is off and the updates were not a callable)")
                    if keep is not None:  # kept copies: they now hold this update's tensors too
                        self._last, self._spare = _merge(self._last, keep)
                    else:  # a callable, or nothing kept: older copies would restore a wrong version
                        self._source = source
                        self._spare = self._last = None
                    # A worker that registered while this update ran was not among its links: it
                    # holds the version before, and is caught up here, before any request reaches it.
                    updated = {h.worker_id for h in links}
                    for h in [h for h in sup.workers.values()
                              if h.state is WorkerState.READY and h.worker_id not in updated]:
                        try:
                            await self._catch_up_locked(h)
                        except Exception as exc:
                            self._restart(h, f"could not be brought to weight version {version}: {exc}")
                self.last_report = report
                self.num_updates += 1
                return report
            finally:
                sup._paused = False
                sup._pump()

    async def _interrupt_and_drain(self) -> None:
        sup = self.sup
        for entry in list(sup.table):
            if entry.inner_id is None or entry.state is not State.RUNNING:
                continue
            entry.state = State.INTERRUPTED if entry.resume else State.ABORTING
            sup._abort_on_worker(entry)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while sup.table.num_inner:
            if loop.time() > deadline:
                stuck = {e.worker_id for e in sup.table if e.inner_id is not None}
                for handle in [sup.workers[w] for w in stuck if w in sup.workers]:
                    handle.last_error = f"did not stop its requests within {self.drain_timeout_s}s for a weight update"
                    handle.proc.kill()  # its requests resume elsewhere through the death path
                deadline = loop.time() + self.drain_timeout_s
            await asyncio.sleep(0.002)


def _names_into(tensors: NamedTensors, sent: set[str]) -> Iterator[tuple[str, Any]]:
    """Pass tensors through, noting each name in ``sent``."""
    from ..weights.bucket import check_pair

    for item in tensors:
        name, tensor = check_pair(item)
        sent.add(name)
        yield name, tensor


def _tee(tensors: NamedTensors, keep: list[tuple[str, Any]], scratch: dict[str, Any],
         sent: set[str]) -> Iterator[tuple[str, Any]]:
    """Pass tensors through while keeping a CPU copy of each (for restarted workers), noting
    each name in ``sent``.

    Scratch copies (the kept ones that an earlier update replaced) are reused when name, shape
    and dtype match, so steady-state updates copy into memory that is already there instead of
    allocating the model anew.
    """
    for name, tensor in _names_into(tensors, sent):
        old = scratch.get(name)
        src = tensor.detach()
        if old is not None and old.shape == src.shape and old.dtype == src.dtype:
            old.copy_(src)
            keep.append((name, old))
        else:
            keep.append((name, src.to("cpu", copy=True)))
        yield name, tensor


def _merge(last: dict[str, Any] | None, update: list[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kept copies after a committed update: every name of ``last`` with this update's
    tensors in place of those it sent again; and the scratch copies for the next update (the
    replaced ones, which no kept entry shares)."""
    fresh = dict(update)
    kept = dict(last or {})
    scratch = {name: kept[name] for name in fresh if name in kept}
    kept.update(fresh)
    return kept, scratch
