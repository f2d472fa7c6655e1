"""The Supervisor: spawns and watches engine workers, routes requests, serves clients.

It runs on the caller's asyncio loop (a trainer process, a script) and wires together:
WorkerProcess (spawn/kill), WorkerHandle (per-worker state and calls), Router (policy),
InflightTable (request state), and two ROUTER sockets: one for workers, one for outside
clients (the frontend). Socket reads are reader callbacks on the loop (transport.aio), as is
everything else, so the tables need no locks.

This file is longer than the others on purpose: it is the one place where the request state
machine (submit, dispatch, chunk, result, preempt, abort) and the worker life cycle (spawn,
register, die, restart, catch up) meet, and both mutate the same tables from loop callbacks.
Policy (Router), state (InflightTable, WorkerHandle), processes (process.py), weight updates
(updates.py), remote nodes (node.py) and metrics (metrics.py) already live elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import itertools
import logging
import os
import socket
import stat
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from ..errors import (
    FleetClosed,
    FleetError,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    ResumeExhausted,
    RolloutError,
    Unsupported,
    WorkerLost,
    WorkerStartError,
)
from ..transport import auth, codec
from ..transport.messages import (
    CLIENT_TYPES,
    CONTROL_OPS,
    Abort,
    AbortAll,
    Batch,
    Chunk,
    Control,
    Error,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    Message,
    Register,
    Reply,
    Result,
    SamplingParams,
    Shutdown,
    Stats,
    WorkerExit,
    check_control_args,
    plain_ints,
)
from ..transport.aio import LoopSocket, wait_within
from ..transport.sockets import SocketOptions, bound_host, ipc_in_use, ipc_path, make_socket
from .config import FleetConfig
from .handle import RemoteProcess, RestartTracker, WorkerHandle, WorkerState
from .inflight import Entry, InflightTable, State
from .metrics import LogLimiter, MetricsExporter
from .process import (
    WorkerProcess,
    claim_private_dir,
    device_env,
    kmp_names,
    remove_private_dir,
    remove_with,
    sampling_seed,
    sweep_private_dirs,
    sweep_stale_segments,
    sweep_shm_lists,
    unlink_if_same,
    unlink_shm,
)
from .router import Router
from .sentinel import Sentinel
from .updates import WeightSync

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

FORGOTTEN_SLOTS = 4096
"""How many forgotten remote slots (FleetConfig.keep_dead_remote_slots) keep their last
generation, so that an older one registering there is refused as in a kept slot."""

OPPOSITE_OPS = {"sleep": "wake_up", "wake_up": "sleep", "pause": "resume", "resume": "pause"}
"""The control ops that set a state of the fleet (its sleep level, its pause), each with the one
that undoes it."""

ENGINE_STATS_TIMEOUT_S = 5.0
"""Longest wait for one worker's own stats in a ``stats`` answer (call_timeout_s if shorter): a
hung worker, not yet killed for its silence (heartbeat_timeout_s), does not hold the answer."""

LOCAL = "local"
# Enum values are properties: read them once, not on every request.
_ABORT = FinishReason.ABORT.value
_LENGTH = FinishReason.LENGTH.value
_FOREVER = float("inf")
_NUMBER = (float, int)
_build_result = codec.builder(Result)  # Result(...) from its id and fields in class order, unchecked

MAX_CALLS_PER_CLIENT = 64
"""Most stats and control calls of one client waiting for their answer; more are answered
overloaded. Each is a task of the supervisor's loop that asks every worker: unbounded, one
client sending stats as fast as it can held every other client's requests back by seconds."""

# Clients remembered as taking batches (hello with batch): the oldest are forgotten past this
# many, and get their messages one to a frame again, which they read as well.
MAX_BATCH_CLIENTS = 1 << 16
# Clients holding a lease (hello with lease_s): past this many, the oldest hello's lease is
# dropped (that client's requests then run on as if it had asked for none).
MAX_LEASES = 1 << 16
# A client's batch holds at most this many messages (rollfleet sends 32): one frame may not hold
# the loop for seconds. A bigger one is refused whole.
MAX_CLIENT_BATCH = 1024


class _Leftovers:
    """What a started Supervisor holds outside Python: its ZeroMQ context and sockets, its
    authenticator, its worker processes, its files. Released by ``__call__`` when the
    Supervisor is collected without having been shut down (its loop ended first): else the
    collector would finalize the context with its sockets open and block for good in term(),
    and the workers would run on. Holds no reference to the Supervisor."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.sockets: list[zmq.Socket] = []
        self.auth: Any = None
        self.procs: set[Any] = set()
        self.private_dir: str | None = None
        self.frontend_file: tuple[str, int] | None = None
        self.sentinel: Sentinel | None = None

    def __call__(self) -> None:
        logger.warning("a started fleet was collected without shutdown(): killing its workers")
        for proc in list(self.procs):
            with contextlib.suppress(Exception):
                proc.kill()
                proc.close()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
        if self.ctx is not None:
            self.ctx.term()
        if self.frontend_file is not None:
            unlink_if_same(*self.frontend_file)
        if self.private_dir:
            remove_private_dir(self.private_dir)
        if self.sentinel is not None:
            self.sentinel.release()


def resume_seed(seed: int, num_tokens: int) -> int:
    """The seed of a seeded request resumed after ``num_tokens`` tokens. Its own seed would start
    the engine's draws over: the continuation would reuse the uniforms that chose its first
    tokens, so that token n + i follows token i (not a sample of the policy). A seed derived
    from both is as reproducible (the same request interrupted at the same point draws the
    same) and independent of the first draws. In [0, 2**62): a signed 64-bit int."""
    digest = hashlib.blake2b(f"{int(seed)}/resume/{int(num_tokens)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Supervisor:
    """Owns the worker processes and every request in flight.

    Use as ``async with Supervisor(config) as sup: client = sup.client()``.
    """

    def __init__(self, config: FleetConfig | None = None, **overrides: Any):
        if config is None:
            config = FleetConfig(**overrides)
        elif overrides:
            raise ValueError("pass either a FleetConfig or keyword overrides, not both")
        self.config = config
        self.router = Router(deterministic=config.deterministic_routing, max_sticky=config.max_sticky)
        self.table = InflightTable()
        self.workers: dict[str, WorkerHandle] = {}  # worker id -> handle (live incarnations)
        self.slots: dict[int, WorkerHandle] = {}  # index -> current incarnation
        self.weight_version = 0
        self.private_dir: str | None = None
        self.closing_hooks: list[Callable[[], None]] = []
        """Called first thing at shutdown (node publications tell their agents here, before
        any worker is stopped, so that no agent restarts one)."""
        self.worker_address = ""
        self.advertised_host = ""  # the host a wildcard worker socket was published under (publish_router)
        self.frontend_address: str | None = None
        self.counters = {"completed": 0, "aborted": 0, "failed": 0, "resumed": 0, "cancelled": 0}
        self._restarts: dict[int, RestartTracker] = {}
        self._remote_slots: dict[str, int] = {}  # '<node>/<slot>' of a remote worker -> index
        self._remote_indexes = itertools.count(config.num_workers)  # an index is never given twice
        # Forgotten remote slots -> the generation they had (the FORGOTTEN_SLOTS last): an older
        # one that registers there later is still refused.
        self._forgotten_slots: dict[str, int] = {}
        self._pending: deque[Entry] = deque()
        self._per_origin: dict[str, int] = {}
        self._ctx: zmq.Context | None = None
        self._wsock: Any = None
        self._fsock: Any = None
        self._frontend_file: tuple[str, int] | None = None  # an ipc:// frontend's socket file, inode
        self._sentinel: Sentinel | None = None  # cleans up if this process dies with no worker to do it
        self._batch_clients: dict[bytes, None] = {}  # identities that said hello with batch, oldest first
        self._client_calls: dict[bytes, int] = {}  # stats and control calls of each client not answered yet
        # identity -> [lease_s, deadline (time.monotonic())] of the clients that said hello with
        # lease_s, the oldest hello first; any frame of the client moves its deadline on
        self._leases: dict[bytes, list[float]] = {}
        self._leases_expired = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closing = False
        self._training_lock = asyncio.Lock()
        self._training_depth = 0  # open training() blocks: the engines sleep while it is > 0
        self._closed = False
        self._max_bytes = config.max_message_bytes
        # What hello promises clients, and reads: never above the socket limit, over which ZeroMQ
        # drops the client unanswered.
        self._client_max_bytes = min(config.max_client_message_bytes, config.max_message_bytes)
        self._auth: auth.Authenticator | None = None
        self._worker_keys: tuple[bytes, bytes] | None = None
        self._server_keys: tuple[bytes, bytes] | None = None
        self._paused = False  # a weight update holds new dispatches
        self.weights = WeightSync(self, keep_last_weights=config.keep_last_weights)
        self._drops = LogLimiter(logger)  # bad or foreign frames: counted, logged sparingly
        self._stall_seen: dict[str, tuple[int, float]] = {}  # inner id -> (tokens, unchanged since)
        self._sleep_level = 0  # the level of the sleep control op in force (0: awake)
        self._engines_paused = False  # the pause control op is in force
        self._ready = False  # start() finished: every worker registered once
        self._no_workers: str | None = None  # why no worker is left and none will come back
        self._metrics: MetricsExporter | None = None
        self._leftovers = _Leftovers()
        self._collected: weakref.finalize | None = None  # set by start()
        # The private copy of the sampling params the last request came with, and its wire map:
        # a rollout step's requests share one SamplingParams, which is then copied and mapped
        # once, not per request. (caller's object, its stop ids then, the copy, the copy's map)
        self._params_memo: tuple[SamplingParams, list[int], SamplingParams, dict[str, Any]] | None = None

    # ================================================================== lifecycle
    async def __aenter__(self) -> "Supervisor":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Spawn every worker and wait until all have registered.

        Raises WorkerStartError (with the tail of the worker's output) when one fails or
        does not register within ``start_timeout_s``; the fleet is then shut down.
        """
        if self._started:
            if self.closed:
                raise FleetClosed("this Supervisor was shut down, and one starts only once: make a new one")
            raise RuntimeError("supervisor already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        # Not at exit: a fleet still running then is another thread's, and its workers go
        # with this process anyway.
        self._collected = weakref.finalize(self, self._leftovers)
        self._collected.atexit = False
        cfg = self.config
        try:
            self.private_dir = tempfile.mkdtemp(prefix="rollfleet-", dir=cfg.private_dir_root)
            os.chmod(self.private_dir, 0o700)
            self._leftovers.private_dir = self.private_dir
            claim_private_dir(self.private_dir)
            self._start_sentinel()
            sweep_private_dirs(os.path.dirname(self.private_dir))
            sweep_stale_segments()
            self._ctx = self._leftovers.ctx = zmq.Context()
            opts = SocketOptions(max_message_bytes=cfg.max_message_bytes)
            self.worker_address = cfg.worker_addr or f"ipc://{self.private_dir}/workers.sock"
            for addr in (self.worker_address, cfg.frontend_addr):
                if addr:
                    auth.check_bind(addr, cfg.curve_keys_dir)
                path = ipc_path(addr) if addr else None
                if path is not None and os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
                    # ZeroMQ would unlink it to bind there: a mistyped path must not cost a file.
                    raise OSError(errno.EEXIST, f"{addr}: {path} exists and is not a socket file; refusing to "
                                                "replace it")
            server_keys = None
            if cfg.curve_keys_dir:
                server_keys = auth.load_server_keys(cfg.curve_keys_dir)
                self._auth = self._leftovers.auth = auth.Authenticator(self._ctx, cfg.curve_keys_dir)
                # Spawned workers get a key pair of their own, valid for this fleet only.
                self._worker_keys = zmq.curve_keypair()
                self._auth.allow(self._worker_keys[0])
            self._server_keys = server_keys
            tcp_workers = self.worker_address.startswith("tcp://")
            sock = make_socket(self._ctx, zmq.ROUTER, self.worker_address, bind=True, options=opts,
                               curve_server_keys=server_keys if tcp_workers else None,
                               zap_domain=auth.WORKER_DOMAIN if server_keys and tcp_workers else None)
            self._leftovers.sockets.append(sock)
            self._wsock = LoopSocket(sock, self._on_worker_frames, on_post_error=self._on_post_error)
            self.worker_address = sock.LAST_ENDPOINT.decode()
            if cfg.frontend_addr and ipc_in_use(cfg.frontend_addr):
                raise OSError(errno.EADDRINUSE, f"{cfg.frontend_addr} is served by another process")
            if cfg.frontend_addr:
                client_opts = SocketOptions(max_message_bytes=cfg.max_message_bytes, hwm=cfg.client_send_hwm)
                sock = make_socket(self._ctx, zmq.ROUTER, cfg.frontend_addr, bind=True, options=client_opts,
                                   curve_server_keys=server_keys,
                                   zap_domain=auth.CLIENT_DOMAIN if server_keys else None)
                self._leftovers.sockets.append(sock)
                self._fsock = LoopSocket(sock, self._on_frontend_frames, on_post_error=self._on_client_gone)
                self.frontend_address = sock.LAST_ENDPOINT.decode()
                path = ipc_path(self.frontend_address)
                if path is not None and not os.path.isabs(path):
                    # Bound in this directory; said (and removed) by a path that holds from any other.
                    path = os.path.abspath(path)
                    self.frontend_address = f"ipc://{path}"
                if path is not None:  # removed at shutdown if it is still this fleet's file
                    self._frontend_file = self._leftovers.frontend_file = (path, os.stat(path).st_ino)
                    # ... and, if this process and its workers are killed together, with this
                    # private directory by its sentinel or the next fleet's sweep (if no other fleet
                    # bound it since)
                    remove_with(self.private_dir, path)
            if cfg.metrics_port is not None:
                self._metrics = MetricsExporter(cfg.metrics_port)
            self._tasks = [asyncio.create_task(self._monitor_loop(), name="rollfleet-monitor")]
            for index in range(cfg.num_workers):
                self._restarts[index] = RestartTracker()
                self._spawn(index)
            await self._wait_registered(list(self.slots.values()))
        except BaseException:
            await self.shutdown()
            raise
        self._ready = True
        if self._metrics is not None:  # a scrape right after start sees the workers, not a blank page
            self._metrics.update(await self.stats(engines=False))
        logger.info("fleet of %d %s workers ready in %s", cfg.num_workers, cfg.engine, self.private_dir)

    def _spawn(self, index: int) -> WorkerHandle:
        cfg = self.config
        generation = self._restarts[index].total
        worker_id = f"w{index}-{generation}"
        assert self.private_dir is not None
        device = cfg.device_of(index)
        engine_options = dict(cfg.engine_options)
        engine_options.setdefault("private_dir", self.private_dir)
        engine_options.setdefault("device", "cuda" if device.startswith("cuda") else device.split(":")[0])
        # The base of each worker's own seed: sampling_seed when given (e.g. one per rank), else seed.
        engine_options["sampling_seed"] = sampling_seed(engine_options.get("sampling_seed", engine_options.get("seed")),
                                                        worker_id)
        env = dict(cfg.worker_env)
        env.update(device_env(device))
        if cfg.engine == "vllm" and device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in {**os.environ, **env}:
            # vLLM pins its CPU threads by local rank, which is 0 in every worker: spread them.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
        proc = WorkerProcess(
            worker_id,
            {
                "worker_id": worker_id,
                "addr": self.worker_address,
                "engine": cfg.engine,
                "engine_options": engine_options,
                "device": device,
                "heartbeat_interval_s": cfg.heartbeat_interval_s,
                "report_interval_s": cfg.report_interval_s,
                "nice": cfg.worker_nice,
                "max_message_bytes": cfg.max_message_bytes,
                "private_dir": self.private_dir,
                # the frontend's ipc:// socket file, [path, inode]: removed by the workers if this
                # process dies without shutting down (it lies outside the private directory)
                "frontend_file": list(self._frontend_file) if self._frontend_file else None,
                "weight_version": 0,
                "curve_client_keys": (
                    [k.decode() for k in (*self._worker_keys, self._server_keys[0])]
                    if self._worker_keys and self._server_keys and self.worker_address.startswith("tcp://")
                    else None
                ),
                "log_level": logging.getLogger("rollfleet").getEffectiveLevel(),  # a number: 5 has no name
            },
            env,
            os.path.join(self.private_dir, f"{worker_id}.log"),
        )
        if generation >= 2:
            # A slot keeps the logs of its worker and of the one before it: one file per restart
            # would pile up for as long as the fleet runs.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.private_dir, f"w{index}-{generation - 2}.log"))
        self._leftovers.procs.add(proc)
        handle = WorkerHandle(index=index, generation=generation, device=device, proc=proc, send=self._send_worker)
        previous = self.slots.get(index)
        if previous is not None:
            # Why the slot was restarted stays visible; it is not this worker's own reason to end.
            handle.earlier_error = previous.last_error or previous.earlier_error
        self.workers[worker_id] = handle
        self.slots[index] = handle
        if proc.pidfd is not None:
            assert self._loop is not None
            self._loop.add_reader(proc.pidfd, self._on_process_exit, handle)
        return handle

    async def _wait_registered(self, handles: list[WorkerHandle]) -> None:
        timeout = self.config.start_timeout_s
        try:
            gathered = asyncio.gather(*(h.registered for h in handles))
            try:
                await wait_within(gathered, timeout)
            finally:
                if gathered.done() and not gathered.cancelled():
                    gathered.exception()  # read, so a failure nobody waits for is not logged as lost
        except asyncio.TimeoutError:
            late = [h for h in handles if not h.registered.done() or h.registered.cancelled()]
            h = late[0] if late else handles[0]
            raise WorkerStartError(
                f"worker {h.worker_id} did not register within {timeout}s; its output ends with:\n"
                f"{h.proc.stderr_tail()}"
            ) from None

    async def shutdown(self) -> None:
        """Stop every worker and release every resource. Idempotent; safe on a half-started fleet."""
        if self._closed or self._closing:
            return
        self._closing = True
        # The socket files go first: connections made stay up without them, and a kill during
        # the workers' grace period (SIGTERM then SIGKILL from a job manager) leaves none behind.
        self._unlink_socket_files()
        for hook in list(self.closing_hooks):
            try:
                hook()
            except Exception:
                logger.exception("a shutdown hook failed")
        try:
            for entry in list(self.table):
                self._fail(entry, FleetClosed("the fleet is shutting down"))
            for h in self.workers.values():  # control ops and the like: closed, not a worker lost
                h.fail_calls("fleet shut down", closing=True)
            handles = [h for h in self.workers.values() if h.alive]
            for h in handles:
                if isinstance(h.proc, RemoteProcess):
                    h.proc.terminate()  # a Shutdown message; its node agent reaps the process
                    continue
                if h.state is WorkerState.STARTING:
                    h.proc.terminate()  # not connected yet: a shutdown message could not reach it
                    continue
                try:
                    self._send_worker(h, Shutdown(id="shutdown"))
                except Exception:
                    h.proc.terminate()
            deadline = time.monotonic() + self.config.shutdown_timeout_s
            while any(h.proc.alive() for h in handles) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for h in handles:
                if h.proc.alive():
                    h.proc.terminate()
            deadline = time.monotonic() + 2.0
            while any(h.proc.alive() for h in handles) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for h in list(self.workers.values()):
                self._retire(h, "fleet shut down")
        finally:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                try:
                    await task
                except BaseException:
                    pass
            self.release()
            await self._reap_sentinel()

    def _start_sentinel(self) -> None:
        """Start the process that cleans up after this one if it dies with no worker alive to do
        it (actors.sentinel). Without one (it could not be started), the workers and the next
        fleet's sweep still do."""
        assert self.private_dir is not None
        try:
            self._sentinel = self._leftovers.sentinel = Sentinel(self.private_dir)
        except OSError as exc:
            logger.warning("no sentinel process for %s (%s): if this process dies with no worker alive, "
                           "the next fleet started beside it removes what it leaves", self.private_dir, exc)

    async def _reap_sentinel(self) -> None:
        """Wait for the released sentinel to exit (it has nothing to do), so that no process of
        this fleet outlives its shutdown; one that does not within 2 s (stopped, say) is killed."""
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is None:
            return
        deadline = time.monotonic() + 2.0  # it starts in ~0.1 s; killed, it loses nothing
        while not sentinel.exited() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        sentinel.kill()

    def release(self) -> None:
        """Close the sockets, the authenticator, the metrics endpoint and the ZeroMQ context,
        and remove the frontend's socket file and the private directory. Idempotent; on the
        fleet's loop (the end of ``shutdown``, or queued there by a SyncClient that abandoned it)."""
        if self._collected is not None:
            self._collected.detach()
        for lsock in (self._wsock, self._fsock):
            if lsock is not None:
                lsock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._unlink_socket_files()
        if self.private_dir:
            remove_private_dir(self.private_dir)
        # workers killed at the end of the grace period leave their OpenMP registration
        unlink_shm(kmp_names([h.pid for h in self.slots.values() if isinstance(h.proc, WorkerProcess)]))
        if self._sentinel is not None:
            self._sentinel.release()  # all is clean: it exits (shutdown waits for it)
        self._closed = True

    def _unlink_socket_files(self) -> None:
        """Remove the frontend's ipc:// socket file (if it is still the one bound here) and the
        workers' socket file in the private directory."""
        if self._frontend_file is not None:
            unlink_if_same(*self._frontend_file)
            self._frontend_file = None
        path = ipc_path(self.worker_address) if self.private_dir else None
        if path and os.path.dirname(path) == self.private_dir:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def abandon(self) -> None:
        """Last resort, from another thread, when this fleet's loop cannot run ``shutdown``
        (blocked, e.g. in a trainer's weight generator that never yields): kill every worker's
        process tree and remove the private directory and the shared memory it lists. Touches
        no asyncio state; the fleet is unusable afterwards."""
        self._closing = True
        for handle in list(self.workers.values()):
            if isinstance(handle.proc, WorkerProcess):
                with contextlib.suppress(Exception):
                    handle.proc.kill()
                    handle.proc.close()
        if self.private_dir:
            remove_private_dir(self.private_dir)
        if self._sentinel is not None:
            self._sentinel.release()

    def remove_with(self, path: str) -> None:
        """Remove ``path`` (a file or directory this process made for the fleet: a ready file, a
        model written for it) when the fleet goes: at shutdown, or, if this process dies without
        one (SIGKILL), by its workers as they exit or by its sentinel, or else by the next fleet
        started with the same ``private_dir_root``. Left alone if another file has taken its place
        by then."""
        if self.private_dir is None or self.closed:
            raise RuntimeError("remove_with needs a started, open fleet")
        remove_with(self.private_dir, path)

    @property
    def worker_host(self) -> str:
        """The host that workers on other hosts dial the worker socket at: the one it is bound to
        over TCP, or for a wildcard bind (0.0.0.0, ::, *) the host it was published under
        (``publish_router(..., host=)``); '' when neither names one (an ipc:// socket, say)."""
        return bound_host(self.worker_address) or self.advertised_host  # (published: a tcp:// one)

    @property
    def metrics_address(self) -> str | None:
        """URL of the Prometheus endpoint (``FleetConfig.metrics_port``), or None."""
        return self._metrics.address if self._metrics is not None else None

    @property
    def closed(self) -> bool:
        return self._closed or self._closing

    @property
    def shut_down(self) -> bool:
        """True once shutdown has finished (``closed`` is True from its start)."""
        return self._closed

    def _check_open(self, request_id: str | None = None) -> None:
        if not self._started or self.closed:
            raise FleetClosed("the fleet is not running", request_id=request_id)

    def client(self) -> Any:
        """An in-process client of this fleet. All of them are one client to it: they share
        request ids (an id in flight from one is a DuplicateRequest from another),
        ``max_inflight_per_client`` and ``abort_all``."""
        from .client import LLMClient

        return LLMClient(self)

    # ================================================================== worker death
    def _on_process_exit(self, handle: WorkerHandle) -> None:
        code = handle.proc.returncode
        reason = handle.last_error or f"process exited with code {code}"
        self._on_worker_dead(handle, reason)

    def _retire(self, handle: WorkerHandle, reason: str) -> None:
        """Forget a worker incarnation: kill what is left of it and release its fds."""
        if handle.proc.pidfd is not None and self._loop is not None:
            self._loop.remove_reader(handle.proc.pidfd)
        handle.state = WorkerState.DEAD
        handle.ended_at = time.monotonic()
        handle.proc.kill()
        handle.proc.close()
        self._leftovers.procs.discard(handle.proc)
        handle.fail_calls(reason)
        self.router.remove_worker(handle.worker_id)
        self.workers.pop(handle.worker_id, None)
        if not handle.registered.done():
            handle.registered.set_exception(
                WorkerStartError(f"worker {handle.worker_id} died during start-up ({reason}); its output ends with:\n"
                                 f"{handle.proc.stderr_tail()}")
            )
            handle.registered.exception()  # mark retrieved: start() re-raises it when it waits

    def _on_worker_dead(self, handle: WorkerHandle, reason: str) -> None:
        if handle.worker_id not in self.workers:
            return
        reg = handle.registered
        was_ready = reg.done() and not reg.cancelled() and reg.exception() is None
        if self.closed:  # the fleet shuts down: its workers end, as asked
            logger.info("worker %s (pid %d) ended with the fleet: %s", handle.worker_id, handle.pid, reason)
        else:
            logger.warning("worker %s (pid %d) died: %s", handle.worker_id, handle.pid, reason)
        handle.last_error = reason
        self._retire(handle, reason)
        sweep_shm_lists(self.private_dir)  # what its engine's processes shared, if it was killed
        unlink_shm(kmp_names([handle.pid]))  # and its own OpenMP registration, if it was killed
        for entry in self.table.on_worker(handle.worker_id):
            self.table.unbind(entry)
            if entry.state is State.ABORTING:
                self._complete(entry, _ABORT)
            elif entry.resume:
                self._preempt(entry)
            else:
                self._fail(entry, WorkerLost(f"worker {handle.worker_id} died: {reason}", request_id=entry.request_id))
        if not self.closed and was_ready and not isinstance(handle.proc, RemoteProcess):
            self._schedule_restart(handle.index)  # remote workers are restarted by their node agent
        if isinstance(handle.proc, RemoteProcess):
            self._forget_dead_remote_slots()
        self._pump()
        self._check_workers_left()

    def _forget_dead_remote_slots(self) -> None:
        """Keep at most ``keep_dead_remote_slots`` remote slots whose worker is gone, those
        that died last: an agent started again fills new slots, so a long-served fleet would
        otherwise keep a row in stats for every worker of every agent it ever had."""
        dead = sorted((h.ended_at, index, slot) for slot, index in self._remote_slots.items()
                      if not (h := self.slots[index]).alive)
        for _, index, slot in dead[:max(0, len(dead) - self.config.keep_dead_remote_slots)]:
            self._forgotten_slots[slot] = self.slots[index].generation  # not there: popped at admission
            del self._remote_slots[slot], self.slots[index], self._restarts[index]
        while len(self._forgotten_slots) > FORGOTTEN_SLOTS:
            del self._forgotten_slots[next(iter(self._forgotten_slots))]

    def _schedule_restart(self, index: int) -> None:
        policy = self.config.restart
        if policy is None:
            return
        tracker = self._restarts[index]
        recent = tracker.recent(policy.window_s)
        if recent >= policy.max_restarts:
            if policy.max_restarts == 0:
                logger.error("worker slot %d died and restarts are off (max_restarts=0); giving up on it", index)
            else:
                logger.error("worker slot %d restarted %d times in %.0fs; giving up on it", index, recent,
                             policy.window_s)
            return
        delay = min(policy.backoff_s * (2**recent), policy.max_backoff_s)
        tracker.record()

        async def restart() -> None:
            await asyncio.sleep(delay)
            if self.closed:
                return
            try:
                handle = self._spawn(index)
            except Exception as exc:  # no process to wait for (EMFILE, EAGAIN, its log file's directory gone)
                logger.error("restart of worker slot %d failed: its process could not be started: %r", index, exc)
                dead = self.slots.get(index)
                if dead is not None and not dead.alive:
                    dead.earlier_error = dead.earlier_error or dead.last_error
                    dead.last_error = f"its restart failed: {exc!r}"
                self._schedule_restart(index)  # the policy's window bounds it, as for a worker that dies starting
                asyncio.get_running_loop().call_soon(self._check_workers_left)
                return
            try:
                await self._wait_registered([handle])
            except WorkerStartError as exc:
                if self._closing:  # the shutdown stopped it: not a failure to report
                    return
                logger.error("restart of worker slot %d failed: %s", index, exc)
                self._on_worker_dead(handle, str(exc))
                # It died before it was ready, so its death did not schedule a restart; the
                # policy's window still bounds a worker that can never start.
                if not self.closed:
                    self._schedule_restart(index)
                    # once this task is done: the restart it was is no hope of a worker any more
                    asyncio.get_running_loop().call_soon(self._check_workers_left)

        task = asyncio.create_task(restart(), name=f"rollfleet-restart-{index}")
        self._tasks.append(task)

    def _check_workers_left(self) -> None:
        """With every worker dead and none to be restarted (the restart policy gave up on each
        slot, or there is none), nothing would ever serve a waiting request: those end with
        FleetError, and new ones are refused with it."""
        if (not self._ready or self.closed or self._no_workers or self.workers or self.restarting()
                or self.config.accept_remote_workers):  # a node agent may still bring one
            return
        last = "; ".join(f"{h.worker_id}: {h.last_error}" for _, h in sorted(self.slots.items()))
        self._no_workers = f"no worker is left and none will be restarted ({last})"
        logger.error("%s; waiting requests fail and new ones are refused", self._no_workers)
        self._pending.clear()
        for entry in self.table:
            self._fail(entry, FleetError(self._no_workers, request_id=entry.request_id))

    def restarting(self) -> bool:
        """Whether a worker is starting or a restart of one is scheduled."""
        return any(h.state is WorkerState.STARTING for h in self.workers.values()) or any(
            not t.done() and t.get_name().startswith("rollfleet-restart-") for t in self._tasks)

    async def _monitor_loop(self) -> None:
        """Hung workers (missed heartbeats) are killed; the exit path handles the rest."""
        interval = self.config.heartbeat_interval_s
        tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            held, tick = now - tick - interval, now
            if held > interval:
                # This process was stopped (SIGSTOP, a suspended job, a frozen cgroup) or its loop
                # held up: the heartbeats sent meanwhile are not read yet. Silence counts only
                # while the supervisor could listen, so that healthy workers are not killed for it.
                for handle in self.workers.values():
                    handle.last_heartbeat = min(now, handle.last_heartbeat + held)
                for lease in self._leases.values():  # nor the clients' silence (their frames wait unread)
                    lease[1] += held
                self._stall_seen.clear()  # nor are requests stalled for it: progress is judged afresh
            self._tasks = [t for t in self._tasks if not t.done()]
            for handle in list(self.workers.values()):
                if handle.proc.pidfd is None and not handle.proc.alive():
                    self._on_process_exit(handle)
                elif handle.state is not WorkerState.STARTING and now - handle.last_heartbeat > self.config.heartbeat_timeout_s:
                    handle.last_error = f"no heartbeat for {now - handle.last_heartbeat:.1f}s (hung)"
                    handle.proc.kill()  # the pidfd fires and _on_process_exit follows
            if self.config.stall_timeout_s is not None:
                self._check_stalls(now)
            if self._leases:
                self._expire_leases(now)
            self._drops.flush()
            if self._metrics is not None:
                self._metrics.update(await self.stats(engines=False))

    def _expire_leases(self, now: float) -> None:
        """Abort the requests of each client whose lease ran out (nothing heard from it for its
        lease_s), as its abort_all would, and forget the lease (PROTOCOL.md 4.1 ``hello``)."""
        expired = [identity for identity, (_, deadline) in self._leases.items() if deadline <= now]
        for identity in expired:
            lease_s = self._leases.pop(identity)[0]
            self._leases_expired += 1
            aborted = self.abort_all(identity.hex())
            logger.warning("client %s sent nothing for its lease of %gs: aborted its %d requests",
                           identity.hex(), lease_s, len(aborted))

    def _check_stalls(self, now: float) -> None:
        """Kill workers whose engine stopped producing tokens for a running request.

        Heartbeats come from the worker's loop, so they go on when only the engine is stuck;
        progress is judged per request instead: a request running on a ready worker whose
        token count has not moved for ``stall_timeout_s``. The death path then resumes it.
        """
        limit = self.config.stall_timeout_s
        if limit is None or self._paused or self._sleep_level or self._engines_paused:
            self._stall_seen.clear()  # waits that are meant to be: start over afterwards
            return
        seen: dict[str, tuple[int, float]] = {}
        stalled: dict[str, str] = {}  # worker id -> one stalled request
        for entry in self.table:
            inner = entry.inner_id
            if inner is None or entry.state is not State.RUNNING:
                continue
            handle = self.workers.get(entry.worker_id or "")
            if handle is None or handle.state is not WorkerState.READY:
                continue
            count = len(entry.token_ids)
            prev = self._stall_seen.get(inner)
            since = prev[1] if prev is not None and prev[0] == count else now
            seen[inner] = (count, since)
            if now - since > limit:
                stalled.setdefault(handle.worker_id, entry.request_id)
        self._stall_seen = seen  # rebuilt each tick: finished requests drop out by themselves
        for worker_id, request_id in stalled.items():
            handle = self.workers[worker_id]
            handle.last_error = f"request {request_id!r} got no token for {limit}s (engine stalled)"
            logger.error("worker %s: %s; killing it", worker_id, handle.last_error)
            handle.proc.kill()

    # ================================================================== worker socket
    def _send_worker(self, handle: WorkerHandle, msg: Message, buffers: list[Any] | None = None) -> None:
        if not buffers:
            self._send_encoded(handle, codec.encode(msg))
            return
        try:
            # (identity, header, *buffers) -- bulk bytes go without a copy
            self._wsock.send([handle.identity, codec.encode(msg), *buffers], copy=False)
        except zmq.ZMQError as exc:
            self._on_post_error(handle.identity, exc)
            raise

    def _send_encoded(self, handle: WorkerHandle, header: bytes) -> None:
        if handle.batched:
            # (identity, header) -- posted: what this loop iteration sends the worker goes
            # out as one batch; a send error comes back through _on_post_error
            self._wsock.post(handle.identity, header)
            return
        try:
            # (identity, header)
            self._wsock.send([handle.identity, header])
        except zmq.ZMQError as exc:
            self._on_post_error(handle.identity, exc)
            raise

    def _on_post_error(self, identity: bytes | None, exc: zmq.ZMQError) -> None:
        handle = self.workers.get((identity or b"").decode("utf-8", "replace"))
        if handle is None:
            return
        # While the fleet shuts down, a worker that left first (a signal to the whole group) is expected.
        self._drops.log("worker_send_failed", logging.DEBUG if self._closing else logging.WARNING,
                        "could not send to worker %s: %s", handle.worker_id, exc)
        if isinstance(handle.proc, RemoteProcess) and exc.errno == zmq.EHOSTUNREACH:
            # Its connection is gone: the monitor loop takes the death path, which resumes
            # or fails what was sent to it.
            handle.last_error = handle.last_error or f"remote worker unreachable: {exc}"
            handle.proc.lost()

    def allow_worker_key(self, public_key: str | bytes) -> None:
        """Admit workers that connect with this CurveZMQ public key (Z85), e.g. a node
        agent's (see actors.node.publish_router). Safe to call from any thread."""
        if self._auth is None:
            raise RuntimeError("worker keys need a started supervisor with curve_keys_dir")
        self._auth.allow(public_key.encode() if isinstance(public_key, str) else public_key)

    def _send_shutdown(self, identity: bytes) -> None:
        """Tell a worker process that the fleet no longer counts on it, so that it exits; best
        effort (it may be gone already)."""
        try:
            # (identity, header)
            self._wsock.send([identity, codec.encode(Shutdown(id="shutdown"))])
        except zmq.ZMQError:
            pass

    def _admit_remote(self, identity: bytes, frames: list[bytes]) -> WorkerHandle | None:
        """A Register from a worker some node agent started: give it a handle and a slot.

        Only its id's form is checked here; the connection passed CurveZMQ with an admitted
        key, or it would not have reached this socket. Its slot ('<node>/<slot>') keeps its
        index across the restarts its agent makes."""
        try:
            msg = codec.decode(frames[1:2], self._max_bytes)
        except codec.DecodeError:
            return None
        worker_id = identity.decode("utf-8", "replace")
        slot, _, generation = worker_id.rpartition("-")
        if not isinstance(msg, Register) or msg.worker_id != worker_id or "/" not in slot or not generation.isdigit():
            return None
        index = self._remote_slots.get(slot)
        previous = self.slots.get(index) if index is not None else None
        # The generation its slot has reached: its current worker's, or a forgotten slot's last.
        reached = previous.generation if previous is not None else self._forgotten_slots.get(slot, -1)
        if int(generation) < reached:
            # A generation its slot has gone past (a process its agent replaced, come back
            # after a network fault): not admitted, and told to go, or it would run on.
            self._send_shutdown(identity)
            return None
        if index is None:
            self._forgotten_slots.pop(slot, None)
            index = next(self._remote_indexes)
            self._remote_slots[slot] = index
            self._restarts[index] = RestartTracker()
        if previous is not None:
            self._restarts[index].record()

        def stop() -> None:
            self._send_worker(handle, Shutdown(id="shutdown"))

        proc = RemoteProcess(worker_id, msg.pid, msg.host, stop)
        handle = WorkerHandle(index=index, generation=int(generation), device=msg.device, proc=proc,
                              send=self._send_worker)
        # Asked before the new handle goes in: a worker taken for dead that registers again has
        # the same id as its previous start, which is no live worker to replace.
        replaces = previous is not None and self.workers.get(previous.worker_id) is previous
        self.workers[worker_id] = handle
        self.slots[index] = handle  # first: the slot is live while the worker it replaces dies
        if replaces:
            previous.last_error = previous.last_error or f"replaced by {worker_id}"
            self._send_shutdown(previous.identity)  # the replaced process may still run
            previous.proc.lost()
            self._on_worker_dead(previous, previous.last_error)
        logger.info("remote worker %s on %s connected", worker_id, msg.host or "?")
        return handle

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        # (identity, header, *buffers)
        if len(frames) < 2:
            self._drops.log("worker_empty", logging.WARNING, "dropped an empty message on the worker socket")
            return
        identity = frames[0]
        handle = self.workers.get(identity.decode("utf-8", "replace"))
        if handle is None and self.config.accept_remote_workers and not self.closed:
            handle = self._admit_remote(identity, frames)
        if handle is None:
            self._drops.log("unregistered_identity", logging.WARNING,
                            "dropped a message from unregistered identity %r", identity[:64])
            return
        try:
            msg = codec.decode(frames[1:2], self._max_bytes)
        except codec.DecodeError as exc:
            # No error reply: a worker cannot act on one, and a buggy worker would get a
            # reply per bad frame; the log line (rate-limited) is for the operator.
            self._drops.log("bad_worker_frame", logging.WARNING, "dropped a bad message from worker %s: %s",
                            handle.worker_id, exc)
            return
        handle.last_heartbeat = time.monotonic()
        if type(msg) is Batch:
            for item in codec.unbatch(msg):
                if isinstance(item, codec.DecodeError):
                    self._drops.log("bad_worker_frame", logging.WARNING, "dropped a bad message from worker %s: %s",
                                    handle.worker_id, item)
                else:
                    self._on_worker_message(handle, item)
            return
        self._on_worker_message(handle, msg)

    def _on_worker_message(self, handle: WorkerHandle, msg: Message) -> None:
        if isinstance(msg, Chunk):
            self._on_chunk(handle, msg)
        elif isinstance(msg, Result):
            self._on_result(handle, msg)
        elif isinstance(msg, Reply):
            handle.resolve(msg.id, msg.data)
        elif isinstance(msg, Error):
            self._on_worker_error(handle, msg)
        elif isinstance(msg, Heartbeat):
            handle.on_heartbeat(msg.weight_version, msg.num_tokens)
        elif isinstance(msg, Register):
            self._on_register(handle, msg)
        elif isinstance(msg, WorkerExit):
            handle.last_error = msg.reason
            self.router.set_available(handle.worker_id, False)
            if isinstance(handle.proc, RemoteProcess):
                handle.proc.lost()  # no pidfd to fire: the monitor loop takes the death path
            elif not self.closed and handle.state is WorkerState.READY:
                # It answers nothing more (its engine died, say): killed now, so that its requests
                # resume and its restart begins once it is gone (the pidfd tells, in a moment),
                # not after an engine's slow shutdown. Not waited for here, on the loop.
                handle.proc.kill()
                return
            if not handle.registered.done():
                handle.registered.set_exception(
                    WorkerStartError(f"worker {handle.worker_id} failed to start: {msg.reason}\n{handle.proc.stderr_tail()}")
                )
        else:
            self._drops.log("bad_worker_frame", logging.WARNING, "dropped an unexpected %s message from worker %s",
                            msg.TYPE.value, handle.worker_id)

    def _on_register(self, handle: WorkerHandle, msg: Register) -> None:
        handle.batched = msg.batch
        handle.engine = msg.engine
        handle.host = msg.host
        handle.pid = msg.pid
        handle.capabilities = list(msg.capabilities)
        handle.weight_version = msg.weight_version
        self._send_worker(handle, Reply(id=msg.id, data={"worker_id": handle.worker_id}))
        if self.weights.needs_catch_up(handle):
            # A restarted worker must hold the current weights before it serves.
            task = asyncio.create_task(self._catch_up(handle), name=f"rollfleet-catch-up-{handle.worker_id}")
            self._tasks.append(task)
            return
        if handle.weight_version != self.weight_version:
            logger.warning("worker %s serves weight version %d while the fleet is at %d: nothing kept can bring it "
                           "there (keep_last_weights is off and the last update was not given as a callable); its "
                           "results say so, and the next update brings it along",
                           handle.worker_id, handle.weight_version, self.weight_version)
        self._ready_as_the_fleet(handle)

    def _ready_as_the_fleet(self, handle: WorkerHandle) -> None:
        """Mark a worker ready; one that comes up (a restart) while a sleep or a pause is in force
        is first put to sleep or paused like the others, so that it does not serve meanwhile."""
        if not (self._sleep_level or self._engines_paused):
            self._mark_ready(handle)
            return
        task = asyncio.create_task(self._hold_then_ready(handle), name=f"rollfleet-hold-{handle.worker_id}")
        self._tasks.append(task)

    async def _hold_then_ready(self, handle: WorkerHandle) -> None:
        # Until it is ready, fleet-wide control ops and weight updates pass it by: whatever
        # changed while it was being held (a wake_up, a resume, an update) is applied to it too
        # before it serves. Ready once nothing is left to apply, with no wait in between.
        slept, paused = 0, False
        while handle.alive:
            want = self._sleep_level, self._engines_paused
            ops = []
            if want[0] != slept:
                ops.append(("sleep", {"level": want[0]}) if want[0] else ("wake_up", {}))
            if want[1] != paused:
                ops.append(("pause", {}) if want[1] else ("resume", {}))
            if not ops:
                if not self.weights.needs_catch_up(handle):
                    break
                if not await self._caught_up(handle):  # an update committed while it was held
                    return
                continue
            for op, args in ops:
                try:
                    await handle.call(Control(id=handle.next_call_id(), op=op, args=args), self.config.call_timeout_s)
                except Exception as exc:  # an engine without the op serves as it would have before
                    logger.warning("worker %s came up during a sleep or pause and could not be given %s: %s",
                                   handle.worker_id, op, exc)
            slept, paused = want
        self._mark_ready(handle)

    async def _catch_up(self, handle: WorkerHandle) -> None:
        if await self._caught_up(handle):
            self._ready_as_the_fleet(handle)

    async def _caught_up(self, handle: WorkerHandle) -> bool:
        """Bring a worker to the fleet's weight version; False (the worker killed) when that fails."""
        try:
            await self.weights.catch_up(handle)
        except Exception as exc:
            logger.error("could not bring worker %s to weight version %d: %s", handle.worker_id, self.weight_version, exc)
            handle.last_error = f"catch-up failed: {exc}"
            handle.proc.kill()
            return False
        return True

    def _mark_ready(self, handle: WorkerHandle) -> None:
        if not handle.alive:
            return
        handle.state = WorkerState.READY
        # Available even while a weight update holds dispatching (_paused does that): nothing
        # would make it available again afterwards.
        self.router.add_worker(handle.worker_id)
        if not handle.registered.done():
            handle.registered.set_result(None)
        self._pump()

    # ================================================================== requests
    def submit(
        self,
        origin: str,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Message], None],
        *,
        stream: bool = False,
        session_id: str | None = None,
        resume: bool | None = None,
        owned: bool = False,
    ) -> Entry:
        """Start a request; its chunks/result/error go to ``sink``. ``owned``: the caller hands
        over ``prompt_ids`` and ``params`` (made for this request alone, e.g. just decoded), so
        the fleet keeps them as they are instead of private copies.

        Raises FleetClosed, DuplicateRequest, Overloaded, InvalidRequest.
        """
        self._check_open(request_id)
        if self._no_workers:
            raise FleetError(self._no_workers, request_id=request_id)
        if not request_id:
            raise InvalidRequest("generate: the request id must not be empty (it names the request in every answer)",
                                 code="bad_field")
        count = self._per_origin.get(origin, 0)
        if count >= self.config.max_inflight_per_client:
            raise Overloaded(f"{count} requests in flight for this client (max_inflight_per_client)",
                             request_id=request_id)
        if not owned:
            prompt_ids = list(prompt_ids)
            if list(map(type, prompt_ids)).count(int) != len(prompt_ids):  # msgpack takes Python ints, not numpy's
                plain = plain_ints(prompt_ids)  # numpy's ints, say: taken as the ints they stand for
                if plain is None:
                    raise InvalidRequest(f"generate {request_id!r}: prompt_ids must be a list of ints (a tensor's or "
                                         f"array's tolist() gives them)", code="bad_field", request_id=request_id)
                prompt_ids = plain
        if not owned:
            # A private deep copy: callers' objects are never mutated. SamplingParams is frozen
            # but for its stop list, so the same object with the same stop ids needs no new one.
            memo = self._params_memo
            if memo is not None and memo[0] is params and memo[1] == params.stop_token_ids:
                params = memo[2]
            else:
                private = params.replace()
                self._params_memo = (params, list(params.stop_token_ids), private, private.to_wire())
                params = private
        entry = Entry(
            origin=origin,
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            sink=sink,
            stream=stream,
            session_id=session_id,
            resume=self.config.resume if resume is None else resume,
        )
        self.table.add(entry)
        self._per_origin[origin] = count + 1
        if self._pending or self._paused:
            self._pending.append(entry)  # behind those already waiting
            self._pump()
            return entry
        # Nothing waits: what _pump would do for this one entry, without the queue.
        # Only sessions are sticky: a request id names nothing beyond its request (another client's,
        # or a later one, may reuse it), and remembering each would push the sessions out.
        worker_id = self.router.choose(session_id)
        if worker_id is None:
            self._pending.append(entry)
        else:
            self._dispatch(entry, self.workers[worker_id])
        return entry

    def _pump(self) -> None:
        """Dispatch waiting requests while some worker can take them."""
        while self._pending and not self._paused:
            entry = self._pending[0]
            if entry.state is not State.PENDING or self.table.get(entry.origin, entry.request_id) is not entry:
                self._pending.popleft()  # finished while waiting
                continue
            worker_id = self.router.choose(entry.session_id, prefer=entry.last_worker or None)
            if worker_id is None:
                return
            self._pending.popleft()
            self._dispatch(entry, self.workers[worker_id])

    def _dispatch(self, entry: Entry, handle: WorkerHandle) -> None:
        inner = self.table.bind(entry, handle.worker_id)
        self.router.on_dispatch(handle.worker_id)
        if entry.t_dispatched is None:
            entry.t_dispatched = time.monotonic()
        params = entry.params
        sampling: SamplingParams | dict[str, Any] = params  # what is encoded: the params, or their wire map
        if entry.token_ids:  # a resumed request continues from its partial output
            if params.seed is None:
                sampling = params.replace(max_tokens=entry.remaining_tokens)
            else:
                sampling = params.replace(max_tokens=entry.remaining_tokens,
                                          seed=resume_seed(params.seed, len(entry.token_ids)))
        elif self._params_memo is not None and self._params_memo[2] is params:
            sampling = self._params_memo[3]  # its wire map, made once (msgpack only reads it)
        # Encoded before anything else runs, so the first attempt can send the entry's own list.
        prompt_ids = entry.prompt_ids + entry.token_ids if entry.token_ids else entry.prompt_ids
        try:
            # = Generate(id=inner, prompt_ids=..., sampling=sampling, stream=entry.stream), encoded
            header = codec.encode_values(Generate, inner, prompt_ids, sampling, entry.stream, None, None)
        except (OverflowError, ValueError, TypeError) as exc:  # an id msgpack cannot carry (2**64, say)
            self.router.on_finish(handle.worker_id)
            self.table.unbind(entry)
            self._fail(entry, InvalidRequest(f"generate {entry.request_id!r}: prompt_ids must be ints in the signed "
                                             f"64-bit range ({exc})", code="bad_field", request_id=entry.request_id))
            return
        try:
            self._send_encoded(handle, header)
        except zmq.ZMQError:  # (unbatched workers only) it vanished between choose() and send
            # _send_encoded logged it; a posted message's error goes to _on_post_error instead,
            # and the worker's death path resumes this request.
            self.router.on_finish(handle.worker_id)
            self.router.set_available(handle.worker_id, False)
            self.table.unbind(entry)
            entry.state = State.PENDING
            self._pending.appendleft(entry)
            return
        self.on_dispatch(entry, handle.worker_id)

    def on_dispatch(self, entry: Entry, worker_id: str) -> None:
        """Hook for tests and subclasses; called after each dispatch (first and resumed)."""

    def _foreign(self, handle: WorkerHandle, entry: Entry, msg: Message) -> bool:
        """An answer about a request that runs on another worker: dropped, so that no worker
        (a buggy one, or one some node agent started) can end or add to another's requests."""
        if entry.worker_id == handle.worker_id:
            return False
        self._drops.log("bad_worker_frame", logging.WARNING,
                        "dropped a %s from worker %s for request %s, which runs on %s",
                        msg.TYPE.value, handle.worker_id, msg.id, entry.worker_id)
        return True

    def _on_chunk(self, handle: WorkerHandle, msg: Chunk) -> None:
        entry = self.table.by_inner(msg.id)
        if entry is None:
            return  # cancelled or already finished: late tokens are dropped
        if entry.worker_id != handle.worker_id and self._foreign(handle, entry, msg):  # (compared first: hot path)
            return
        if not msg.token_ids:
            return
        if entry.segment_version is None:
            entry.begin_segment(msg.weight_version)
        if entry.t_first_token is None:
            entry.t_first_token = time.monotonic()
        entry.token_ids.extend(msg.token_ids)
        if entry.params.logprobs:
            if entry.logprobs is None:
                entry.logprobs = []
            entry.logprobs.extend(msg.logprobs or [])
        if entry.stream:
            entry.sink(Chunk(id=entry.request_id, token_ids=list(msg.token_ids), logprobs=msg.logprobs,
                             weight_version=msg.weight_version))

    def _on_result(self, handle: WorkerHandle, msg: Result) -> None:
        entry = self.table.by_inner(msg.id)
        if entry is None or self._foreign(handle, entry, msg):
            return
        self.router.on_finish(handle.worker_id)
        streamed = len(entry.token_ids)
        entry.token_ids[entry.segment_start:] = msg.token_ids
        if entry.params.logprobs:
            lp = entry.logprobs or []
            lp[entry.segment_start:] = msg.logprobs or []
            entry.logprobs = lp
        if msg.token_ids and entry.segment_version is None and msg.weight_versions:
            entry.begin_segment(msg.weight_versions[0])
        if entry.t_first_token is None and msg.token_ids:
            entry.t_first_token = time.monotonic()
        if msg.timings:
            on_worker = msg.timings.get("worker")
            if type(on_worker) in _NUMBER and 0.0 <= on_worker < _FOREVER:  # a worker's word: a bad one is left out
                entry.t_worker = on_worker + (entry.t_worker or 0.0)
                first = msg.timings.get("first_token")
                if entry.segment_start == 0 and type(first) in _NUMBER and 0.0 <= first <= on_worker:
                    # This attempt made the request's first token, 'worker - first' seconds before
                    # its result: earlier than its first chunk came, by up to report_interval_s.
                    t = time.monotonic() - (on_worker - first)
                    if entry.t_first_token is None or t < entry.t_first_token:
                        entry.t_first_token = t
        if entry.stream and len(entry.token_ids) > streamed:
            tail = entry.token_ids[streamed:]
            entry.sink(Chunk(id=entry.request_id, token_ids=tail,
                             logprobs=entry.logprobs[streamed:] if entry.logprobs is not None else None,
                             weight_version=entry.segment_version or 0))
        self.table.unbind(entry)
        if msg.finish_reason == _ABORT and entry.state is State.INTERRUPTED:
            if entry.remaining_tokens <= 0:
                self._complete(entry, _LENGTH)
            else:
                self._preempt(entry)
                self._pump()
            return
        self._complete(entry, msg.finish_reason)

    def _on_worker_error(self, handle: WorkerHandle, msg: Error) -> None:
        if handle.resolve(msg.id, None, (msg.code, msg.message)):
            return
        entry = self.table.by_inner(msg.id)
        if entry is None:
            self._drops.log("worker_error", logging.WARNING, "worker %s: error %s: %s",
                            handle.worker_id, msg.code, msg.message)
            return
        if self._foreign(handle, entry, msg):
            return
        self.router.on_finish(handle.worker_id)
        self.table.unbind(entry)
        from ..errors import from_code

        self._fail(entry, from_code(msg.code, f"worker {handle.worker_id}: {msg.message}", entry.request_id))

    def _preempt(self, entry: Entry) -> None:
        """Queue an interrupted request to continue, with its partial output, on some worker."""
        entry.num_preemptions += 1
        if entry.num_preemptions > self.config.max_resume_attempts:
            self._fail(entry, ResumeExhausted(
                f"request {entry.request_id!r} interrupted {entry.num_preemptions} times "
                f"(max_resume_attempts={self.config.max_resume_attempts})", request_id=entry.request_id))
            return
        self.counters["resumed"] += 1  # one per resume made, not per interruption
        entry.state = State.PENDING
        self._pending.appendleft(entry)  # it was running: it goes before new arrivals

    def _finish(self, entry: Entry) -> None:
        if entry.worker_id is not None and entry.inner_id is not None:
            self.router.on_finish(entry.worker_id)
        self.table.remove(entry)
        left = self._per_origin.get(entry.origin, 1) - 1
        if left > 0:
            self._per_origin[entry.origin] = left
        else:
            self._per_origin.pop(entry.origin, None)

    def _complete(self, entry: Entry, finish_reason: str) -> None:
        worker = entry.last_worker
        self._finish(entry)
        self.counters["aborted" if finish_reason == _ABORT else "completed"] += 1
        now = time.monotonic()
        timings = {"total": now - entry.t_created}
        if entry.t_dispatched is not None:
            timings["queue"] = entry.t_dispatched - entry.t_created
        if entry.t_first_token is not None:
            timings["first_token"] = entry.t_first_token - entry.t_created
        if entry.t_worker is not None:
            timings["worker"] = entry.t_worker
        logprobs = entry.logprobs
        if logprobs is None and entry.params.logprobs:
            logprobs = []  # asked for, and no token came: one per token, none
        # = Result(id=, token_ids=, finish_reason=, logprobs=, weight_versions=, num_preemptions=,
        #          worker=, timings=, weight_version_starts=), made without __init__'s per-field work
        entry.sink(_build_result(entry.request_id, entry.token_ids, finish_reason, logprobs, entry.versions,
                                 entry.num_preemptions, worker, timings, entry.version_starts))

    def _fail(self, entry: Entry, exc: RolloutError) -> None:
        self._finish(entry)
        self.counters["failed"] += 1
        entry.sink(Error(id=entry.request_id, code=exc.code, message=str(exc), request_id=entry.request_id))

    def abort(self, origin: str, request_id: str) -> bool:
        """Abort one request; its caller receives a result with finish_reason 'abort' and the
        tokens produced so far. Returns False if no such request is in flight."""
        entry = self.table.get(origin, request_id)
        if entry is None:
            return False
        if entry.inner_id is None or entry.worker_id is None:  # waiting, not on a worker
            entry.state = State.ABORTING
            self._complete(entry, _ABORT)
            return True
        entry.state = State.ABORTING
        self._abort_on_worker(entry)
        return True

    def abort_all(self, origin: str, session_id: str | None = None) -> list[str]:
        """Abort every request of ``origin`` in flight, or only those of ``session_id``; each
        ends as ``abort`` does. Returns their ids."""
        ids = [e.request_id for e in self.table
               if e.origin == origin and (session_id is None or e.session_id == session_id)]
        return [rid for rid in ids if self.abort(origin, rid)]

    def cancel(self, origin: str, request_id: str) -> None:
        """Forget a request whose caller went away, and stop it on its worker. Nothing is sent back."""
        entry = self.table.get(origin, request_id)
        if entry is None:
            return
        if entry.inner_id is not None and entry.worker_id is not None:
            self._abort_on_worker(entry)
        self._finish(entry)
        self.counters["cancelled"] += 1

    def _abort_on_worker(self, entry: Entry) -> None:
        handle = self.workers.get(entry.worker_id or "")
        if handle is None or entry.inner_id is None:
            return
        try:
            self._send_worker(handle, Abort(id=handle.next_call_id(), request_id=entry.inner_id))
        except zmq.ZMQError:
            pass  # the worker is going away; its death path finishes the entry

    # ================================================================== fleet operations
    def ready_workers(self) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.state is WorkerState.READY]

    async def control(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run a control op (sleep, wake_up, clear_kv_cache, start_profile, stop_profile, pause,
        resume) on every ready worker. Returns {worker id: reply data}.

        Raises Unsupported if a worker's engine lacks the op, InvalidRequest for unknown ops
        (code unknown_op) and bad args (bad_field: sleep's level 1 or 2, start_profile's
        trace_dir), WorkerLost / RequestTimeout / EngineFailed from a worker. Where some engine
        took a sleep, wake_up, pause or resume that failed on another (or one timed out: it
        still carries the op out), the fleet's state follows the op all the same, so that
        calling it again or its opposite puts every engine in one state. A
        caller that gives up (a timeout, a cancelled task) does not stop the op half-way: the
        fleet's sleep and pause state would then say what no engine was told.
        """
        task = asyncio.ensure_future(self._control(op, args))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, if nobody waits for it any more
        return await asyncio.shield(task)

    async def _control(self, op: str, args: dict[str, Any] | None) -> dict[str, Any]:
        self._check_open()
        if op not in CONTROL_OPS:
            raise InvalidRequest(f"unknown control op {op!r}; one of {', '.join(CONTROL_OPS)}", code="unknown_op")
        try:
            check_control_args(op, args or {})
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="bad_field") from None
        # Before the call (put back if no engine took it): tokens stop as soon as an engine obeys a
        # sleep or a pause; and a worker restarted meanwhile, being put to sleep or paused before
        # it serves (_hold_then_ready), is not among those this call reaches, so it must see a
        # wake_up or a resume now, not once every other worker has answered.
        held = self._sleep_level, self._engines_paused
        if op == "sleep":
            self._sleep_level = int((args or {}).get("level", 1))
        elif op == "pause":
            self._engines_paused = True
        elif op == "wake_up":
            self._sleep_level = 0
        elif op == "resume":
            self._engines_paused = False
        handles = self.ready_workers()
        results = await asyncio.gather(
            *(h.call(Control(id=h.next_call_id(), op=op, args=dict(args or {})), self.config.call_timeout_s)
              for h in handles),
            return_exceptions=True,
        )
        out: dict[str, Any] = {}
        lost: WorkerLost | None = None
        failed: list[tuple[WorkerHandle, BaseException]] = []
        for h, res in zip(handles, results):
            if isinstance(res, WorkerLost) and not h.alive:
                # It died during the call: its replacement is given the fleet's state before it
                # serves, so that state follows the op all the same.
                lost = lost or res
            elif isinstance(res, BaseException):
                failed.append((h, res))
            else:
                out[h.worker_id] = res
        if failed:
            h, res = failed[0]
            if isinstance(res, Unsupported):
                self._sleep_level, self._engines_paused = held
                raise Unsupported(f"{op} is not supported by the {h.engine} engine ({res})")
            # Where some engine took the op (those in ``out``, and a worker that did not answer
            # in time, which still carries it out when it gets to it), the fleet's state follows
            # the op: calling it again, or its opposite, then puts every engine in one state, and
            # a worker restarted meanwhile comes up as the others are. Put back, it would say
            # "awake" of engines asleep, a worker restarted would come up unlike them, and
            # stall_timeout_s would take paused engines for stuck ones.
            if not (out or any(isinstance(r, RequestTimeout) for _, r in failed)):
                self._sleep_level, self._engines_paused = held
                raise res
            if op in OPPOSITE_OPS:
                took = ", ".join(out) or "none yet"
                res.args = (f"{res}; {op} is in force all the same (workers that took it: {took}): call {op} "
                            f"again, or {OPPOSITE_OPS[op]}",)
                logger.warning("control %s failed on %d of %d workers (%s): %s in force all the same", op,
                               len(failed), len(handles), ", ".join(f.worker_id for f, _ in failed), op)
        if failed:
            raise failed[0][1]
        if lost is not None:
            if op in OPPOSITE_OPS:
                # Not put back: the dead worker's replacement is brought to the fleet's state.
                took = ", ".join(out) or "none"
                lost.args = (f"{lost}; {op} is in force all the same (workers that took it: {took}; a "
                             f"replacement comes up so)",)
            raise lost
        return out

    async def update_weights(self, named_tensors: Any, version: int, *, transport: str | None = None,
                             bucket_bytes: int | None = None, lora: dict[str, Any] | None = None) -> Any:
        """Push new weights to every ready worker and stamp them with ``version``.

        ``named_tensors`` is an iterable of (name, tensor), consumed lazily (a generator lets
        an FSDP trainer gather one parameter at a time), a mapping of name to tensor (a
        ``state_dict()``), or a callable returning either (then it is called again to bring
        restarted workers up to date, and to put back workers a failed update reached: it must
        yield every tensor of the model, not only those that changed). A name given twice is
        loaded twice, the last one winning; an empty update loads nothing and stamps the
        version. A tensor yielded must hold its values until the call returns: the next item
        is taken before the bucket that holds the last one is sent (a generator that refills
        one buffer for every tensor sends the later contents). Running requests are
        interrupted and, unless they asked for hard abort, resume afterwards with their
        partial output. Returns a weights.UpdateReport.

        With ``lora={'name': ..., 'config': {PEFT adapter config}}`` the tensors are a LoRA
        adapter's, loaded through the same buckets and used for later requests (vLLM with
        engine option enable_lora=True).

        ``version`` is any int in [0, 2**63) and is stamped as given: it need not grow (going
        back to an earlier checkpoint is allowed), though results can then no longer be told
        apart by it.

        Raises WeightUpdateError naming the cause and, when a worker failed, the worker; what
        a generator or callable yields that is not (str, tensor) pairs fails the same way, with
        no worker named (a list, tuple or mapping is checked whole first: ValueError).
        Generation then resumes on the previous version: a worker that had
        loaded part of the update is given the last good weights again (from the kept copy,
        ``FleetConfig.keep_last_weights``, or the callable), or, when these cannot cover what
        the update reached (the fleet's first update, a tensor no update sent before, or that
        option off with tensors that are not a callable), is restarted, which loads its
        initial weights (version 0) and then the kept ones; none serves a mix. So is, after a
        successful update, a worker that served its initial weights for want of a kept copy
        when the update did not send again every tensor earlier ones sent. Also
        raises Unsupported (e.g. LoRA on an engine without it), FleetClosed, and ValueError (a
        bad version, transport or bucket size, a module given instead of its tensors, a list,
        tuple or mapping holding anything but (str, tensor) pairs; before any request is
        interrupted).
        """
        self._check_open()
        return await self.weights.update(named_tensors, version, transport=transport, bucket_bytes=bucket_bytes,
                                         lora=lora)

    def training(self, level: int = 1) -> "_Training":
        """Hybrid mode: ``async with fleet.training(): <train step>`` puts the engines to sleep
        (freeing device memory for the trainer) and wakes them up afterwards, even on error.
        Blocks may nest or overlap (helpers that each wrap their part, several trainer tasks):
        the engines sleep when the first one opens, at its ``level``, and wake when the last
        one closes. Raises Unsupported when an engine cannot sleep."""
        return _Training(self, level)

    async def _enter_training(self, level: int) -> None:
        async with self._training_lock:
            if self._training_depth == 0:
                try:
                    await self.control("sleep", {"level": level})
                except RolloutError:
                    if self._sleep_level:
                        # Some went to sleep, and the block does not open: nothing would wake them.
                        await self.control("wake_up")
                    raise
            self._training_depth += 1

    async def _exit_training(self) -> None:
        async with self._training_lock:
            self._training_depth -= 1
            if self._training_depth == 0 and not self.closed:
                await self.control("wake_up")

    async def stats(self, engines: bool = True) -> dict[str, Any]:
        """Fleet statistics; with ``engines`` also each engine's own stats (one call per worker,
        waited for up to ENGINE_STATS_TIMEOUT_S: a hung worker's entry is then an error)."""
        workers = []
        engine_stats: dict[str, Any] = {}
        if engines and not self.closed:
            handles = self.ready_workers()
            wait = min(self.config.call_timeout_s, ENGINE_STATS_TIMEOUT_S)
            replies = await asyncio.gather(
                *(h.call(Stats(id=h.next_call_id()), wait) for h in handles),
                return_exceptions=True,
            )
            for h, rep in zip(handles, replies):
                engine_stats[h.worker_id] = rep.get("engine", {}) if isinstance(rep, dict) else {"error": repr(rep)}
                if isinstance(rep, dict) and type(rep.get("num_tokens")) is int:
                    # Fresher than the last heartbeat's (up to heartbeat_interval_s old).
                    h.num_tokens = max(h.num_tokens, rep["num_tokens"])
        for index, h in sorted(self.slots.items()):
            info = h.describe(self.router.load(h.worker_id), self._restarts[index].total)
            if not h.alive:
                info["state"] = WorkerState.DEAD.value
            if h.worker_id in engine_stats:
                info["engine_stats"] = engine_stats[h.worker_id]
            workers.append(info)
        return {
            "workers": workers,
            "num_workers": len(self.ready_workers()),
            "num_inflight": len(self.table),
            "num_pending": len(self._pending),
            "weight_version": self.weight_version,
            "sleep_level": self._sleep_level,
            "engines_paused": self._engines_paused,
            "mode": self.config.mode,
            "engine": self.config.engine,
            "host": socket.gethostname(),
            **{f"num_{k}": v for k, v in self.counters.items()},
            "num_leases": len(self._leases),
            "num_leases_expired": self._leases_expired,
            "dropped_frames": dict(self._drops.counts),
        }

    # ================================================================== frontend socket
    def _reply_client(self, identity: bytes, msg: Message) -> None:
        # (identity, header); to a client that takes batches, posted: what it gets in one
        # loop iteration goes out as one batch
        if identity in self._batch_clients:
            self._fsock.post(identity, codec.encode(msg))
            return
        try:
            self._fsock.send([identity, codec.encode(msg)])
        except zmq.ZMQError as exc:
            self._on_client_gone(identity, exc)

    def _on_client_gone(self, identity: bytes | None, exc: zmq.ZMQError) -> None:
        if identity is None:
            return
        if exc.errno != zmq.EAGAIN:  # disconnected: its requests run on (PROTOCOL.md 1)
            self._batch_clients.pop(identity, None)  # a new connection under its name says hello again
            logger.debug("client %s unreachable: %s", identity.hex(), exc)
            return
        # Connected but not reading: client_send_hwm messages wait for it. Stop making more. It
        # still takes batches, so what is dropped meanwhile goes (and is counted) a frame of up to
        # 32 answers at a time, as PROTOCOL.md 1 says.
        origin = identity.hex()
        stalled = [e.request_id for e in self.table if e.origin == origin]
        for request_id in stalled:
            self.cancel(origin, request_id)
        self._drops.log("slow_client", logging.WARNING,
                        "client %s stopped reading (%d messages wait for it); cancelled its %d requests",
                        origin, self.config.client_send_hwm, len(stalled))

    def _on_frontend_frames(self, frames: list[bytes]) -> None:
        # (identity, header, *buffers)
        if len(frames) < 2:
            # a ROUTER always prepends the identity; a lone frame is an empty message
            self._drops.log("client_empty", logging.WARNING, "dropped an empty message on the client socket")
            return
        identity = frames[0]
        if self._leases:
            lease = self._leases.get(identity)
            if lease is not None:  # any frame says the client is there, a bad one included
                lease[1] = time.monotonic() + lease[0]
        try:
            msg = codec.decode(frames[1:2], self._client_max_bytes, accept=CLIENT_TYPES)
        except codec.DecodeError as exc:
            self._drops.log("bad_client_frame", logging.WARNING, "bad client message from %s: %s", identity.hex(), exc)
            self._reply_client(identity, codec.error_for(exc))
            return
        # A batch is taken from any client (hello or not: one the fleet forgot, e.g. after a restart,
        # keeps working); batches go only to clients that said hello with batch.
        if type(msg) is not Batch:
            self._on_client_message(identity, msg)
        elif len(msg.messages) > MAX_CLIENT_BATCH:
            self._drops.log("client_batch_too_large", logging.WARNING, "refused a client batch of %d messages",
                            len(msg.messages))
            self._reply_client(identity, Error(id="", code="too_large",  # a batch's own id is ignored
                                               message=f"a batch of {len(msg.messages)} messages: a client's batch "
                                                       f"holds at most {MAX_CLIENT_BATCH}"))
        else:
            for item in codec.unbatch(msg, accept=CLIENT_TYPES):
                if isinstance(item, codec.DecodeError):  # answered like a bad frame; the others still run
                    self._drops.log("bad_client_frame", logging.WARNING, "bad client message in a batch from %s: %s",
                                    identity.hex(), item)
                    self._reply_client(identity, codec.error_for(item))
                else:
                    self._on_client_message(identity, item)

    def _on_client_message(self, identity: bytes, msg: Message) -> None:
        origin = identity.hex()
        if isinstance(msg, Generate):
            def sink(out: Message, identity: bytes = identity) -> None:
                self._reply_client(identity, out)
            try:
                self.submit(origin, msg.id, msg.prompt_ids, msg.sampling, sink,
                            stream=msg.stream, session_id=msg.session_id, resume=msg.resume, owned=True)
            except RolloutError as exc:
                self._reply_client(identity, Error(id=msg.id, code=exc.code, message=str(exc), request_id=msg.id))
        elif isinstance(msg, Abort):
            if self.abort(origin, msg.request_id):
                self._reply_client(identity, Reply(id=msg.id, data={"request_id": msg.request_id}))
            else:
                self._reply_client(identity, Error(id=msg.id, code="unknown_request", request_id=msg.request_id,
                                                   message=f"no request {msg.request_id!r} in flight"))
        elif isinstance(msg, AbortAll):
            self._reply_client(identity, Reply(id=msg.id, data={"request_ids": self.abort_all(origin, msg.session_id)}))
        elif isinstance(msg, (Stats, Control)):
            calls = self._client_calls.get(identity, 0)
            if calls >= MAX_CALLS_PER_CLIENT:
                self._reply_client(identity, Error(id=msg.id, code="overloaded", message=(
                    f"{calls} stats and control calls of this client are waiting for their answer; retry later")))
                return
            self._client_calls[identity] = calls + 1
            asyncio.create_task(self._answer_call(identity, msg))
        elif isinstance(msg, Hello):
            self._batch_clients.pop(identity, None)
            if msg.batch:
                self._batch_clients[identity] = None  # the newest last
                if len(self._batch_clients) > MAX_BATCH_CLIENTS:
                    del self._batch_clients[next(iter(self._batch_clients))]
            data: dict[str, Any] = {"batch": msg.batch, "max_message_bytes": self._client_max_bytes}
            self._leases.pop(identity, None)
            if msg.lease_s is not None:
                self._leases[identity] = [float(msg.lease_s), time.monotonic() + msg.lease_s]  # the newest last
                if len(self._leases) > MAX_LEASES:
                    del self._leases[next(iter(self._leases))]
                data["lease_s"] = float(msg.lease_s)  # (only then: a reply without it holds none)
            self._reply_client(identity, Reply(id=msg.id, data=data))
        else:
            self._reply_client(identity, Error(id=msg.id, code="unknown_type",
                                               message=f"clients may not send {msg.TYPE.value!r}"))

    async def _answer_call(self, identity: bytes, msg: Stats | Control) -> None:
        try:
            if isinstance(msg, Stats):
                data = await self.stats(engines=bool(msg.id))  # always true for real ids
            else:
                data = {"workers": await self.control(msg.op, msg.args)}
        except RolloutError as exc:
            answer: Message = Error(id=msg.id, code=exc.code, message=str(exc))
        except Exception as exc:
            logger.exception("client call failed")
            answer = Error(id=msg.id, code="internal", message=repr(exc))
        else:
            answer = Reply(id=msg.id, data=data)
        finally:
            calls = self._client_calls.pop(identity) - 1
            if calls:
                self._client_calls[identity] = calls
        self._reply_client(identity, answer)


class _Training:
    def __init__(self, supervisor: Supervisor, level: int):
        self.supervisor = supervisor
        self.level = level

    async def __aenter__(self) -> None:
        await self.supervisor._enter_training(self.level)

    async def __aexit__(self, *exc: Any) -> None:
        await self.supervisor._exit_training()
