"""Multi-node fleets the torchrun way: each node supervises its own workers.

The job's supervisor (one process, usually rank 0) serves workers on a tcp:// ROUTER with
CurveZMQ. Every other node runs a NodeAgent, which spawns, watches and restarts that
node's workers, as torchrun's agent does for trainer ranks. No extra service: the router's
address and server key, and each node's public key, go through a torch.distributed Store
that the job already has (the torchrun rendezvous store, or any TCPStore the nodes reach).

Keys under ``<prefix>/`` in the store:

- ``router``: JSON {address, server_key, engine, engine_options, heartbeat_interval_s, report_interval_s,
  max_message_bytes, fleet}, written by ``publish_router`` (``fleet``: a token new for each publication);
- ``nodes``: a counter; agent n writes ``node/<n>/name`` and ``node/<n>/public`` (its
  CurveZMQ public key, Z85) and waits for ``node/<n>/admitted``, which the publisher
  writes once the supervisor accepts that key. The publisher looks at every index taken
  whose key has not come yet, so an agent that died before writing its key keeps no later
  one out; a ``public`` that is not a CurveZMQ public key is refused and logged;
- ``closed``: set when the supervisor has shut down, to the ``fleet`` token of its ``router``;
  agents of that fleet then stop (a fleet published later under the same prefix has a token of
  its own, so the ``closed`` its predecessor left does not stop its agents);
- ``beat``: a counter the publisher adds to every second while the supervisor's process
  lives; an agent that sees it stand still for ``supervisor_timeout_s`` stops (a supervisor
  killed where the store outlives it, e.g. a store served by torchrun's agent).

Anyone who can write to the store can admit a key, so the store must be reachable only by
the job's own nodes, as torchrun's store already must be.

Run an agent with ``rollfleet node --store HOST:PORT --workers N`` (or ``python -m
rollfleet.actors.node``), or in-process: ``NodeAgent(store, num_workers=N).start()``. Under
torchrun every rank already shares the rendezvous store: after ``init_process_group``, rank 0
starts the Supervisor and
calls ``publish_router(dist.distributed_c10d._get_default_store(), sup)``, and local rank
0 of each other node starts a NodeAgent on that same store.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from ..cli import log_level
from ..engines import check_engine_options
from ..transport.sockets import bound_host, join_host_port, route_source, split_host_port
from .config import REPORT_INTERVAL_S, RestartPolicy
from .handle import RestartTracker
from .process import (WorkerProcess, claim_private_dir, device_env, remove_private_dir, sampling_seed, sweep_private_dirs,
                      sweep_stale_segments)
from .sentinel import Sentinel

__all__ = ["publish_router", "RouterPublication", "NodeAgent", "main", "add_arguments", "run", "DEFAULT_PREFIX"]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "rollfleet"
BEAT_INTERVAL_S = 1.0
AGENT_CHECK_S = 1.0  # how often an agent looks at the store (closed? the supervisor's beat?)


def reachable_address(address: str, host: str | None) -> str:
    """The worker address as other nodes must dial it: a wildcard bind gets a host name."""
    scheme, _, rest = address.partition("://")
    port = rest.rpartition(":")[2]
    if host is None and bound_host(address):
        return address
    return f"{scheme}://{join_host_port(host or socket.getfqdn(), port)}"


def wildcard_host(store: Any) -> str | None:
    """The host to publish a wildcard worker socket under when none is given: this host's address
    on the route to the store's host (a TCPStore's ``host``, else the job's ``MASTER_ADDR``), which
    every node reaches; None (this host's fully qualified name then) when neither is known or the
    route is a loopback one."""
    target = getattr(store, "host", None) or os.environ.get("MASTER_ADDR", "")
    return route_source(target) if target else None


class RouterPublication:
    """What ``publish_router`` leaves running: a thread that admits node keys as agents
    write them into the store, and marks the store closed when the supervisor shuts down."""

    def __init__(self, store: Any, supervisor: Any, prefix: str, poll_s: float, address: str = "", token: str = ""):
        self.store = store
        self.token = token  # the router's "fleet": what ``closed`` is set to
        self.supervisor = supervisor
        self.prefix = prefix
        self.poll_s = poll_s
        self.admitted: list[str] = []  # node names, in order of admission
        self.address = address  # the worker address published, as node agents dial it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rollfleet-node-keys", daemon=True)
        self._thread.start()
        supervisor.closing_hooks.append(self.close)

    def _watch(self) -> None:
        p = self.prefix
        seen = 0  # node indices below this are taken by agents (the store's "nodes" counter)
        waiting: set[int] = set()  # of those, the ones whose key is not in the store yet
        last_beat = 0.0
        while not self._stop.is_set():
            if self.supervisor.closed:
                self._mark_closed()
                return
            try:
                if time.monotonic() - last_beat >= BEAT_INTERVAL_S:
                    last_beat = time.monotonic()
                    self.store.add(f"{p}/beat", 1)
                # The store is used from this thread only, after publish_router returned.
                # Every index taken and not yet seen through is looked at, not only the next
                # one: an agent that died between taking its index and writing its key must
                # not keep the agents after it out.
                taken = int(self.store.add(f"{p}/nodes", 0))
                waiting.update(range(seen, taken))
                seen = max(seen, taken)
                for index in sorted(waiting):
                    if self.store.check([f"{p}/node/{index}/public"]):
                        waiting.discard(index)
                        self._admit(index)
            except Exception as exc:  # a store that went away ends the watch, not the job
                if not self._stop.is_set():
                    logger.error("node key watch stopped: %r", exc)
                return
            self._stop.wait(self.poll_s)

    def _admit(self, index: int) -> None:
        """Admit the key node ``index`` wrote, unless it is not a CurveZMQ public key (anyone
        who can write to the store can write anything there: it is refused and logged)."""
        p = self.prefix
        raw = self.store.get(f"{p}/node/{index}/public")
        # The agent writes its name first; an entry without one waits for nothing.
        name_key = f"{p}/node/{index}/name"
        name = self.store.get(name_key).decode("utf-8", "replace") if self.store.check([name_key]) else "?"
        if not is_public_key(raw):
            logger.error("node %d (%s) refused: its key is not a CurveZMQ public key (40 Z85 characters): %r",
                         index, name, raw[:80])
            return
        self.supervisor.allow_worker_key(raw.decode("ascii"))
        self.store.set(f"{p}/node/{index}/admitted", "1")
        self.admitted.append(name)
        logger.info("admitted node %s (%d)", name, index)

    def _mark_closed(self) -> None:
        try:
            self.store.set(f"{self.prefix}/closed", self.token or "1")
        except Exception:
            pass

    def close(self) -> None:
        """Stop admitting nodes and tell their agents the job is over (the supervisor calls
        this as its shutdown begins)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._mark_closed()


def is_public_key(raw: bytes) -> bool:
    """Whether ``raw`` is a CurveZMQ public key as ZeroMQ writes it: 40 Z85 characters."""
    from zmq.utils import z85

    try:
        return len(raw) == 40 and len(z85.decode(raw)) == 32
    except (KeyError, ValueError, TypeError):
        return False


def publish_router(store: Any, supervisor: Any, *, prefix: str = DEFAULT_PREFIX, host: str | None = None,
                   poll_s: float = 0.1) -> RouterPublication:
    """Put a started supervisor's worker address and server key into ``store`` for node
    agents, and admit the keys they publish. ``host`` replaces the bound host in the address
    (needed for a wildcard bind; default then: ``wildcard_host(store)``, else this host's
    fully qualified name).

    The supervisor needs ``accept_remote_workers=True`` (with its tcp:// worker_addr and
    curve_keys_dir). Call ``close()`` on the result, or just shut the supervisor down."""
    cfg = supervisor.config
    if not cfg.accept_remote_workers:
        raise ValueError("the supervisor does not accept remote workers (FleetConfig.accept_remote_workers)")
    if not supervisor.worker_address.startswith("tcp://") or supervisor._server_keys is None:
        raise RuntimeError("publish_router needs a started supervisor with a tcp:// worker socket and curve keys")
    if host is None and not bound_host(supervisor.worker_address):
        host = wildcard_host(store)
    info = {
        "address": reachable_address(supervisor.worker_address, host),
        "server_key": supervisor._server_keys[0].decode(),
        "engine": cfg.engine,
        "engine_options": cfg.engine_options,
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
        "report_interval_s": cfg.report_interval_s,
        "max_message_bytes": cfg.max_message_bytes,
        "fleet": secrets.token_hex(8),
    }
    if host:
        supervisor.advertised_host = host  # where those workers dial it: its collective updates' store too
    store.set(f"{prefix}/router", json.dumps(info))
    logger.info("published router %s under %r", info["address"], prefix)
    return RouterPublication(store, supervisor, prefix, poll_s, info["address"], info["fleet"])


class NodeAgent:
    """Spawns and supervises this node's workers for a fleet whose router is in ``store``.

    ``name`` is the node's name: workers register it as their host, so the supervisor sends
    them weights over the collective transport when it differs from its own host name
    (default: this host's name). Worker ids are ``<name>.<agent pid>/w<i>-<generation>``.
    ``engine``/``engine_options`` default to the fleet's. Workers die with the agent (their
    death pipe), and the agent stops when the store says the fleet closed or is gone, or
    when the supervisor's beat in the store stands still for ``supervisor_timeout_s``. Stopping,
    on its own or by ``shutdown()``, it stops its workers and removes its private directory
    before ``wait()`` returns True.
    """

    def __init__(self, store: Any, *, engine: str | None = None, engine_options: dict[str, Any] | None = None,
                 num_workers: int = 1, devices: list[str] | None = None, prefix: str = DEFAULT_PREFIX,
                 name: str | None = None, restart: RestartPolicy | None = None,
                 worker_env: dict[str, str] | None = None, private_dir_root: str | None = None,
                 supervisor_timeout_s: float = 30.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if devices is not None and len(devices) != num_workers:
            raise ValueError(f"devices has {len(devices)} entries for {num_workers} workers")
        if engine is not None:
            check_engine_options(engine, engine_options)
        name = name or socket.gethostname()
        if "/" in name or not name:
            raise ValueError(f"a node name must be non-empty and without '/', got {name!r}")
        self.store = store
        self.engine = engine
        self.engine_options = engine_options
        self.num_workers = num_workers
        self.devices = devices or ["cpu"] * num_workers
        self.prefix = prefix
        self.name = name
        self.node_id = f"{name}.{os.getpid()}"
        self.restart = RestartPolicy() if restart is None else restart
        self.worker_env = dict(worker_env or {})
        self.private_dir_root = private_dir_root
        self.supervisor_timeout_s = supervisor_timeout_s
        self.private_dir: str | None = None
        self._sentinel: Sentinel | None = None
        self.procs: dict[int, WorkerProcess] = {}
        self._trackers = {i: RestartTracker() for i in range(num_workers)}
        self._restart_at: dict[int, float] = {}  # slot -> when to respawn it
        self._router: dict[str, Any] = {}
        self._keys: tuple[bytes, bytes] | None = None
        self._done = threading.Event()  # asked to stop (by itself, shutdown(), a signal)
        self._stopped = threading.Event()  # stopped: workers gone, private dir removed
        self._signaled = False  # a signal asked it to stop (set by a handler: no lock taken there)
        self._grace_s = 5.0  # what the stop gives the workers to exit before they are killed
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()  # one stop at a time: a second waits for the first
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """What ended the agent's watch of its fleet, when that failed (it stopped its workers then)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Join the fleet: read the router, publish this node's key, wait for admission
        (each store read waits up to the store's timeout), spawn the workers. Returns without
        joining when the agent is stopped meanwhile. If it fails once it has spawned workers, it
        stops them and removes its private directory before the error goes on."""
        p = self.prefix
        router = self._get(f"{p}/router")
        if router is None:
            self._stopped.set()  # stopped before it joined: nothing to stop
            return
        self._router = json.loads(router)
        self._keys = zmq.curve_keypair()
        index = self.store.add(f"{p}/nodes", 1) - 1
        self.store.set(f"{p}/node/{index}/name", self.node_id)
        self.store.set(f"{p}/node/{index}/public", self._keys[0].decode())
        if self._get(f"{p}/node/{index}/admitted") is None:
            self._stopped.set()
            return
        self.private_dir = tempfile.mkdtemp(prefix="rollfleet-node-", dir=self.private_dir_root)
        try:
            os.chmod(self.private_dir, 0o700)
            # Owned as a supervisor's is: an agent killed with its workers (its process group sent
            # SIGKILL) leaves it to its sentinel, or, the sentinel killed too, to the next agent or
            # supervisor started beside it.
            claim_private_dir(self.private_dir)
            try:  # it cleans up if this process dies with no worker alive to do it (actors.sentinel)
                self._sentinel = Sentinel(self.private_dir)
            except OSError as exc:
                logger.warning("node %s: no sentinel process (%s)", self.node_id, exc)
            sweep_private_dirs(os.path.dirname(self.private_dir))
            sweep_stale_segments()
            with self._lock:
                for i in range(self.num_workers):
                    if self._stop_asked():
                        break  # the monitor, started below, stops those already spawned
                    self._spawn(i)
            thread = threading.Thread(target=self._monitor, name="rollfleet-node-agent", daemon=True)
            thread.start()
            self._thread = thread
        except BaseException:
            self._done.set()
            self._stop_workers(self._grace_s)
            raise
        logger.info("node %s joined %s with %d workers", self.node_id, self._router["address"], self.num_workers)

    def _get(self, key: str) -> bytes | None:
        """``store.get(key)``, waiting for the key in short polls, so that a stop (``shutdown()``,
        a signal to the command) ends the wait at once instead of after the store's timeout
        (minutes, while the supervisor starts); None once stopped. The store's timeout still
        bounds the wait."""
        timeout = getattr(self.store, "timeout", None)
        limit = timeout.total_seconds() if timeout is not None else 300.0
        deadline = time.monotonic() + limit
        while not self.store.check([key]):
            if self._done.wait(0.1) or self._signaled:
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"store key {key!r} not set within {limit:.0f}s")
        return self.store.get(key)

    def _stop_asked(self) -> bool:
        return self._done.is_set() or self._signaled

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the agent has stopped (fleet closed, store gone, the supervisor's beat
        standing still for supervisor_timeout_s, its watch failed (``error``), shutdown()) and
        with it its workers, its private directory removed; True if it did. An agent stopped
        before it joined has nothing to stop: True once start() returned."""
        return self._stopped.wait(timeout)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every worker (SIGTERM to its tree, then SIGKILL after ``grace_s``) and remove the
        private dir; what the agent does by itself when it stops on its own. Returns once that is
        done, by this call or by the agent."""
        self._grace_s = grace_s
        self._done.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=grace_s + 10)  # it stops the workers on its way out
        self._stop_workers(grace_s)  # waits for a stop still running in that thread

    def _stop_workers(self, grace_s: float) -> None:
        with self._stop_lock:
            try:
                with self._lock:
                    procs, self.procs = list(self.procs.values()), {}
                for proc in procs:
                    proc.terminate()
                deadline = time.monotonic() + grace_s
                while any(p.alive() for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.02)
                for proc in procs:
                    try:
                        proc.kill()
                        proc.close()
                    except Exception as exc:  # one stuck past its kill (a hung driver): the others still go
                        logger.warning("node %s: worker pid %s did not end: %r", self.node_id, proc.pid, exc)
            finally:
                if self.private_dir:
                    remove_private_dir(self.private_dir)
                sentinel, self._sentinel = self._sentinel, None
                if sentinel is not None:
                    sentinel.close()
                self._stopped.set()

    # ------------------------------------------------------------------ workers
    def _spawn(self, index: int) -> None:
        assert self._keys is not None and self.private_dir is not None
        router = self._router
        engine = self.engine or router["engine"]
        options = dict(router["engine_options"] if self.engine_options is None else self.engine_options)
        device = self.devices[index]
        options.setdefault("private_dir", self.private_dir)
        options.setdefault("device", "cuda" if device.startswith("cuda") else device.split(":")[0])
        worker_id = f"{self.node_id}/w{index}-{self._trackers[index].total}"
        options["sampling_seed"] = sampling_seed(options.get("sampling_seed", options.get("seed")), worker_id)
        env = dict(self.worker_env)
        env.update(device_env(device))
        self.procs[index] = WorkerProcess(
            worker_id,
            {
                "worker_id": worker_id,
                "addr": router["address"],
                "engine": engine,
                "engine_options": options,
                "device": device,
                "host": self.name,
                "node": self.node_id,  # a node agent's worker: tells the supervisor when it ends
                "heartbeat_interval_s": router["heartbeat_interval_s"],
                "report_interval_s": router.get("report_interval_s", REPORT_INTERVAL_S),
                "max_message_bytes": router["max_message_bytes"],
                "private_dir": self.private_dir,
                "weight_version": 0,  # the supervisor brings it to the fleet's version
                "curve_client_keys": [k.decode() for k in (*self._keys, router["server_key"].encode())],
                "log_level": logging.getLogger("rollfleet").getEffectiveLevel(),  # a number: 5 has no name
            },
            env,
            os.path.join(self.private_dir, f"w{index}.log"),
        )

    def _fleet_closed(self) -> bool:
        try:
            key = f"{self.prefix}/closed"
            if not self.store.check([key]):
                return False
            # This agent's fleet's, not one published before it under the same prefix.
            token = (self._router or {}).get("fleet")
            return not token or self.store.get(key).decode("utf-8", "replace") == token
        except Exception as exc:  # the job's store is gone: so is the job
            logger.warning("store unreachable (%r); stopping", exc)
            return True

    def _beat(self) -> int | None:
        try:
            return int(self.store.add(f"{self.prefix}/beat", 0))
        except Exception:
            return None  # _fleet_closed says whether the store is gone

    def _monitor(self) -> None:
        try:
            self._watch_fleet()
        except BaseException as exc:  # (a spawn that failed, say): the workers are stopped all the same
            self.error = exc
            logger.error("node %s: watching the fleet failed (%r); its workers stop", self.node_id, exc)
        finally:
            # However it stopped: the workers of a closed fleet exit on their own (its shutdown
            # message), those of a supervisor gone silent would not; the private dir goes too.
            self._done.set()
            self._stop_workers(self._grace_s)

    def _watch_fleet(self) -> None:
        last_check = 0.0
        beat, beat_seen = self._beat(), time.monotonic()
        while not self._done.wait(0.1):
            now = time.monotonic()
            if now - last_check > AGENT_CHECK_S:
                last_check = now
                if self._fleet_closed():
                    logger.info("fleet closed; node %s stops", self.node_id)
                    self._done.set()
                    return
                current = self._beat()
                if current != beat:
                    beat, beat_seen = current, now
                elif now - beat_seen > self.supervisor_timeout_s:
                    logger.warning("no beat from the supervisor for %.0fs; node %s stops", now - beat_seen,
                                   self.node_id)
                    self._done.set()
                    return
            with self._lock:
                self._reap_and_restart(now)

    def _reap_and_restart(self, now: float) -> None:
        for index, proc in list(self.procs.items()):
            if proc.alive():
                continue
            code = proc.returncode
            del self.procs[index]
            proc.close()
            if self._fleet_closed():
                return
            policy, tracker = self.restart, self._trackers[index]
            recent = tracker.recent(policy.window_s)
            if recent >= policy.max_restarts:
                logger.error("worker %s exited (%s) %d times in %.0fs; giving up on it",
                             proc.worker_id, code, recent + 1, policy.window_s)
                continue
            logger.warning("worker %s exited with code %s; restarting it", proc.worker_id, code)
            tracker.record()
            self._restart_at[index] = now + min(policy.backoff_s * (2**recent), policy.max_backoff_s)
        for index, when in list(self._restart_at.items()):
            if now >= when:
                del self._restart_at[index]
                self._spawn(index)


STORE_WAIT_WARNING_S = 10.0  # an agent still waiting for its store this long says so, once


def wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Wait until something accepts TCP connections at ``host:port``; raises ConnectionError
    after ``timeout_s``. Checked here first because torch's TCPStore, waiting for an address
    where nothing listens, writes a C++ trace to stderr at every retry."""
    deadline = time.monotonic() + timeout_s
    warned = False
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"nothing answers there after {timeout_s:g} s ({exc})") from None
            if not warned and time.monotonic() - started >= STORE_WAIT_WARNING_S:
                warned = True
                logger.warning("the store at %s:%d does not answer yet (%s); waiting up to %g s in all", host, port,
                               exc, timeout_s)
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def connect_store(address: str, timeout_s: float) -> Any:
    """A client of the TCPStore at ``host:port``, once that address answers (up to ``timeout_s``)."""
    import torch.distributed as dist

    parsed = split_host_port(address)
    if parsed is None:
        raise ValueError(f"--store must be HOST:PORT, got {address!r}")
    host, port = parsed
    wait_reachable(host, port, timeout_s)
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


class _Stopped(BaseException):
    """A signal came while the agent waited for its store."""


def _quiet_torch_cpp_logs() -> None:
    """Load torch with its C++ log level at FATAL in this process only (an agent's own torch
    does nothing but talk to the store): a store that goes away, as one does when its fleet ends,
    would otherwise print a C++ trace at every failed call, while the agent says so in one line.
    Its workers, started later, do not inherit the setting. A level the user set is kept."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, as torch loads
    try:
        import torch.distributed  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of a node agent (``rollfleet node``, ``python -m rollfleet.actors.node``)."""
    parser.description = "Run this node's rollfleet workers for a fleet on another host."
    parser.add_argument("--store", required=True,
                        help="HOST:PORT of the job's TCPStore (or of `rollfleet serve --store-bind`)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="key prefix the supervisor published under (default %(default)s, as "
                             "publish_router's default and `rollfleet serve --store-bind` use)")
    parser.add_argument("--workers", type=int, default=1, help="workers on this node (default 1)")
    parser.add_argument("--devices", default="", help="comma-separated device per worker (default: cpu)")
    parser.add_argument("--engine", default=None, help="engine (default: the fleet's)")
    parser.add_argument("--engine-options", default=None, help="JSON engine options (default: the fleet's)")
    parser.add_argument("--name", default=None,
                        help="this node's name, registered as the workers' host (default: the host name); "
                             "a name other than the supervisor's host makes weights go over the collective. "
                             "Worker ids are NAME.<agent pid>/w<i>-<generation>")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the store to answer, then for the router and admission "
                             "(default 300); a store that does not answer in time exits 1")
    parser.add_argument("--supervisor-timeout", type=float, default=30.0,
                        help="stop when the supervisor's beat in the store stands still this long (default 30)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run a node agent from parsed options until the fleet closes or a signal; returns the exit
    code (0 stopped, 1 the store could not be reached, the fleet could not be joined or watching
    it failed; bad options exit 2 through ``parser``)."""
    # Checked before the store is reached, which may take --timeout to fail.
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    for flag, value in (("--timeout", args.timeout), ("--supervisor-timeout", args.supervisor_timeout)):
        if not 0 < value < float("inf"):  # NaN included
            parser.error(f"{flag} must be a finite number > 0, got {value}")
    store = split_host_port(args.store)
    if store is None or store[1] == 0:
        parser.error(f"--store must be HOST:PORT with a port in 1..65535, got {args.store!r}")
    if args.name is not None and (not args.name.strip() or "/" in args.name):
        parser.error(f"--name must be non-empty and without '/' (leave it out for the host name), got {args.name!r}")
    try:
        options = json.loads(args.engine_options) if args.engine_options else None
    except json.JSONDecodeError as exc:
        parser.error(f"--engine-options is not JSON: {exc}")
    if options is not None and not isinstance(options, dict):
        parser.error("--engine-options must be a JSON object")
    if args.engine is not None:
        try:
            check_engine_options(args.engine, options)
        except ValueError as exc:
            parser.error(str(exc))
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] or None
    if devices is not None and len(devices) != args.workers:
        parser.error(f"--devices has {len(devices)} entries for {args.workers} workers (--workers)")

    def stop_waiting(*_: Any) -> None:
        raise _Stopped

    for sig in (signal.SIGTERM, signal.SIGINT):  # a signal while the store is awaited: stop, nothing started
        signal.signal(sig, stop_waiting)
    try:
        _quiet_torch_cpp_logs()
        store = connect_store(args.store, args.timeout)
        agent = NodeAgent(store, engine=args.engine, engine_options=options, num_workers=args.workers,
                          devices=devices, prefix=args.prefix, name=args.name,
                          supervisor_timeout_s=args.supervisor_timeout)
    except ValueError as exc:
        parser.error(str(exc))
    except _Stopped:
        return 0
    except Exception as exc:  # the store cannot be reached (torch's DistNetworkError, OSError, ...)
        print(f"rollfleet node: {args.store}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        # What the agent waits on: a signal also ends its wait for the router or for admission.
        signal.signal(sig, lambda *_: setattr(agent, "_signaled", True))  # no lock in a handler
    try:
        try:
            agent.start()
        except Exception as exc:  # what the store holds is not a router (ValueError), the store went away, ...
            print(f"rollfleet node: {args.store}: cannot join the fleet: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
            return 1
        while not agent.wait(0.2):
            if agent._signaled:
                agent._done.set()
        if agent.error is not None:
            print(f"rollfleet node: stopped: watching the fleet failed: {type(agent.error).__name__}: "
                  f"{str(agent.error).splitlines()[0] if str(agent.error) else ''}", file=sys.stderr)
            return 1
    finally:
        agent.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rollfleet.actors.node``: the same as ``rollfleet node``, logging at INFO by default."""
    from ..cli import OneLineParser

    parser = OneLineParser(prog="python -m rollfleet.actors.node")
    add_arguments(parser)
    parser.add_argument("--log-level", default=logging.INFO, type=log_level,
                        help="DEBUG, INFO, WARNING, ERROR, CRITICAL (any case) or a number (default INFO)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s node %(name)s: %(message)s")
    return run(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
