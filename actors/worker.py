"""The engine worker process: one engine, one DEALER socket to the supervisor.

Started by the Supervisor as ``python -m rollfleet.actors.boot`` (which holds signals until
``main`` is ready for them, then runs it) with its config in the environment. It registers,
heartbeats, serves generate/abort/control/weights messages, and exits on a shutdown message,
on a fatal engine error (after telling the supervisor why), or on its own when the
supervisor's process dies.
"""

from __future__ import annotations

import asyncio
import atexit
import collections.abc
import contextvars
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import psutil
import zmq

from ..engines import Engine, EngineDead, create_engine
from ..errors import InvalidRequest, RolloutError, Unsupported
from ..transport import codec
from ..transport.messages import (
    CONTROL_OPS,
    Abort,
    Batch,
    Chunk,
    Control,
    Error,
    Generate,
    Heartbeat,
    Message,
    Register,
    Reply,
    Result,
    Shutdown,
    Stats,
    WeightsBegin,
    WeightsBucket,
    WeightsEnd,
    WorkerExit,
    check_control_args,
)
from ..transport.aio import LoopSocket, wait_within
from ..transport.sockets import SocketOptions, make_socket
from .boot import HELD, continue_on_parent_death, hold_signals
from .boot import pending as boot_pending
from .config import REPORT_INTERVAL_S
from .process import (
    CONFIG_ENV,
    is_resource_tracker,
    kill_tree,
    kmp_names,
    record_shm,
    remove_private_dir,
    unlink_if_same,
    unlink_segments_of,
    unlink_shm,
)

__all__ = ["EngineWorker", "main"]

logger = logging.getLogger(__name__)

def _timings(t_arrived: float, t_first: float | None) -> dict[str, float]:
    """A result's timings: seconds from the attempt's arrival to its result ('worker') and to
    its first token ('first_token', when it made one). The supervisor dates a non-streamed
    request's first token from them rather than from its first chunk, which may come up to
    report_interval_s later."""
    now = time.monotonic()
    if t_first is None:
        return {"worker": now - t_arrived}
    return {"worker": now - t_arrived, "first_token": t_first - t_arrived}


def _is_fatal(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the engine is dead: an EngineDead, or an error raised from one (the
    weight receiver reports a failed load as EngineFailed, with the EngineDead as its cause).
    Adapters may instead set a ``dead`` flag, checked where this is called."""
    while exc is not None:
        if isinstance(exc, EngineDead):
            return True
        exc = exc.__cause__
    return False


class EngineWorker:
    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.worker_id: str = config["worker_id"]
        self.engine: Engine | None = None
        self.weight_version = int(config.get("weight_version", 0))
        self.num_tokens = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}  # inner request id -> serving task
        # Non-streamed requests with tokens not yet reported -> their flush; one timer for all.
        self._unreported: dict[str, collections.abc.Callable[[], None]] = {}
        self._report_timer: asyncio.TimerHandle | None = None
        # Longest a non-streamed request's new tokens wait before they are reported as a chunk.
        # One timer per worker reports every such request's new tokens at once, so that they
        # leave in one message: a few messages per interval, not one per request.
        self._report_interval = float(config.get("report_interval_s", REPORT_INTERVAL_S))
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._weights_lock = asyncio.Lock()
        self._receiver: Any = None
        self._inline = False  # see _start
        self._sock: Any = None
        self._ctx: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._said_farewell = False
        self._max_bytes = int(config.get("max_message_bytes", 1 << 30))

    # -------------------------------------------------------------------- lifecycle
    async def run(self) -> int:
        self._ctx = ctx = zmq.Context()
        self._loop = asyncio.get_running_loop()
        opts = SocketOptions(max_message_bytes=self._max_bytes)
        curve = self.config.get("curve_client_keys")
        sock = make_socket(
            ctx,
            zmq.DEALER,
            self.config["addr"],
            bind=False,
            identity=self.worker_id.encode(),
            options=opts,
            curve_client_keys=tuple(k.encode() for k in curve) if curve else None,
        )
        self._sock = LoopSocket(sock, self._on_frames, copy=False)
        if self.config.get("node"):
            # Spawned by a node agent: the supervisor cannot see this process end, so it is
            # told when the process ends on its own (agent gone, SIGTERM), not only after
            # heartbeats stop.
            _WORKER_GOING.append(self.farewell)
        self._list_own_shm()
        try:
            try:
                self.engine = create_engine(self.config["engine"], self.config.get("engine_options"))
                await self.engine.start()
                self._inline = bool(getattr(self.engine, "inline_first_step", False))
            except Exception as exc:
                traceback.print_exc()
                self._send(WorkerExit(id="start", reason=f"engine failed to start: {exc!r}"))
                return 3
            self._send(
                Register(
                    id="register",
                    worker_id=self.worker_id,
                    pid=os.getpid(),
                    engine=self.engine.name,
                    device=self.config.get("device", "cpu"),
                    capabilities=sorted(self.engine.capabilities()),
                    weight_version=self.weight_version,
                    host=self.config.get("host") or socket.gethostname(),  # a node agent may name its node
                    batch=True,
                )
            )
            tasks = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat")]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            return self._exit_code
        finally:
            await self._close()
            if not self._said_farewell:
                self._sock.close(linger=200)
                ctx.term()

    def farewell(self, reason: str, wait_s: float = 1.0) -> None:
        """This process is ending on its own: send the supervisor a WorkerExit, close the
        socket, and wait up to ``wait_s`` for the message to leave. From any thread."""
        loop = self._loop
        if loop is None or self._sock is None or self._said_farewell:
            return
        self._said_farewell = True
        sent = threading.Event()

        def send() -> None:
            try:
                self._sock.send([codec.encode(WorkerExit(id="exit", reason=reason))])
                self._sock.close(linger=int(wait_s * 1000))
                self._ctx.term()  # returns once the message is out, or lingering ended
            except Exception:
                pass
            finally:
                sent.set()

        if threading.get_ident() == threading.main_thread().ident:  # the loop's own thread
            send()
            return
        try:
            loop.call_soon_threadsafe(send)
        except RuntimeError:  # the loop is closed
            return
        sent.wait(wait_s + 0.5)

    async def _close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._receiver is not None:
            self._receiver.close()
        if self.engine is not None:
            try:
                await wait_within(self.engine.shutdown(), 30)
            except Exception:
                logger.exception("engine shutdown failed")

    async def _fatal(self, reason: str) -> None:
        """Tell the supervisor why, then stop; it restarts this worker if its policy allows, and
        resumes its requests elsewhere from the tokens reported first. Only the first reason is
        told: whatever fails after it fails because of it."""
        if self._stop.is_set():
            return
        logger.error("worker %s: fatal: %s", self.worker_id, reason)
        if self._report_timer is not None:
            self._report_timer.cancel()
        self._report()  # the tokens made but not yet reported: a resume goes on after them
        self._send(WorkerExit(id="fatal", reason=reason, fatal=True))
        self._exit_code = 4
        self._stop.set()

    # -------------------------------------------------------------------- I/O
    def _send(self, msg: Message) -> None:
        # (header,) -- posted: what this loop iteration sends goes out as one batch
        self._sock.post(None, codec.encode(msg))

    def _on_frames(self, frames: list[Any]) -> None:
        # (header, *buffers); the frames are zmq.Frame, decoded in place
        try:
            msg = codec.decode(frames, self._max_bytes)
        except codec.DecodeError as exc:
            logger.warning("bad message from supervisor: %s", exc)
            self._undecodable(exc)
            return
        if type(msg) is Batch:
            for item in codec.unbatch(msg):
                if isinstance(item, codec.DecodeError):
                    logger.warning("bad message in a batch from the supervisor: %s", item)
                    self._undecodable(item)
                else:
                    self._handle(item, [])
            return
        self._handle(msg, [f.buffer for f in frames[1:]] if len(frames) > 1 else [])

    def _undecodable(self, exc: codec.DecodeError) -> None:
        if exc.type_tag in _WEIGHTS_TYPES:
            # In its place among the update's messages, as the receiver would refuse it: answered
            # weights_failed (PROTOCOL 6.8), and the update it is of is not committed.
            self._spawn(self._weights_unreadable(exc))
        else:
            self._send(codec.error_for(exc))

    async def _weights_unreadable(self, exc: codec.DecodeError) -> None:
        async with self._weights_lock:  # after the update's messages that came before it
            if self._receiver is not None and exc.msg_id:
                self._receiver.refuse(exc.msg_id)
        self._send(Error(id=exc.msg_id or "", code="weights_failed", message=str(exc)))

    def _handle(self, msg: Message, buffers: list[memoryview]) -> None:
        try:
            self._dispatch(msg, buffers)
        except Exception as exc:  # never let one message kill the worker
            logger.exception("failed to handle %s", type(msg).__name__)
            self._send(Error(id=msg.id, code="internal", message=repr(exc)))

    def _dispatch(self, msg: Message, buffers: list[memoryview]) -> None:
        if self._stop.is_set():
            # Exiting (after a shutdown, or a WorkerExit went out first): what the supervisor asks
            # now goes unanswered, and its death path takes it up once this process is gone. An
            # answer would do harm: an error fails a request that is resumed elsewhere, and a stats
            # or weights reply makes a worker whose engine died look as if it still served.
            return
        if isinstance(msg, Generate):
            if msg.id in self._tasks:
                self._send(Error(id=msg.id, code="duplicate_request", request_id=msg.id))
            else:
                self._start(msg)
        elif isinstance(msg, Abort):
            self._spawn(self._abort(msg))
        elif isinstance(msg, Control):
            self._spawn(self._control(msg))
        elif isinstance(msg, Stats):
            self._send(Reply(id=msg.id, data=self.stats()))
        elif isinstance(msg, (WeightsBegin, WeightsBucket, WeightsEnd)):
            if self._receiver is not None and self._receiver.interrupt(msg):
                from ..weights.receiver import INTERRUPT_GRACE_S

                logger.info("%s: %s came while a collective call of the update waited: it is given up unless it "
                            "ends within %.0f s", self.worker_id, msg.TYPE.value, INTERRUPT_GRACE_S)
            self._spawn(self._weights(msg, buffers))
        elif isinstance(msg, Shutdown):
            self._stop.set()
        elif isinstance(msg, Reply):
            pass  # registration acknowledged
        else:
            self._send(Error(id=msg.id, code="unknown_type", message=f"worker does not accept {msg.TYPE.value}"))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(_log_failure)

    async def _heartbeat_loop(self) -> None:
        interval = float(self.config.get("heartbeat_interval_s", 1.0))
        while True:
            if getattr(self.engine, "dead", False):
                # An engine that died with nothing running, which no request noticed.
                await self._fatal(f"the {self.config['engine']} engine is dead")
                return
            self._send(
                Heartbeat(
                    id="hb",
                    num_inflight=len(self._tasks),
                    num_tokens=self.num_tokens,
                    weight_version=self.weight_version,
                )
            )
            await asyncio.sleep(interval)

    def _list_own_shm(self) -> None:
        """List this process's OpenMP registration (where libiomp5 is loaded) where the next
        fleet's sweep finds it: killed with its supervisor (a kill of the job's whole process
        group), it leaves nobody else who knows its pid. An engine that lists more (vllm)
        rewrites the same list later, this name always in it (record_shm)."""
        private_dir = self.config.get("private_dir")
        if not private_dir:
            return
        try:
            record_shm(private_dir, set())
        except OSError as exc:  # its directory went with a supervisor that is going: nothing to list for
            logger.debug("could not list this worker's shared memory: %s", exc)

    # -------------------------------------------------------------------- requests
    def _start(self, msg: Generate) -> None:
        """Serve a request in a task; or, for engines that allow it, first run it right here
        up to its first suspension, and make a task only if it has one.

        A short request on a fast engine then finishes within the socket callback that
        received it: no task, no extra loop iteration (a task per request was ~14% of this
        process's time on the echo engine). That first step runs in its own context copy,
        as in a task, but outside any task: ``asyncio.current_task()`` is None there, and
        ``asyncio.timeout`` (so ``wait_for`` on Python >= 3.12) raises. Hence the opt-in.
        """
        coro = self._serve(msg)
        if not self._inline:
            self._tasks[msg.id] = asyncio.create_task(coro)
            return
        task = start_inline(coro)
        if task is not None:
            self._tasks[msg.id] = task

    async def _serve(self, msg: Generate) -> None:
        assert self.engine is not None
        t_arrived = time.monotonic()  # (this first step runs in the callback that received it)
        tokens: list[int] = []
        logprobs: list[float] | None = [] if msg.sampling.logprobs else None
        t_first: float | None = None  # when this attempt made its first token
        version = self.weight_version
        # Streamed requests get every step at once. Others get a chunk at most every
        # report_interval_s: the supervisor only needs their partial output to resume them if
        # this worker dies, and one message per request per decode step costs real throughput.
        streamed = msg.stream
        sent = 0

        def flush() -> None:
            nonlocal sent
            if len(tokens) > sent:
                # (header,) -- the tokens since the previous chunk
                self._send(Chunk(id=msg.id, token_ids=tokens[sent:],
                                 logprobs=logprobs[sent:] if logprobs is not None else None,
                                 weight_version=version))
                sent = len(tokens)

        # msg is this worker's own decoded copy: the engine may keep its prompt list.
        outputs = self.engine.generate(msg.id, msg.prompt_ids, msg.sampling)
        try:
            async for out in outputs:
                if t_first is None and out.token_ids:
                    t_first = time.monotonic()
                tokens.extend(out.token_ids)
                self.num_tokens += len(out.token_ids)
                if logprobs is not None and out.logprobs:
                    logprobs.extend(out.logprobs)
                if out.finish_reason is None:
                    if streamed:
                        flush()
                    elif len(tokens) > sent and msg.id not in self._unreported:
                        # A timer, not the next output: an engine that stalls still reports
                        # what it made, so a resume does not start over.
                        self._report_later(msg.id, flush)
                    continue
                self._unreported.pop(msg.id, None)
                if out.finish_reason is not None:
                    # (header,) -- all tokens of this attempt, not only the new ones
                    self._send(
                        Result(
                            id=msg.id,
                            token_ids=tokens,
                            finish_reason=out.finish_reason,
                            logprobs=logprobs,
                            weight_versions=[version],
                            worker=self.worker_id,
                            # this attempt's time here, which the supervisor sums, and when its
                            # first token came (PROTOCOL.md 4.2)
                            timings=_timings(t_arrived, t_first),
                        )
                    )
                    return
            raise RuntimeError("engine stream ended without a finish reason")
        except asyncio.CancelledError:
            raise
        except InvalidRequest as exc:  # the engine refused the input: the client's to fix
            logger.warning("request %s refused: %s", msg.id, exc)
            self._send(Error(id=msg.id, code=exc.code, message=str(exc), request_id=msg.id))
        except Exception as exc:
            dead = getattr(self.engine, "dead", False)
            if dead:
                # The engine died under this request, which is not at fault: no answer, so that it
                # resumes on another worker once this one is gone. A request that raised EngineDead
                # itself, from an engine not flagged dead, is answered: it may kill the next one too.
                logger.warning("request %s stopped: the engine died (%r)", msg.id, exc)
            else:
                logger.exception("request %s failed", msg.id)
                self._send(Error(id=msg.id, code="engine_error", message=repr(exc), request_id=msg.id))
            if dead or _is_fatal(exc):
                await self._fatal(f"engine died serving a request: {exc!r}")
        finally:
            self._unreported.pop(msg.id, None)
            self._tasks.pop(msg.id, None)
            # Left to the garbage collector, an unfinished generator is closed by a task that
            # the loop schedules through its self-pipe: several us per request.
            try:
                await outputs.aclose()
            except Exception:
                logger.exception("closing the output stream of request %s failed", msg.id)

    def _report_later(self, request_id: str, flush: collections.abc.Callable[[], None]) -> None:
        """Have ``flush`` report a request's new tokens at the worker's next report."""
        self._unreported[request_id] = flush
        if self._report_timer is None:
            self._report_timer = asyncio.get_running_loop().call_later(self._report_interval, self._report)

    def _report(self) -> None:
        self._report_timer = None
        due, self._unreported = self._unreported, {}
        for flush in due.values():
            flush()

    async def _abort(self, msg: Abort) -> None:
        assert self.engine is not None
        known = msg.request_id in self._tasks
        if known:
            await self.engine.abort(msg.request_id)
        self._send(Reply(id=msg.id, ok=known, data={"request_id": msg.request_id, "found": known}))

    async def _control(self, msg: Control) -> None:
        assert self.engine is not None
        op, args = msg.op, msg.args
        if op not in CONTROL_OPS:
            self._send(Error(id=msg.id, code="unknown_op", message=f"unknown control op {op!r}"))
            return
        try:
            check_control_args(op, args)
        except ValueError as exc:
            self._send(Error(id=msg.id, code="bad_field", message=str(exc)))
            return
        try:
            if op == "sleep":
                await self.engine.sleep(args.get("level", 1))
            elif op == "start_profile":
                trace_dir = args["trace_dir"]
                if "profile" in self.engine.capabilities():  # else start_profile raises Unsupported: no directory
                    os.makedirs(trace_dir, exist_ok=True)
                await self.engine.start_profile(trace_dir)
            else:
                await getattr(self.engine, op)()
        except RolloutError as exc:
            self._send(Error(id=msg.id, code=exc.code, message=str(exc)))
            return
        except ValueError as exc:
            self._send(Error(id=msg.id, code="bad_field", message=str(exc)))
            return
        except Exception as exc:
            logger.exception("control %s failed", op)
            self._send(Error(id=msg.id, code="engine_error", message=repr(exc)))
            if _is_fatal(exc) or getattr(self.engine, "dead", False):
                await self._fatal(f"engine died in {op}: {exc!r}")
            return
        self._send(Reply(id=msg.id, data={"op": op}))

    async def _weights(self, msg: WeightsBegin | WeightsBucket | WeightsEnd, buffers: list[Any] | None = None) -> None:
        assert self.engine is not None
        async with self._weights_lock:  # buckets apply in arrival order
            try:
                if self._receiver is None:
                    # The first update may import torch (the echo engine does not): in a thread,
                    # so heartbeats go on meanwhile. Not at start-up, where that import would
                    # hold up the parent-death thread of every worker.
                    await asyncio.to_thread(_import_weights)
                    from ..weights.receiver import WeightReceiver

                    # The worker sees only its own device (CUDA_VISIBLE_DEVICES), as index 0.
                    device = "cuda" if str(self.config.get("device", "cpu")).startswith("cuda") else "cpu"
                    self._receiver = WeightReceiver(self.engine, device=device)
                    self._receiver.version = self.weight_version
                    _PARENT_DEATH_CLEANUPS.append(self._receiver.unlink_orphans)  # kept shm names
                data, pending = await self._receiver.start(msg, buffers)
            except Exception as exc:
                await self._weights_failed(msg, exc)
                return

        def done(exc: Exception | None) -> None:
            if exc is not None:
                self._spawn(self._weights_failed(msg, exc))
                return
            self._sync_version()
            self._send(Reply(id=msg.id, data=data))

        # A bucket's copies may still run on the GPU: the next bucket starts meanwhile, and
        # the reply goes once they are done.
        self._receiver.watch(pending, done)

    async def _weights_failed(self, msg: Message, exc: Exception) -> None:
        self._sync_version()
        if isinstance(exc, Unsupported):
            self._send(Error(id=msg.id, code=exc.code, message=str(exc)))
            return
        logger.exception("weight update failed")
        self._send(Error(id=msg.id, code="weights_failed", message=repr(exc)))
        if _is_fatal(exc) or getattr(self.engine, "dead", False):
            await self._fatal(f"engine died loading weights: {exc!r}")

    def _sync_version(self) -> None:
        # The receiver knows: the committed version, or -1 after a partly applied failure.
        if self._receiver is not None:
            self.weight_version = self._receiver.version

    def stats(self) -> dict[str, Any]:
        engine_stats = self.engine.stats() if self.engine is not None else {}
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "num_inflight": len(self._tasks),
            "num_tokens": self.num_tokens,
            "weight_version": self.weight_version,
            "engine": engine_stats,
        }


def start_inline(coro: Any) -> asyncio.Task[Any] | None:
    """Run ``coro`` here, in a copy of the current context, up to its first suspension; then a
    Task goes on from exactly there, in that same context. None when it finished without one."""
    context = contextvars.copy_context()
    try:
        waiting = context.run(coro.send, None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Continue(coro, waiting), context=context)


class _Continue(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine already run to its first suspension, where it yielded ``waiting``, passed
    off as a new one so that a Task drives the rest: the Task's first step gets ``waiting``
    back, as if that step had been its own. A cancel before then reaches the coroutine."""

    __slots__ = ("_coro", "_waiting")

    def __init__(self, coro: Any, waiting: Any):
        self._coro = coro
        self._waiting = waiting

    def send(self, value: Any) -> Any:
        waiting = self._waiting
        if waiting is _HANDED_OVER:
            return self._coro.send(value)
        self._waiting = _HANDED_OVER
        return waiting

    def throw(self, *exc: Any) -> Any:
        self._waiting = _HANDED_OVER
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)


_HANDED_OVER = object()


_WEIGHTS_TYPES = frozenset({WeightsBegin.TYPE.value, WeightsBucket.TYPE.value, WeightsEnd.TYPE.value})


def _import_weights() -> None:
    import importlib

    importlib.import_module("rollfleet.weights.receiver")


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("worker task failed: %r", task.exception())


# ------------------------------------------------------------------------ parent death


SIGTERM_GRACE_S = 0.5
"""How long a worker sent SIGTERM by someone other than its supervisor waits to see whether
the supervisor is going too (a signal to the whole process group, a service manager)."""

_EXIT_ASKED = threading.Event()  # the supervisor wrote on the death pipe: its SIGTERM follows
_PARENT_GONE = threading.Event()
_DEATH_LOCK = threading.Lock()

# Callables run when the parent dies (e.g. unlink shared memory this worker opened).
_PARENT_DEATH_CLEANUPS: list[Any] = []
# Callables run, with the reason, when the worker ends on its own (its parent gone, a SIGTERM).
_WORKER_GOING: list[Any] = []


def _going(reason: str) -> None:
    for say in _WORKER_GOING:
        try:
            say(reason)
        except Exception:
            pass


def _watch_parent(config: dict[str, Any]) -> None:
    """Exit this process (and its children) as soon as the supervisor's process is gone.

    Two signals, either suffices: EOF on the death pipe (the parent's end closes when it
    dies, however it dies), and a change of parent pid (in case a forked copy of the
    parent still holds the pipe open). The kernel also sends SIGCONT when the parent dies
    (PR_SET_PDEATHSIG, asked for in actors.boot, or in main for a worker started without it),
    so a stopped worker wakes up to notice. A byte on the pipe is the supervisor saying that
    the SIGTERM it is about to send is its own.
    """
    fd = config.get("death_fd")
    parent = int(config.get("parent_pid", os.getppid()))

    def read_pipe() -> None:
        try:
            while os.read(fd, 64):
                _EXIT_ASKED.set()
        except OSError:
            pass
        _on_parent_death(config, "death pipe closed")

    def poll_ppid() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                _on_parent_death(config, "parent pid changed")

    if fd is not None:
        threading.Thread(target=read_pipe, name="death-pipe", daemon=True).start()
    threading.Thread(target=poll_ppid, name="ppid-poll", daemon=True).start()
    if os.getppid() != parent:  # gone before the kernel was asked to tell
        _on_parent_death(config, "parent pid changed")


def _on_parent_death(config: dict[str, Any], why: str) -> None:
    """Clean up after the dead supervisor and exit: this worker's children, the shm names the
    supervisor was still offering (``rf-<its pid>-*``), its private directory. Runs once;
    a second caller waits here until the process exits."""
    _PARENT_GONE.set()
    _DEATH_LOCK.acquire()
    print(f"rollfleet worker {config.get('worker_id')}: supervisor gone ({why}); exiting", file=sys.stderr)
    _going(f"its {'node agent' if config.get('node') else 'supervisor'} is gone ({why})")
    # Resource trackers are spared: once this process is gone too they unlink what the engine's
    # processes registered (semaphores, shared memory) and exit by themselves.
    kill_tree(os.getpid(), signal.SIGKILL, include_parent=False, spare=is_resource_tracker)
    unlink_shm(kmp_names([os.getpid()]))  # os._exit skips the runtime's own unlink
    for cleanup in _PARENT_DEATH_CLEANUPS:
        try:
            cleanup()
        except Exception:
            pass
    unlink_segments_of(int(config.get("parent_pid", 0)))
    frontend = config.get("frontend_file")
    if frontend:
        unlink_if_same(*frontend)  # still that supervisor's socket file
    private_dir = config.get("private_dir")
    if private_dir:
        # With what the engines' own processes shared (vLLM's message queues), as their lists in
        # the private directory name it: the supervisor that would sweep them is gone.
        remove_private_dir(private_dir)
    os._exit(1)


def _parent_dying(parent: int) -> bool:
    """Whether the supervisor's process is gone, or going: its main thread has ended (which is
    when the kernel wakes a stopped worker) while its other threads, and so its end of the death
    pipe, are not gone yet."""
    if os.getppid() != parent:
        return True
    try:
        return psutil.Process(parent).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _on_sigterm(config: dict[str, Any], name: str = "SIGTERM") -> None:
    """From the supervisor (it says so on the death pipe first): exit at once, the finally
    blocks releasing what the worker holds. From anyone else (also SIGHUP, the terminal
    closed, and SIGQUIT): if the supervisor is going too (the whole process group was
    signalled), clean up after it as when it dies."""
    parent = int(config.get("parent_pid", os.getppid()))
    deadline = time.monotonic() + SIGTERM_GRACE_S
    while not _EXIT_ASKED.is_set() and time.monotonic() < deadline:
        if _PARENT_GONE.is_set() or os.getppid() != parent:
            _on_parent_death(config, f"{name}, and the supervisor is gone")
        time.sleep(0.01)
    _going(f"stopped by {name}")
    sys.exit(0)


def main(pending: list[str] | None = None) -> None:
    """Run a worker. ``pending``: the names of signals that came before this (actors.boot
    held them), answered once the handlers are in place, as if they had come then."""
    if pending is None:  # started without actors.boot: its first steps, here
        hold_signals()
        continue_on_parent_death()
        pending = boot_pending
    config = json.loads(os.environ[CONFIG_ENV])
    level = config.get("log_level", logging.WARNING)
    if not isinstance(level, int):  # a level's name; one logging does not know must not stop the worker
        level = logging.getLevelName(str(level).upper())
        level = level if isinstance(level, int) else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s worker {config['worker_id']} %(name)s: %(message)s",
    )
    _watch_parent(config)
    if config.get("nice"):
        os.nice(int(config["nice"]))  # before the engine starts: its processes inherit it
    # Ctrl-C reaches the terminal's whole process group: the supervisor decides what it means
    # (a shutdown, an exit its workers clean up after, or nothing, in a script that goes on);
    # actors.boot ignores it. SIGTERM, SIGHUP and SIGQUIT go to _on_sigterm from here on
    # (actors.boot held them until now), within the try: its SystemExit ends the process below.
    worker = EngineWorker(config)
    try:
        for sig in HELD:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, lambda signum, _frame: _on_sigterm(config, signal.Signals(signum).name))
        while pending:  # came while this process started: answered now, the death pipe watched
            _on_sigterm(config, pending.pop(0))
        try:
            import uvloop
        except ImportError:  # (only the import: one in the worker's run is its own, not run twice)
            code = asyncio.run(worker.run())
        else:
            code = uvloop.run(worker.run())
    except SystemExit as exc:  # _on_sigterm's, once run() released what it holds
        code = exc.code
    _exit(code, config)


def _exit(code: Any, config: dict[str, Any]) -> None:
    """End the process as a normal exit would, less Python's teardown of its modules: with torch
    loaded that is seconds of C code in which the death-pipe thread can no longer run, so a
    supervisor killed meanwhile (in its shutdown, waiting for this process to end) would leave
    its private directory behind with no one to remove it."""
    atexit._run_exitfuncs()  # logging's flush, multiprocessing's reaping of the engine's children, ...
    unlink_shm(kmp_names([os.getpid()]))  # os._exit skips the OpenMP runtime's own unlink
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if _parent_dying(int(config.get("parent_pid", os.getppid()))):
        # The supervisor dies as this process ends (this one was stopped, say, and its death woke
        # it up with a shutdown message waiting): the death pipe may not have said so yet.
        _on_parent_death(config, "supervisor dying")
    _DEATH_LOCK.acquire()  # not in the midst of _on_parent_death's cleanup, which ends the process itself
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    main()
