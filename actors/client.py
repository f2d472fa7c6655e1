"""Clients: LLMClient (in the supervisor's process) and RemoteClient (over the frontend socket).

Both have ``generate`` (awaits the whole result), ``generate_batch`` (many prompts at once,
results in order), ``stream`` (yields StreamChunk objects, then the final GenerationResult),
``abort``, ``abort_all``, ``stats`` and ``control``;
LLMClient also drives the fleet (``update_weights``, ``sleep``, ``wake_up``,
``clear_kv_cache``, profiling). Cancelling the awaiting task (``asyncio.timeout``,
``wait_for``) stops the request on its worker too, and the call raises CancelledError even
when the cancel lands in the loop iteration its answer came (their own bounded waits use
``transport.aio.wait_within``, not ``asyncio.wait_for``, which before Python 3.12 returns
the answer then and the cancel is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import weakref
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import zmq
from zmq.utils import monitor as zmq_monitor

from ..errors import DuplicateRequest, FleetClosed, InvalidRequest, RequestTimeout, RolloutError, from_code
from ..transport import codec
from ..transport.aio import BATCH_BYTES, LoopSocket, wait_within
from ..transport.messages import (
    Abort,
    AbortAll,
    Batch,
    Chunk,
    Control,
    Error,
    Generate,
    Hello,
    Message,
    Reply,
    Result,
    SamplingParams,
    Stats,
    plain_ints,
)
from ..transport.sockets import SocketOptions, make_socket
from .result import GenerationResult, StreamChunk

__all__ = ["LLMClient", "RemoteClient"]

logger = logging.getLogger(__name__)

_GIVEN_UP = object()  # generate_batch: the slot of a request its caller stopped waiting for
_EXPIRED: Any = object()  # stream: what its timer queues when the request's time is up
_batch_ids = itertools.count()
# generate_batch's own ids: unique per process, so two clients' batches never share an id
_BATCH_PREFIX = f"{os.getpid():x}{secrets.token_hex(3)}-"
_SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _params(sampling_params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return sampling_params
    if isinstance(sampling_params, dict):
        # On the wire unknown keys are skipped (a newer client's); from Python one is a typo,
        # e.g. max_new_tokens for max_tokens, that would silently take the default.
        unknown = sorted(map(str, sampling_params.keys() - _SAMPLING_KEYS))
        if unknown:
            raise InvalidRequest(f"sampling_params: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                                 f"{', '.join(sorted(_SAMPLING_KEYS))}", code="bad_field")
        try:
            return SamplingParams.from_wire(sampling_params)
        except (ValueError, TypeError) as exc:
            try:  # numpy's numbers, say, which the constructor takes as the plain ones they stand for
                return SamplingParams(**sampling_params)
            except (ValueError, TypeError):
                raise InvalidRequest(f"sampling_params: {exc}", code="bad_field") from None
    raise InvalidRequest(f"sampling_params must be a SamplingParams, a dict or None, not {type(sampling_params).__name__}",
                         code="bad_field")


def _prompt(prompt_ids: Any) -> list[int]:
    # Either path copies it (the supervisor into its table, RemoteClient into a message)
    # before the caller gets control back; only a non-list needs turning into one. Its
    # elements are checked by the supervisor (in-process) or when it is encoded (RemoteClient).
    if type(prompt_ids) is list:
        return prompt_ids
    if isinstance(prompt_ids, (str, bytes)):
        raise InvalidRequest(f"prompt_ids must be token ids (ints), not {type(prompt_ids).__name__}", code="bad_field")
    tolist = getattr(prompt_ids, "tolist", None)
    if callable(tolist):  # a torch tensor or a numpy array: its tolist() gives Python ints
        prompt_ids = tolist()
        if type(prompt_ids) is not list:
            raise InvalidRequest("prompt_ids must be one-dimensional", code="bad_field")
        return prompt_ids
    try:
        return list(prompt_ids)
    except TypeError:
        raise InvalidRequest(f"prompt_ids must be a list of token ids, not {type(prompt_ids).__name__}",
                             code="bad_field") from None


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Expired(Exception):
    """What a request's timer puts in its future (generate turns it into RequestTimeout)."""


async def _before(waiting: Awaitable[Any], timeout: float | None, request_id: str | None) -> None:
    """Wait for what a request waits for before it goes (a RemoteClient's ``hello``) within
    the request's own timeout, which counts from the call: a fleet that does not answer fails
    the call when its timeout says, not after ``call_timeout_s``. ``None``: no limit."""
    try:
        await wait_within(waiting, timeout)
    except asyncio.TimeoutError:
        what = f"request {request_id!r}" if request_id is not None else "generate_batch"
        raise RequestTimeout(f"{what} timed out after {timeout}s, waiting for the fleet to answer hello",
                             request_id=request_id) from None


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


def _check_id(request_id: Any) -> None:
    if type(request_id) is not str or not request_id:
        raise InvalidRequest(f"request_id must be a non-empty str, got {request_id!r}", code="bad_field")


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):  # (NaN is not >= 0)
        raise InvalidRequest(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}", code="bad_field")


def _check_session(session_id: Any) -> None:
    if session_id is not None and type(session_id) is not str:
        raise InvalidRequest(f"session_id must be a str or None, got {session_id!r}", code="bad_field")


class _Base:
    """Shared generate/stream logic over a per-request message queue."""

    default_timeout_s: float | None = None
    """Deadline of a request when the caller gives none (None: wait as long as it runs)."""

    # ---- hooks: override in a subclass to build abort policies, metrics, ...
    def on_dispatch(self, request_id: str) -> None:
        """Called when a request has been handed to the fleet (RemoteClient: sent to it; the
        fleet may still refuse it, and the call then raises without on_complete)."""

    def on_complete(self, result: GenerationResult) -> None:
        """Called with every finished result (including aborted ones)."""

    def on_cancel(self, request_id: str) -> None:
        """Called when the caller's task was cancelled (or timed out) before the result."""

    async def _sent(self, sending: Awaitable[None], timeout: float | None, request_id: str) -> None:
        """Wait (``_before``) for a request's submission that had to wait (a RemoteClient's hello).
        A cancel or timeout that lands the moment it went out aborts it, not left running."""
        try:
            await _before(sending, timeout, request_id)
        except BaseException:
            self._cancel(request_id)
            raise

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
        resume: bool | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Generate and return the whole result.

        Raises DuplicateRequest, Overloaded, InvalidRequest (bad input), EngineFailed,
        WorkerLost (worker died and the request was not resumed), ResumeExhausted,
        RequestTimeout (``timeout`` passed, counted from this call, a RemoteClient's wait for
        its ``hello`` included; the request is aborted on its worker), FleetClosed, and
        FleetError (code ``fleet_error``: no worker is left and none will be restarted).
        """
        _check_id(request_id)
        _check_session(session_id)
        if timeout is None:
            timeout = self.default_timeout_s
        _check_timeout(timeout)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Message] = loop.create_future()

        def sink(msg: Message) -> None:
            if not fut.done() and isinstance(msg, (Result, Error)):
                fut.set_result(msg)

        deadline = None if timeout is None else loop.time() + timeout
        sending = self._submit(request_id, _prompt(prompt_ids), _params(sampling_params), sink, False, session_id,
                               resume)
        if sending is not None:
            await self._sent(sending, timeout, request_id)
        self.on_dispatch(request_id)
        done = False
        try:
            if deadline is None:
                msg = await fut
            else:
                # A timer that fails the future, not asyncio.wait_for: that wraps it in a second
                # future and callbacks, some 2 us more per call, and a RemoteClient bounds every
                # request (request_timeout_s).
                timer = loop.call_at(deadline, _expire, fut)
                try:
                    msg = await fut
                except _Expired:
                    raise RequestTimeout(f"request {request_id!r} timed out after {timeout}s",
                                         request_id=request_id) from None
                finally:
                    timer.cancel()
            done = True
        finally:
            if not done:
                self.on_cancel(request_id)
                self._cancel(request_id)
        if isinstance(msg, Error):
            raise from_code(msg.code, msg.message, request_id)
        # The message was made for this call alone: its lists become the result's.
        result = GenerationResult.from_message(msg, copy=False)  # type: ignore[arg-type]
        self.on_complete(result)
        return result

    async def generate_batch(
        self,
        prompts: Sequence[Any],
        sampling_params: SamplingParams | dict[str, Any] | Sequence[Any] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
        session_id: str | None = None,
        resume: bool | None = None,
    ) -> list[Any]:
        """Generate for every prompt concurrently; the results in prompt order.

        ``sampling_params`` is one for all (SamplingParams, dict or None) or a list with one
        per prompt. ``request_ids`` defaults to fresh unique ids; ``timeout`` is a deadline for
        the whole call, counted from it (a RemoteClient's wait for its ``hello`` included):
        every request not answered by then fails with RequestTimeout. ``session_id`` and
        ``resume`` apply to all of them. With
        ``return_exceptions`` a failed request's slot holds its RolloutError. Without it, the
        first failure is raised once the batch's other requests are cancelled (stopped on their
        workers; their partial output is dropped), as they are when the call itself is
        cancelled. For n samples of a prompt, repeat it n times, with no seed or a different one
        each (requests with the same seed draw the same tokens). The ids, their number and the
        sampling parameters are checked before any request is sent (InvalidRequest, DuplicateRequest for an id given twice); a prompt the
        fleet refuses fails like any other request, and without ``return_exceptions`` no later
        prompt is sent.
        """
        prompts = list(prompts)
        if request_ids is None:
            batch = next(_batch_ids)
            request_ids = [f"batch-{_BATCH_PREFIX}{batch}-{i}" for i in range(len(prompts))]
        elif isinstance(request_ids, str):  # one id per prompt, not a str's characters
            raise InvalidRequest(f"generate_batch: request_ids must be a list of str, not one str {request_ids!r}",
                                 code="bad_field")
        else:
            request_ids = list(request_ids)
        if len(request_ids) != len(prompts):
            raise InvalidRequest(f"generate_batch: {len(request_ids)} request_ids for {len(prompts)} prompts",
                                 code="bad_field")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequest(f"generate_batch: {len(sampling_params)} sampling_params for {len(prompts)} "
                                     "prompts", code="bad_field")
            per_prompt = [_params(p) for p in sampling_params]
        else:
            per_prompt = [_params(sampling_params)] * len(prompts)
        for request_id in request_ids:  # (before the set of them: an id of a list is no TypeError)
            _check_id(request_id)
        if len(set(request_ids)) != len(request_ids):
            raise DuplicateRequest("generate_batch: request_ids repeat an id")
        _check_session(session_id)
        prompts = [_prompt(p) for p in prompts]
        if not prompts:
            return []
        if timeout is None:
            timeout = self.default_timeout_s
        _check_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            ready = self._ready()
            if ready is not None:
                await _before(ready, timeout, None)
        except RolloutError as exc:
            # What every request waits for failed (RemoteClient's hello, or its client closed):
            # each prompt fails with it, as concurrent generate calls do, instead of each one
            # trying it again.
            if not return_exceptions:
                raise
            return [exc] * len(prompts)
        # One future for the whole batch, not a task per request: each request's sink files its
        # answer in its slot, and the last one (or, without return_exceptions, the first
        # failure) wakes this call up.
        answers: list[Any] = [None] * len(prompts)
        left = len(prompts)
        first_failure: int | None = None
        woken = loop.create_future()

        def answered(i: int, answer: Any) -> None:
            nonlocal left, first_failure
            answers[i] = answer
            left -= 1
            if not isinstance(answer, GenerationResult) and first_failure is None:
                first_failure = i
            if not woken.done() and (not left or (first_failure is not None and not return_exceptions)):
                woken.set_result(None)

        sent: list[int] = []
        timed_out = False
        try:
            for i, (request_id, prompt, params) in enumerate(zip(request_ids, prompts, per_prompt)):
                if first_failure is not None and not return_exceptions:
                    break

                def sink(msg: Message, i: int = i) -> None:
                    if answers[i] is not None:
                        return
                    if isinstance(msg, Result):
                        # Its hook is called as it comes, as generate calls it (an abort policy
                        # built on it stops the rest of the batch); a failure of the hook is the
                        # slot's, as it is generate's.
                        result = GenerationResult.from_message(msg, copy=False)
                        try:
                            self.on_complete(result)
                        except Exception as exc:
                            answered(i, exc)
                        else:
                            answered(i, result)
                    elif isinstance(msg, Error):
                        answered(i, msg)

                try:
                    sending = self._submit(request_id, prompt, params, sink, False, session_id, resume)
                    if sending is not None:
                        await sending
                except RolloutError as exc:
                    answered(i, exc)
                    continue
                sent.append(i)
                self.on_dispatch(request_id)
            if not woken.done():
                try:
                    # What is left of the call's deadline: the wait for hello and the sends took
                    # the rest (with 0 left, wait_within times out at once).
                    await wait_within(woken, None if deadline is None else max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    timed_out = True
        finally:
            # Requests sent and not answered: the caller gave up on them (a failure, the timeout,
            # the call cancelled). Their slots are closed first, so that a late answer is dropped.
            for i in sent:
                if answers[i] is None:
                    answers[i] = _GIVEN_UP
                    self.on_cancel(request_ids[i])
                    self._cancel(request_ids[i])
        results: list[Any] = []
        for i, answer in enumerate(answers):
            if type(answer) is Error:
                answer = from_code(answer.code, answer.message, request_ids[i])
            elif answer is _GIVEN_UP and timed_out:
                answer = RequestTimeout(f"request {request_ids[i]!r} timed out after {timeout}s",
                                        request_id=request_ids[i])
                if first_failure is None:
                    first_failure = i
            results.append(answer)
        if first_failure is not None and not return_exceptions:
            raise results[first_failure]
        return results

    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
        resume: bool | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamChunk | GenerationResult]:
        """Yield StreamChunk objects as tokens arrive, then the final GenerationResult.

        Raises like ``generate``. Closing the iterator early (``aclose()``, or leaving
        ``async with contextlib.aclosing(client.stream(...))``) stops the request on its worker,
        as cancelling a ``generate`` does (stats count it under ``num_cancelled`` for the
        in-process client, under ``num_aborted`` for a RemoteClient, which sends ``abort``); after a
        plain ``break`` that waits until the garbage collector closes it.
        """
        # Closed here, not left to the collector: aclose() must abort before it returns (a
        # RemoteClient closed right after could not send the abort any more).
        async with contextlib.aclosing(self._run(request_id, prompt_ids, sampling_params, True, session_id,
                                                 resume, timeout)) as items:
            async for item in items:
                yield item

    async def _run(self, request_id: str, prompt_ids: list[int], sampling_params: Any, stream: bool,
                   session_id: str | None, resume: bool | None, timeout: float | None
                   ) -> AsyncIterator[StreamChunk | GenerationResult]:
        _check_id(request_id)
        _check_session(session_id)
        if timeout is None:
            timeout = self.default_timeout_s
        _check_timeout(timeout)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        sending = self._submit(request_id, _prompt(prompt_ids), _params(sampling_params), queue.put_nowait,
                               stream, session_id, resume)
        if sending is not None:
            await self._sent(sending, timeout, request_id)
        self.on_dispatch(request_id)
        done = False
        # One timer for the whole request, which queues the end of its time behind what came
        # before it (asyncio.wait_for would make a task of each queue.get()).
        timer = None if deadline is None else loop.call_at(deadline, queue.put_nowait, _EXPIRED)
        try:
            while True:
                msg = await queue.get()
                if msg is _EXPIRED:
                    raise RequestTimeout(f"request {request_id!r} timed out after {timeout}s", request_id=request_id)
                if isinstance(msg, Chunk):
                    yield StreamChunk(list(msg.token_ids), msg.logprobs, msg.weight_version)
                elif isinstance(msg, Result):
                    done = True
                    result = GenerationResult.from_message(msg, copy=False)
                    self.on_complete(result)
                    yield result
                    return
                elif isinstance(msg, Error):
                    done = True
                    raise from_code(msg.code, msg.message, request_id)
        finally:
            if timer is not None:
                timer.cancel()
            if not done:
                self.on_cancel(request_id)
                self._cancel(request_id)

    # ---- transport-specific
    def _ready(self) -> Awaitable[None] | None:
        """What a request waits for before it can go (RemoteClient: its hello), or None when
        nothing: raises what would refuse every request."""
        return None

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Any,
                stream: bool, session_id: str | None, resume: bool | None) -> Awaitable[None] | None:
        """Hand the request over; an awaitable when that takes I/O, else None (no coroutine
        to make and run per request)."""
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:
        raise NotImplementedError


class LLMClient(_Base):
    """Async client in the supervisor's own process (no socket hop), on the fleet's event loop:
    a call from another loop raises RuntimeError."""

    def __init__(self, supervisor: Any):
        self.supervisor = supervisor

    def _on_own_loop(self) -> None:
        loop = self.supervisor._loop  # (None until the fleet starts: its submit says what is wrong)
        if loop is not None and loop is not asyncio.get_running_loop():
            raise RuntimeError("an LLMClient is used on its fleet's event loop only (its answers are set there); "
                               "from another thread use a SyncClient, or a RemoteClient per event loop")

    def _submit(self, request_id, prompt_ids, params, sink, stream, session_id, resume):  # type: ignore[no-untyped-def]
        self._on_own_loop()
        self.supervisor.submit("local", request_id, prompt_ids, params, sink,
                               stream=stream, session_id=session_id, resume=resume)

    def _cancel(self, request_id: str) -> None:
        if not self.supervisor.closed:
            self.supervisor.cancel("local", request_id)

    def _check_open(self) -> None:
        self._on_own_loop()
        if self.supervisor.closed:
            raise FleetClosed("the fleet is shut down")

    async def abort(self, request_id: str) -> bool:
        """Abort one request; its generate() returns a result with finish_reason 'abort'.
        Returns False when no such request is in flight. Raises FleetClosed after shutdown, and
        InvalidRequest for an id that is no str, as a RemoteClient does."""
        _check_id(request_id)
        self._check_open()
        return self.supervisor.abort("local", request_id)

    async def abort_all(self, session_id: str | None = None) -> list[str]:
        """Abort every request in flight from this process's clients (LLMClient, SyncClient),
        or only those of ``session_id`` (e.g. the rest of a step once it has enough samples);
        each ends as with ``abort``, with its partial output. Returns their ids."""
        _check_session(session_id)
        self._check_open()
        return self.supervisor.abort_all("local", session_id)

    async def stats(self) -> dict[str, Any]:
        """Fleet statistics (PROTOCOL.md 6.5). Raises FleetClosed after shutdown."""
        self._check_open()
        return await self.supervisor.stats()

    async def control(self, op: str, **args: Any) -> dict[str, Any]:
        """Raises Unsupported when an engine lacks ``op``."""
        self._on_own_loop()
        return await self.supervisor.control(op, args)

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        return await self.control("sleep", level=level)

    async def wake_up(self) -> dict[str, Any]:
        return await self.control("wake_up")

    async def clear_kv_cache(self) -> dict[str, Any]:
        return await self.control("clear_kv_cache")

    async def start_profile(self, trace_dir: str) -> dict[str, Any]:
        return await self.control("start_profile", trace_dir=trace_dir)

    async def stop_profile(self) -> dict[str, Any]:
        return await self.control("stop_profile")

    async def update_weights(self, named_tensors: Any, version: int, **kwargs: Any) -> Any:
        """Push new weights to every worker (see Supervisor.update_weights)."""
        self._on_own_loop()
        return await self.supervisor.update_weights(named_tensors, version, **kwargs)


# Watched on a RemoteClient's socket from before it connects: a connection is up once its
# handshake succeeded, and lost at a disconnect.
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
CLOSE_ABORT_S = 2.0
"""How long RemoteClient.close() waits for the fleet to answer the abort of the client's requests."""


def _weakly(method: Any) -> Any:
    """A handler that calls ``method`` for as long as its object lives, holding it weakly."""
    ref = weakref.WeakMethod(method)

    def handle(frames: list[Any]) -> None:
        bound = ref()
        if bound is not None:
            bound(frames)

    return handle


def _close_dropped(sock: zmq.Socket, lsock: LoopSocket, monitor: LoopSocket) -> None:
    """A RemoteClient collected without close(): its readers off their loop, its sockets closed
    (on the loop's thread when that loop runs in another one)."""

    def close() -> None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        lsock.close(linger=0)

    loop = lsock._loop
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here or not loop.is_running():
        close()
    else:
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(close)


class RemoteClient(_Base):
    """Async client of a fleet's frontend socket, from any process.

    ``async with RemoteClient(address) as client: await client.generate(...)``

    Before its first request it says ``hello`` with ``batch``: under load its requests then go
    out, and their answers come back, several to a frame (a fleet that does not know ``hello``
    answers with an error, and every message goes alone as before).

    When the connection to the fleet is lost (the fleet shut down or was killed), the calls
    waiting for an answer end at once with FleetClosed: the fleet answers a connection, and a
    reconnection is a new one. Later calls go to whatever serves the address then.

    A client belongs to the event loop it is first used on: a call from another loop (another
    thread, a second ``asyncio.run``) raises RuntimeError before anything is sent. Make one
    client per loop.

    With ``lease_s`` the client holds a lease on the fleet (``hello`` with ``lease_s``,
    PROTOCOL.md 4.1): it says ``hello`` again every ``lease_s / 3`` seconds from then on, and when
    the fleet hears nothing from it for ``lease_s`` (its process was killed, its host or network
    went away, or its event loop was blocked that long) the fleet aborts the requests it has
    running. Without one, a client killed before it could close leaves its requests running to
    their end, their answers read by no one.
    """

    def __init__(self, address: str, *, curve_keys: tuple[bytes, bytes, bytes] | None = None,
                 call_timeout_s: float = 60.0, request_timeout_s: float | None = 3600.0,
                 lease_s: float | None = None):
        """``request_timeout_s`` bounds generate/stream calls made without a timeout: over a
        socket a lost answer (the fleet died, the network broke) would otherwise be waited for
        forever. ``call_timeout_s`` bounds abort/stats/control and the first ``hello``.
        ``curve_keys``: (client public, client secret, server public), for a fleet that
        requires CurveZMQ keys; ``rollfleet.transport.auth.load_client_keys(DIR)`` reads them
        from a directory that ``rollfleet keys DIR`` made. ``lease_s``: see the class; None (the
        default) holds none, a fleet that predates leases holds none either (logged)."""
        if lease_s is not None:
            Hello(id="", lease_s=lease_s)  # ValueError now for a lease the fleet would refuse
        self.lease_s = lease_s
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.default_timeout_s = request_timeout_s
        self.keys_hint = "curve_keys"
        """What the no-connection error names as the way to give keys (a CLI names its option)."""
        # The process's shared context, not one of its own: a client dropped without close()
        # is collected with its sockets in one cycle, and a context finalized before its sockets
        # close would block the collector forever in term().
        self._ctx = zmq.Context.instance()
        options = SocketOptions()
        # The fleet's answers are read up to the size the socket takes (a long result can pass
        # the codec's 16 MiB default for untrusted input).
        self._max_bytes = options.max_message_bytes
        self._sock = make_socket(self._ctx, zmq.DEALER, address, bind=False, options=options,
                                 curve_client_keys=curve_keys, monitor_events=_CONNECTION_EVENTS)
        self._monitor_sock = self._sock.get_monitor_socket(_CONNECTION_EVENTS)  # the one make_socket made
        self._lsock: LoopSocket | None = None  # made on first use, on the caller's event loop
        self._monitor: LoopSocket | None = None  # the socket's disconnect events, made with _lsock
        self._dropped: weakref.finalize | None = None  # closes both if the client is collected unclosed
        self._up = False  # a connection to the fleet is up (its handshake succeeded)
        self._sinks: dict[str, Any] = {}
        # Requests given up on (timeout, cancellation) whose terminal answer has not come yet:
        # their ids stay taken until it does, or what is still on its way for one would be
        # taken for the answers of a new request under the same id.
        self._given_up: set[str] = set()
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._hello: asyncio.Task[None] | None = None
        self._keep_alive: asyncio.Task[None] | None = None  # with lease_s: hello again every lease_s / 3
        self._batch = False  # the fleet takes batches from this client
        self._max_send: int | None = None  # the largest message the fleet reads (its hello says)
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # set while close() aborts this client's requests

    async def __aenter__(self) -> "RemoteClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the socket. Calls still waiting for an answer end with FleetClosed at once. The
        requests this client still has running on the fleet are then aborted (one ``abort_all``,
        its answer awaited for up to CLOSE_ABORT_S): no later connection could ever read them,
        and the fleet is not told when a client goes away (PROTOCOL.md section 1)."""
        if self._closed:
            return
        if self._closing is not None:  # another close() is aborting: this one ends with it
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()  # no new call goes out meanwhile
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(Error(id=request_id, code=FleetClosed.code, message="client closed", request_id=request_id))
        try:
            # (requests given up on had their aborts sent; one may not have left the socket yet)
            if (sinks or self._given_up) and self._up and self._lsock is not None:
                await self._abort_mine()
        finally:
            try:
                self._shut()
            finally:
                self._closing.set_result(None)

    async def _abort_mine(self) -> None:
        """Best effort: an abort_all for this client's requests, and a short wait for its answer
        (which says the fleet has stopped them; their own last answers are not waited for)."""
        assert self._lsock is not None
        loop = asyncio.get_running_loop()
        if self._lsock._loop is not loop:  # closed from another loop: its socket is not ours to drive here
            return
        msg = AbortAll(id=f"a{next(self._ids)}", session_id=None)
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._calls[msg.id] = fut
        try:
            self._post_on(self._lsock, codec.encode(msg))  # (_post would refuse: the client is closing)
            data = await wait_within(fut, min(self.call_timeout_s, CLOSE_ABORT_S))
            logger.debug("closing: aborted %d requests on the fleet", len(data.get("request_ids", [])))
        except (RolloutError, asyncio.TimeoutError) as exc:  # the fleet went, or is too slow
            logger.info("closing: could not abort this client's requests on the fleet at %s: %s", self.address,
                        exc or type(exc).__name__)
        finally:
            self._calls.pop(msg.id, None)

    def _shut(self) -> None:
        self._closed = True
        if self._dropped is not None:
            self._dropped.detach()
        if self._hello is not None and not self._hello.done():
            self._hello.cancel()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        self._sock.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
        else:
            self._monitor_sock.close(linger=0)
        if self._lsock is not None:
            self._lsock.close(linger=0)
        else:
            self._sock.close(linger=0)
        sinks, self._sinks = self._sinks, {}  # (one made while close() waited: none can be)
        self._given_up.clear()
        for request_id, sink in sinks.items():
            sink(Error(id=request_id, code=FleetClosed.code, message="client closed", request_id=request_id))
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(FleetClosed("client closed"))

    def _socket(self) -> LoopSocket:
        if self._closed or self._closing is not None:
            raise FleetClosed("client is closed")
        if self._lsock is None:
            # The loop's readers hold these handlers, not the client: one dropped without close()
            # is collected, and its finalizer takes its readers off the loop and closes its sockets.
            self._lsock = LoopSocket(self._sock, _weakly(self._on_frames))
            self._monitor = LoopSocket(self._monitor_sock, _weakly(self._on_connection_event))
            self._dropped = weakref.finalize(self, _close_dropped, self._sock, self._lsock, self._monitor)
            self._dropped.atexit = False
        return self._lsock

    def _on_connection_event(self, frames: list[bytes]) -> None:
        # The fleet answers a connection by its routing id, which a reconnection does not keep:
        # what was asked before can never be answered (the fleet went away, or was killed), so
        # it fails now instead of at its timeout. ZeroMQ reconnects by itself for later calls.
        # A connection refused at its handshake (keys not admitted) was never up: no answer comes
        # to it, as PROTOCOL.md says, and its calls end at their timeouts.
        event = zmq_monitor.parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up = True
            return
        if event != zmq.EVENT_DISCONNECTED or not self._up:
            return
        self._up = False
        logger.info("lost the connection to the fleet at %s", self.address)
        message = f"lost the connection to the fleet at {self.address}: its answer can no longer come"
        self._hello, self._batch = None, False  # a fleet there later may be a new one: hello again
        sinks, self._sinks = self._sinks, {}
        self._given_up.clear()  # a new connection: the fleet answers nothing more of the old one
        for request_id, sink in sinks.items():
            sink(Error(id=request_id, code=FleetClosed.code, message=message, request_id=request_id))
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(FleetClosed(message))

    def _on_frames(self, frames: list[bytes]) -> None:
        # (header,) -- further frames are ignored
        try:
            msg = codec.decode(frames[:1], self._max_bytes)
        except codec.DecodeError as exc:
            logger.warning("bad message from the fleet: %s", exc)
            return
        if type(msg) is not Batch:
            self._on_message(msg)
            return
        for item in codec.unbatch(msg):
            if isinstance(item, codec.DecodeError):
                logger.warning("bad message from the fleet: %s", item)
            else:
                self._on_message(item)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, (Reply, Error)) and msg.id in self._calls:
            fut = self._calls.pop(msg.id)
            if not fut.done():
                if isinstance(msg, Reply):
                    fut.set_result(msg.data)
                else:
                    fut.set_exception(from_code(msg.code, msg.message, msg.request_id))
            return
        sink = self._sinks.get(msg.id)
        if sink is not None:
            sink(msg)
            if isinstance(msg, (Result, Error)):
                self._sinks.pop(msg.id, None)
        elif isinstance(msg, (Result, Error)) and msg.id in self._given_up:
            self._given_up.discard(msg.id)  # the end of a request given up on: its id is free again
        elif isinstance(msg, Error) and not msg.id:
            # About a frame of this client's that the fleet could not read: which one, it cannot
            # say. Calls check their size against the fleet's limit before they go, so this is
            # a bug (of this client, or of the fleet).
            logger.warning("the fleet could not read a message of this client: %s: %s", msg.code, msg.message)

    def _check_size(self, what: str, encoded: bytes, request_id: str | None = None) -> None:
        if self._max_send is not None and len(encoded) > self._max_send:
            raise InvalidRequest(f"{what}: {len(encoded)} bytes, over the {self._max_send} bytes the fleet reads from "
                                 "a client", code="too_large", request_id=request_id)

    def _post(self, encoded: bytes) -> None:
        self._post_on(self._socket(), encoded)

    def _post_on(self, sock: LoopSocket, encoded: bytes) -> None:
        try:
            if self._batch:
                sock.post(None, encoded)
            else:
                sock.send([encoded])
        except zmq.ZMQError as exc:  # EAGAIN: no connection to queue it on (one refused at its handshake)
            raise FleetClosed(f"cannot send to the fleet at {self.address}: {exc}") from exc

    async def _say_hello(self) -> None:
        try:
            data = await self._call(Hello(id=f"h{next(self._ids)}", batch=True, lease_s=self.lease_s))
        except RolloutError as exc:
            if exc.code != "unknown_type":  # a fleet from before hello: no batches
                raise
            if self.lease_s is not None:
                logger.warning("the fleet at %s predates hello: it holds no lease for this client", self.address)
            return
        self._batch = data.get("batch") is True
        if self.lease_s is not None:
            if data.get("lease_s") is None:
                logger.warning("the fleet at %s holds no lease for this client: it predates leases", self.address)
            elif self._keep_alive is None:
                self._keep_alive = asyncio.ensure_future(self._keep_lease(weakref.ref(self), self.lease_s))
        limit = data.get("max_message_bytes")
        if type(limit) is int and limit > 0:
            self._max_send = limit
            # A batch is one message to the fleet: it must fit too (its own header is < 64 bytes).
            self._socket().batch_bytes = max(1, min(BATCH_BYTES, limit - 64))

    @staticmethod
    async def _keep_lease(ref: weakref.ref["RemoteClient"], lease_s: float) -> None:
        """Say hello again every lease_s / 3 seconds, its answer unread: any message renews the
        lease, and one that lapsed (this loop was held too long) is taken anew. Holds the client
        weakly: one dropped without close() is collected, and its lease then runs out."""
        # The empty id: no request has it, so its answer, which nothing waits for, meets no caller.
        encoded = codec.encode(Hello(id="", batch=True, lease_s=lease_s))
        while True:
            await asyncio.sleep(lease_s / 3)
            client = ref()
            if client is None or client._closed:
                return
            # Not while a first hello (after a reconnection) is on its way: it takes the lease then.
            if client._closing is None and client._hello is not None and client._hello.done():
                with contextlib.suppress(FleetClosed):
                    client._post(encoded)
            del client

    def _on_own_loop(self) -> None:
        if self._socket()._loop is not asyncio.get_running_loop():
            raise RuntimeError("this RemoteClient belongs to the event loop it was first used on; "
                               "make one client per event loop (or thread)")

    def _ready(self) -> Awaitable[None] | None:
        self._on_own_loop()
        hello = self._hello
        if hello is None or (hello.done() and (hello.cancelled() or hello.exception() is not None)):
            # once; again only after a failure
            hello = self._hello = asyncio.ensure_future(self._say_hello())
            # Its failure is raised in the calls that wait for it; with none left (all cancelled)
            # it is no error of its own to log as never retrieved.
            hello.add_done_callback(_retrieve)
        return None if hello.done() else self._after_hello(hello)

    def _submit(self, request_id, prompt_ids, params, sink, stream, session_id, resume):  # type: ignore[no-untyped-def]
        ready = self._ready()
        if ready is not None:
            return self._submit_after_hello(ready, request_id, prompt_ids, params, sink, stream, session_id, resume)
        self._start(request_id, prompt_ids, params, sink, stream, session_id, resume)
        return None

    async def _submit_after_hello(self, ready, *args):  # type: ignore[no-untyped-def]
        await ready
        self._start(*args)

    async def _after_hello(self, hello: asyncio.Task[None]) -> None:
        """Wait for the hello; FleetClosed when close() stopped it (its cancellation is not the
        caller's: a CancelledError would read as the caller's task being cancelled)."""
        try:
            # shielded: one caller giving up does not stop the hello that the others wait for
            await asyncio.shield(hello)
        except asyncio.CancelledError:
            if self._closed and hello.cancelled():
                raise FleetClosed("client closed") from None
            raise

    def _start(self, request_id, prompt_ids, params, sink, stream, session_id, resume):  # type: ignore[no-untyped-def]
        if request_id in self._sinks or request_id in self._given_up:
            raise DuplicateRequest(f"request {request_id!r} is already in flight", request_id=request_id)
        try:
            # = Generate(id=request_id, prompt_ids=..., sampling=params, stream=..., session_id=..., resume=...)
            header = codec.encode_values(Generate, request_id, prompt_ids, params, stream, session_id, resume)
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. a str in the list: nothing is registered
            # numpy's ints (a list of an array's elements) go as the plain ints they stand for
            plain = plain_ints(prompt_ids) if type(prompt_ids) is list else None
            try:
                if plain is None or list(map(type, prompt_ids)).count(int) == len(prompt_ids):
                    raise exc
                header = codec.encode_values(Generate, request_id, plain, params, stream, session_id, resume)
            except (TypeError, ValueError, OverflowError) as again:
                raise InvalidRequest(f"generate {request_id!r}: prompt_ids must be a list of ints ({again})",
                                     code="bad_field", request_id=request_id) from None
        self._check_size(f"generate {request_id!r}", header, request_id)
        self._sinks[request_id] = sink
        try:
            self._post(header)
        except FleetClosed:
            self._sinks.pop(request_id, None)
            raise

    def _cancel(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and not self._closed:
            self._given_up.add(request_id)
            # fire and forget: the request is gone for this caller either way
            with contextlib.suppress(FleetClosed):
                self._post(codec.encode(Abort(id=f"cancel-{next(self._ids)}", request_id=request_id)))

    async def _call(self, msg: Message) -> dict[str, Any]:
        self._on_own_loop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout_s  # one call_timeout_s for all of it
        hello = self._hello
        if type(msg) is not Hello and hello is not None and not hello.done():
            # After the requests that wait for it: an abort must not overtake its request.
            with contextlib.suppress(Exception):
                await self._after_hello(hello)  # bounded by call_timeout_s from its own start
        encoded = codec.encode(msg)
        self._check_size(msg.TYPE.value, encoded)
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._calls[msg.id] = fut
        try:
            self._post(encoded)
            return await wait_within(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            why = "" if self._up else (f": no connection to a fleet at {self.address} came up (is one serving there? "
                                       f"one that requires CurveZMQ keys answers only clients given them: {self.keys_hint})")
            raise RequestTimeout(f"no answer to {msg.TYPE.value} within {self.call_timeout_s}s{why}") from None
        finally:
            self._calls.pop(msg.id, None)

    async def abort(self, request_id: str) -> bool:
        try:
            await self._call(Abort(id=f"a{next(self._ids)}", request_id=request_id))
            return True
        except RolloutError as exc:
            if exc.code == "unknown_request":
                return False
            raise

    async def abort_all(self, session_id: str | None = None) -> list[str]:
        """Abort every request this client has in flight, or only those of ``session_id``;
        each ends as with ``abort``. Returns their ids (PROTOCOL.md 4.1 ``abort_all``)."""
        _check_session(session_id)
        data = await self._call(AbortAll(id=f"a{next(self._ids)}", session_id=session_id))
        return list(data.get("request_ids", []))

    async def stats(self) -> dict[str, Any]:
        """Fleet statistics (PROTOCOL.md 6.5). Raises Overloaded while 64 stats and control
        calls of this client wait for their answer."""
        return await self._call(Stats(id=f"s{next(self._ids)}"))

    async def control(self, op: str, **args: Any) -> dict[str, Any]:
        """{worker id: reply data}, as LLMClient.control. Raises Unsupported when an engine
        lacks ``op``, InvalidRequest for an unknown op or bad args, Overloaded while 64 stats
        and control calls of this client wait for their answer."""
        data = await self._call(Control(id=f"c{next(self._ids)}", op=op, args=args))
        return data.get("workers", data)
