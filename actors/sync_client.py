"""A blocking client for synchronous training loops.

The fleet's event loop runs in a background thread (uvloop when installed); every method
submits a coroutine to it and waits. Safe to use from a torchrun rank's main thread:

    with SyncClient(FleetConfig(engine="torch", num_workers=1)) as fleet:
        results = fleet.generate_batch([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))
        fleet.update_weights(model.named_parameters(), version=step)

The fleet is shut down when the client is dropped, or at interpreter exit, if the caller
forgot to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import FleetClosed
from ..transport.messages import SamplingParams
from .config import FleetConfig
from .result import GenerationResult, StreamChunk
from .supervisor import Supervisor

__all__ = ["SyncClient"]

logger = logging.getLogger(__name__)



def _stop_fleet(supervisor: Supervisor, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                owner: int) -> None:
    """Shut the fleet down and stop its loop thread (SyncClient.shutdown, or the client's
    finalizer: it takes no client, which may be gone). Not in a process forked from ``owner``:
    the fleet is its parent's, which still runs it."""
    if os.getpid() != owner:
        return
    if threading.current_thread() is thread:  # collected on the loop's own thread: it cannot wait here

        async def stop() -> None:
            try:
                await supervisor.shutdown()
            finally:
                loop.stop()

        loop.create_task(stop())
        return
    blocked = False
    try:
        if loop.is_running() and not supervisor.closed:
            # A loop blocked in user code (a weight generator stuck in a collective, say, when
            # Ctrl-C came) could not run the shutdown: after a short look, the fleet is torn down
            # from here instead of after a long wait.
            probe = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop)
            try:
                probe.result(5)
                asyncio.run_coroutine_threadsafe(supervisor.shutdown(), loop).result(60)
            except concurrent.futures.TimeoutError:
                logger.error("the fleet's event loop does not respond (blocked in a weight generator?): "
                             "killing its workers from this thread")
                supervisor.abandon()
                # Its sockets close on its own thread, if that thread ever runs again.
                loop.call_soon_threadsafe(supervisor.release)
                blocked = True
        # A shutdown already under way (a start given up, by a Ctrl-C say, tears the fleet down
        # on its own) returns the call above at once: the loop must run until it is done, or it
        # is left half-way, its workers killed and its directory kept.
        deadline = time.monotonic() + 60
        while not blocked and not supervisor.shut_down and loop.is_running() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(0.5 if blocked else 10)  # a blocked loop thread (a daemon) is left
        if not thread.is_alive() and not loop.is_closed():
            loop.close()


# A call's own timeout is kept on the fleet's loop (which then aborts the request); this much
# later the calling thread stops waiting by itself, for a loop held up in user code (a weight
# generator that blocks it) that cannot keep it.
BACKSTOP_S = 1.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class SyncClient:
    """A fleet and a blocking client of it, for code without an event loop (a torchrun rank's
    training loop). The fleet runs on a loop in a background thread; every method waits for
    its answer, and may be called from any thread. Requests and their errors are those of
    LLMClient (``generate``, ``generate_batch``, ``stream``, ``abort``, ``abort_all``);
    ``update_weights``, ``sleep``/``wake_up``, ``training()``, ``control``, ``stats`` and
    ``shutdown`` those of the Supervisor."""

    def __init__(self, config: FleetConfig | None = None, *, start_timeout_s: float | None = None, **overrides: Any):
        """Start the fleet and return once every worker is ready. ``start_timeout_s``: the most
        this waits for that (None: as long as the fleet's own start_timeout_s lets it take).
        Raises WorkerStartError (when a worker fails to start, or the start outlasts
        ``start_timeout_s``)."""
        self.supervisor = Supervisor(config, **overrides)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._owner = os.getpid()
        # Runs once: at shutdown(), when the client is collected, or at interpreter exit. It holds
        # no reference to the client, so dropping the client is what shuts a forgotten fleet down.
        self._stop = weakref.finalize(self, _stop_fleet, self.supervisor, self._loop, self._thread, self._owner)
        from ..errors import RequestTimeout, WorkerStartError

        try:
            self._call(self.supervisor.start(), start_timeout_s)
        except BaseException as exc:
            self.shutdown()
            if isinstance(exc, RequestTimeout):  # _call's own deadline: the start, not a request, timed out
                raise WorkerStartError(f"the fleet did not start within start_timeout_s={start_timeout_s}") from None
            raise
        self.client = self._call(self._make_client())

    async def _make_client(self) -> Any:
        return self.supervisor.client()

    def _check_usable(self) -> None:
        if self._closed:
            raise FleetClosed("SyncClient is shut down")
        if os.getpid() != self._owner:
            # Its loop thread did not survive the fork: nothing would ever answer.
            raise FleetClosed(f"this SyncClient's fleet belongs to process {self._owner}: a process forked from "
                              "it cannot use it (start a fleet of its own there)")

    def _backstop(self, timeout: Any) -> float | None:
        """How long the calling thread waits for a request's call of ``timeout`` (None: the
        client's default) before it gives up on its own."""
        if timeout is None:
            timeout = self.client.default_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            return None  # none, or one the client refuses with InvalidRequest
        return timeout + BACKSTOP_S

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        try:
            self._check_usable()
        except FleetClosed:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # In slices: a fleet torn down from another thread while its loop was blocked
            # (shutdown's last resort) never completes what it was running.
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                return fut.result(max(0.0, left))
            except concurrent.futures.TimeoutError:
                if self._closed:
                    fut.cancel()
                    raise FleetClosed("SyncClient was shut down while this call ran") from None
                if deadline is not None and time.monotonic() >= deadline:
                    fut.cancel()
                    from ..errors import RequestTimeout

                    raise RequestTimeout(f"no answer within {timeout}s") from None
            except BaseException:
                # Given up while it ran (a KeyboardInterrupt, say): what it runs on the loop is
                # stopped too, as at a timeout, not left to go on unseen (a no-op once it is done).
                fut.cancel()
                raise

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- requests
    def generate(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams | None = None,
                 **kwargs: Any) -> GenerationResult:
        """One request; raises like LLMClient.generate."""
        return self._call(self.client.generate(request_id, prompt_ids, sampling_params, **kwargs),
                          self._backstop(kwargs.get("timeout")))

    def generate_batch(self, prompts: Sequence[Any], sampling_params: Any = None, *,
                       request_ids: Sequence[str] | None = None, timeout: float | None = None,
                       return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Generate for every prompt concurrently; results in prompt order (LLMClient.generate_batch:
        one SamplingParams for all or one per prompt).

        With ``return_exceptions`` a failed request's slot holds its RolloutError instead of
        raising the first one. Without it, the first failure is raised once the batch's other
        requests are cancelled (stopped on their workers; their partial output is dropped),
        as they are when the call is given up (``timeout``, shutdown).
        """
        return self._call(self.client.generate_batch(prompts, sampling_params, request_ids=request_ids,
                                                     timeout=timeout, return_exceptions=return_exceptions,
                                                     **kwargs), self._backstop(timeout))

    def stream(self, request_id: str, prompt_ids: Any, sampling_params: Any = None,
               **kwargs: Any) -> Iterator[StreamChunk | GenerationResult]:
        """Yield StreamChunk objects as tokens arrive, then the final GenerationResult
        (LLMClient.stream; raises like ``generate``). Closing the iterator early (``close()``,
        or leaving ``with contextlib.closing(fleet.stream(...))``) aborts the request and
        returns once the abort is sent; after a plain ``break`` that happens when the iterator
        is collected."""
        self._check_usable()
        items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        finished = threading.Event()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.client.stream(request_id, prompt_ids, sampling_params,
                                                                  **kwargs)) as source:
                    async for item in source:
                        items.put(("item", item))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                items.put(("error", exc))
            else:
                items.put(("end", None))
            finally:
                finished.set()

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        backstop = self._backstop(kwargs.get("timeout"))
        deadline = None if backstop is None else time.monotonic() + backstop
        try:
            while True:
                try:
                    kind, value = items.get(timeout=0.5)
                except queue.Empty:
                    if self._closed:
                        raise FleetClosed("SyncClient was shut down while this stream ran") from None
                    if deadline is not None and time.monotonic() >= deadline:
                        from ..errors import RequestTimeout

                        raise RequestTimeout(f"stream {request_id!r} did not end within {backstop:g}s "
                                             "(the fleet's event loop is held up)", request_id=request_id) from None
                    continue
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            if not finished.is_set() and not self._closed:
                fut.cancel()  # cancels pump on the loop: the stream's own close aborts the request
                if threading.get_ident() != self._thread.ident:  # (collected on the loop's thread: it cannot wait)
                    finished.wait(5)

    def abort(self, request_id: str) -> bool:
        return self._call(self.client.abort(request_id))

    def abort_all(self, session_id: str | None = None) -> list[str]:
        """Abort every request in flight from this process (of ``session_id`` only, if given);
        LLMClient.abort_all. Returns their ids."""
        return self._call(self.client.abort_all(session_id))

    # ---------------------------------------------------------------- fleet
    def update_weights(self, named_tensors: Any, version: int, **kwargs: Any) -> Any:
        """Push weights to every worker (Supervisor.update_weights). Blocks until committed."""
        return self._call(self.supervisor.update_weights(named_tensors, version, **kwargs))

    def control(self, op: str, **args: Any) -> dict[str, Any]:
        """A control op on every ready worker (LLMClient.control); {worker id: reply data}."""
        return self._call(self.client.control(op, **args))

    def sleep(self, level: int = 1) -> dict[str, Any]:
        return self._call(self.client.sleep(level))

    def wake_up(self) -> dict[str, Any]:
        return self._call(self.client.wake_up())

    def clear_kv_cache(self) -> dict[str, Any]:
        return self._call(self.client.clear_kv_cache())

    def start_profile(self, trace_dir: str) -> dict[str, Any]:
        return self._call(self.client.start_profile(trace_dir))

    def stop_profile(self) -> dict[str, Any]:
        return self._call(self.client.stop_profile())

    def stats(self) -> dict[str, Any]:
        return self._call(self.supervisor.stats())

    def training(self, level: int = 1) -> Any:
        """``with fleet.training(): <train step>``: engines sleep during the step (hybrid mode);
        Supervisor.training, blocks may nest or overlap. Leaving the block after the fleet was
        shut down inside it is not an error."""
        sync = self
        block = self.supervisor.training(level)

        class _Ctx:
            def __enter__(self) -> None:
                sync._call(block.__aenter__())

            def __exit__(self, *exc: Any) -> None:
                if not sync._closed:
                    sync._call(block.__aexit__(*exc))

        return _Ctx()

    @property
    def frontend_address(self) -> str | None:
        return self.supervisor.frontend_address

    def shutdown(self) -> None:
        """Stop the fleet and the loop thread. Idempotent. When the fleet's loop does not respond
        within 5 s (blocked in user code, e.g. a weight generator stuck in a collective), its
        workers are killed and its directory removed from the calling thread; calls still waiting
        in other threads end with FleetClosed."""
        if self._closed:
            return
        try:
            self._stop()
        finally:
            self._closed = True

