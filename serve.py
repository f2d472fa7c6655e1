"""``rollfleet serve``: run a fleet and serve its client socket until SIGINT, SIGTERM or SIGHUP.

Clients in any language connect a ZeroMQ DEALER socket to the printed address and speak
the protocol of PROTOCOL.md. A signal shuts the fleet down cleanly (workers stopped, the
private directory removed) and the command exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any

__all__ = ["add_arguments", "serve", "engine_options", "check_args"]

logger = logging.getLogger(__name__)

ENGINES = ("echo", "torch", "vllm", "sglang")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rollfleet serve`` to ``parser``."""
    from .actors.config import HEARTBEAT_INTERVAL_S, REPORT_INTERVAL_S, FleetConfig, RestartPolicy
    from .cli import at_least, positive_float  # numbers refused by the parser, naming the flag
    from .weights.config import WeightSyncConfig

    fleet = {f.name: f.default for f in dataclasses.fields(FleetConfig)}  # the defaults, said once
    restart = RestartPolicy()

    parser.description = (
        "Start a fleet of engine workers and serve its client-facing ZeroMQ ROUTER socket "
        "(protocol: PROTOCOL.md) until SIGINT, SIGTERM or SIGHUP (its terminal closed), then shut down cleanly "
        "and exit 0."
    )
    parser.add_argument("--engine", default="torch", choices=ENGINES,
                        help="Engine of every worker (default torch, which runs on CPU). echo generates "
                             "deterministic tokens without a model, for protocol and client tests.")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="Local model directory for torch, vllm and sglang. Default: the built-in tiny "
                             "random Llama (torch builds it in memory; for vllm and sglang it is written to "
                             "a temporary directory, removed on exit). Not used by echo.")
    parser.add_argument("--workers", type=at_least(1), default=1, metavar="N",
                        help="Number of engine worker processes (default 1).")
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help="Comma-separated device of each worker, e.g. cuda:0,cuda:1 (one per worker). "
                             "Default: cpu for every worker.")
    parser.add_argument("--bind", default="tcp://127.0.0.1:5555", metavar="ADDR",
                        help="Address of the client socket (default tcp://127.0.0.1:5555, loopback only). "
                             "Port 0 picks a free port; the bound address is printed. A non-loopback "
                             "address requires --keys-dir.")
    parser.add_argument("--keys-dir", default=None, metavar="DIR",
                        help="CurveZMQ keys made by `rollfleet keys DIR`: encrypts the client socket and "
                             "admits only the public keys in DIR/authorized/. Required to bind a "
                             "non-loopback address.")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="Option passed to the engine adapter; repeatable. VALUE is decoded as JSON "
                             "(8, 0.5, true, \"text\", [1,2]); a VALUE that is not JSON is taken as a string. "
                             "Example: --engine-option max_model_len=1024. An option the engine does not take is "
                             "refused with the list of those it does.")
    parser.add_argument("--tokens-per-s", type=float, default=None, metavar="RATE",
                        help="echo only: tokens per second per request (default: as fast as possible).")
    parser.add_argument("--ready-file", default=None, metavar="PATH",
                        help="Once the fleet is ready, write the bound client address to PATH (removed as "
                             "serve starts to shut down; if serve is killed outright, by its workers or its sentinel process). The address is "
                             "also printed as 'rollfleet serving on ADDR'.")
    parser.add_argument("--start-timeout", type=_seconds, default=120.0, metavar="SECONDS",
                        help="How long each worker may take to start its engine (default 120; inf: no "
                             "limit).")
    parser.add_argument("--report-interval", type=positive_float, default=REPORT_INTERVAL_S, metavar="SECONDS",
                        help="How often each worker reports the new tokens of its running requests that are "
                             "not streamed (default %(default)s). A request resumed after its worker died "
                             "starts from its last report; a shorter interval costs the supervisor more "
                             "CPU per running request.")
    parser.add_argument("--client-send-hwm", type=at_least(0), default=100_000, metavar="N",
                        help="Messages that may wait for one client; a client with more waiting (it stopped "
                             "reading, or reads more slowly than its answers come) loses its requests "
                             "(PROTOCOL.md section 1). 0: no limit (default 100000).")
    parser.add_argument("--store-bind", default=None, metavar="HOST:PORT",
                        help="Admit workers of other nodes: run a TCPStore at HOST:PORT (port 0 picks a free "
                             "one) and publish the worker socket in it; both are printed, before the client "
                             "address, as 'rollfleet store on HOST:PORT (workers ADDR)'. On each other node, `rollfleet node --store HOST:PORT --workers N` then "
                             "starts N workers that register with this fleet over CurveZMQ "
                             "(README, Several nodes). Requires --keys-dir. The store admits any node key "
                             "written to it: bind it only where the fleet's own nodes reach it.")
    parser.add_argument("--worker-bind", default=None, metavar="tcp://HOST:PORT",
                        help="With --store-bind: the worker socket that other nodes' workers dial (default "
                             "tcp://<the --store-bind host>:0, a free port). A wildcard host (0.0.0.0, *) is "
                             "published as --advertise-host.")
    parser.add_argument("--advertise-host", default=None, metavar="NAME",
                        help="With --store-bind: the host name other nodes dial for a wildcard --worker-bind "
                             "(default: this host's address on the route to the --store-bind host, else its fully "
                             "qualified name).")
    parser.add_argument("--stall-timeout", type=positive_float, default=None, metavar="SECONDS",
                        help="A running request that gets no token for this long, while its worker still "
                             "heartbeats, means a stuck engine: the worker is killed and restarted and its "
                             "requests resume (more than twice --report-interval; default: off).")
    parser.add_argument("--worker-nice", type=at_least(0, 19), default=0, metavar="N",
                        help="Niceness the workers add to serve's (0..19, default 0): a few points keep the "
                             "fleet's event loop from waiting behind CPU engines that share its cores.")
    parser.add_argument("--metrics-port", type=at_least(0, 65535), default=None, metavar="PORT",
                        help="Serve Prometheus metrics on 127.0.0.1:PORT (0: a free port), printed as "
                             "'rollfleet metrics on URL' before the client address; needs prometheus-client "
                             "(pip install 'rollfleet[metrics]'). Default: off.")
    parser.add_argument("--max-restarts", type=at_least(0), default=restart.max_restarts, metavar="N",
                        help=f"Restarts of one worker within {restart.window_s / 60:g} minutes, each after a delay "
                             f"that doubles from {restart.backoff_s:g} s up to {restart.max_backoff_s:g} s, before a "
                             "worker that dies again stays dead and its requests go to the others (default "
                             "%(default)s; 0: a worker that dies stays dead).")
    parser.add_argument("--heartbeat-timeout", type=positive_float, default=fleet["heartbeat_timeout_s"],
                        metavar="SECONDS",
                        help="A worker silent this long is taken as hung: it is killed and restarted and its "
                             f"requests resume (more than {HEARTBEAT_INTERVAL_S:g}, the interval of its heartbeats; "
                             f"default {fleet['heartbeat_timeout_s']:g}).")
    parser.add_argument("--call-timeout", type=positive_float, default=fleet["call_timeout_s"], metavar="SECONDS",
                        help="How long the fleet waits for a worker to carry out a control call (sleep, "
                             "wake_up, pause, resume, clear_kv_cache, profiling) before it answers timeout "
                             f"(default {fleet['call_timeout_s']:g}; a weight update's steps have their own "
                             f"{WeightSyncConfig().timeout_s:g} s). Raise it for engines slow to sleep or wake up.")
    parser.add_argument("--max-inflight-per-client", type=at_least(1), default=fleet["max_inflight_per_client"],
                        metavar="N",
                        help="Requests one client connection may have in flight; more are refused with "
                             "overloaded (PROTOCOL.md) (default %(default)s).")
    parser.add_argument("--max-client-message-bytes", type=at_least(1024, 1 << 30), default=64 << 20, metavar="N",
                        help="Largest message header (its first frame) a client may send; a larger one is "
                             "answered too_large (at least 1024, at most 1073741824 = 1 GiB, the socket's "
                             "limit, over which a client is dropped unanswered; default 67108864, 64 MiB).")


def _devices(args: argparse.Namespace) -> list[str] | None:
    """The device of each worker, from --devices (None: not given)."""
    return None if args.devices is None else [d.strip() for d in args.devices.split(",")]


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0, inf included (no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # NaN included
        raise argparse.ArgumentTypeError(f"must be a number > 0 (or inf), got {text}")
    return value


def _host_port(flag: str, text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) with a port in 0..65535; raises ValueError naming ``flag``."""
    from .transport.sockets import split_host_port

    parsed = split_host_port(text)
    if parsed is None:
        raise ValueError(f"{flag} {text}: expected HOST:PORT with a port in 0..65535")
    return parsed


def worker_bind(args: argparse.Namespace) -> str | None:
    """The worker socket's address with --store-bind (None without it)."""
    if args.store_bind is None:
        return None
    if args.worker_bind is not None:
        return args.worker_bind.strip()
    from .transport.sockets import join_host_port

    host, _ = _host_port("--store-bind", args.store_bind)
    return f"tcp://{join_host_port(host, 0)}"


def open_store(text: str) -> Any:
    """The TCPStore that serve runs for other nodes' agents, listening at HOST:PORT only (a
    TCPStore left to bind by itself listens on every interface, whatever host it is given)."""
    import datetime
    import socket

    import torch.distributed as dist

    host, port = _host_port("--store-bind", text)
    host = "0.0.0.0" if host == "*" else host
    family, kind, proto, _, address = socket.getaddrinfo(None if host == "0.0.0.0" else host, port,
                                                         type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
        store = dist.TCPStore(host, listener.getsockname()[1], None, True, datetime.timedelta(seconds=30),
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now and closes it when it is destroyed
    return store


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the command line asks for; raises ValueError on bad input."""
    options: dict[str, Any] = {}
    for item in args.engine_option:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    if args.tokens_per_s is not None:
        if args.engine != "echo":
            raise ValueError("--tokens-per-s applies to the echo engine only")
        if args.tokens_per_s < 0:
            raise ValueError("--tokens-per-s must be >= 0")
        options["tokens_per_s"] = args.tokens_per_s
    if args.model is not None:
        if args.engine == "echo":
            raise ValueError("the echo engine takes no --model")
        options["model"] = args.model
    return options


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before a fleet starts (a slow engine start is long to wait for a
    typo); raises ValueError with the message to print."""
    bind = args.bind.strip()
    scheme, sep, rest = bind.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        raise ValueError(f"--bind takes tcp://HOST:PORT or ipc://PATH, got {args.bind!r}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or port.isdigit() and int(port) <= 65535):
            raise ValueError(f"--bind {args.bind}: expected tcp://HOST:PORT with a port in 0..65535")
    store_bind = args.store_bind
    if store_bind is None:
        for flag, value in (("--worker-bind", args.worker_bind), ("--advertise-host", args.advertise_host)):
            if value is not None:
                raise ValueError(f"{flag} applies only with --store-bind (workers of other nodes)")
    else:
        _host_port("--store-bind", store_bind)
        if args.keys_dir is None:
            raise ValueError("--store-bind requires --keys-dir: other nodes' workers register over CurveZMQ")
        if args.worker_bind is not None:
            scheme, sep, rest = args.worker_bind.strip().partition("://")
            if scheme != "tcp" or not sep:
                raise ValueError(f"--worker-bind takes tcp://HOST:PORT, got {args.worker_bind!r}")
            _host_port("--worker-bind", rest)
        if args.advertise_host is not None and not args.advertise_host.strip():
            raise ValueError("--advertise-host: empty host name")
    from .actors.config import HEARTBEAT_INTERVAL_S

    if args.stall_timeout is not None and not args.stall_timeout > 2 * args.report_interval:
        raise ValueError(f"--stall-timeout {args.stall_timeout:g}: must be more than twice --report-interval "
                         f"({args.report_interval:g} s): tokens that are not streamed come once per report")
    if not args.heartbeat_timeout > HEARTBEAT_INTERVAL_S:
        raise ValueError(f"--heartbeat-timeout {args.heartbeat_timeout:g}: must be more than {HEARTBEAT_INTERVAL_S:g} s, "
                         "the interval of the workers' heartbeats")
    devices = _devices(args)
    if devices is not None:
        if not all(devices) or len(devices) != args.workers:
            raise ValueError(f"--devices {args.devices}: expected {args.workers} device(s), comma-separated, one per "
                             f"worker (--workers {args.workers})")
    for flag, value in (("--keys-dir", args.keys_dir), ("--model", args.model)):
        if value is not None and not os.path.isdir(value):
            raise ValueError(f"{flag} {value}: not a directory")
    if args.ready_file:
        parent = os.path.dirname(os.path.abspath(args.ready_file))
        if os.path.isdir(args.ready_file) or not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"--ready-file {args.ready_file}: cannot write a file there")


async def serve(args: argparse.Namespace) -> int:
    """Run the fleet until SIGINT/SIGTERM/SIGHUP. Returns the exit code: 0 after a signal,
    1 if the fleet failed to start or the --store-bind address could not be bound, 2 on bad options."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # First of all, so that a signal at any moment from here on (while the imports below run,
    # or a default model is written) still shuts down cleanly and exits 0. SIGHUP (its
    # terminal closed) stops it too, unless it was started ignoring it (nohup).
    # Signals reach the main thread only: run from another (embedded, a test), serve takes none.
    signals = () if threading.current_thread() is not threading.main_thread() else (signal.SIGINT, signal.SIGTERM) + (
        (signal.SIGHUP,) if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else ())
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    model_dir: str | None = None
    fleet = None
    store = None  # the TCPStore of --store-bind: lives until the fleet has shut down and marked it closed
    publication = None
    wrote_ready = False
    try:
        from .actors import FleetConfig, RestartPolicy, Supervisor
        from .actors.process import claim_private_dir
        from .engines import check_engine_options

        try:
            check_args(args)
            options = engine_options(args)
            check_engine_options(args.engine, options)  # before a model is built for it
            if args.engine in ("vllm", "sglang") and "model" not in options:
                from .engines.tiny import build_tiny_llama

                model_dir = tempfile.mkdtemp(prefix="rollfleet-serve-model-")
                # Owned like a private directory: if this process is killed before its fleet is up
                # (and can remove it with itself, below), the next fleet's sweep removes it.
                claim_private_dir(model_dir)
                options["model"] = build_tiny_llama(model_dir)
            config = FleetConfig(engine=args.engine, engine_options=options, num_workers=args.workers,
                                 devices=_devices(args), frontend_addr=args.bind, start_timeout_s=args.start_timeout,
                                 curve_keys_dir=args.keys_dir, client_send_hwm=args.client_send_hwm,
                                 report_interval_s=args.report_interval,
                                 max_client_message_bytes=args.max_client_message_bytes,
                                 worker_addr=worker_bind(args), accept_remote_workers=args.store_bind is not None,
                                 metrics_port=args.metrics_port, stall_timeout_s=args.stall_timeout,
                                 worker_nice=args.worker_nice, restart=RestartPolicy(max_restarts=args.max_restarts),
                                 heartbeat_timeout_s=args.heartbeat_timeout, call_timeout_s=args.call_timeout,
                                 max_inflight_per_client=args.max_inflight_per_client)
        except ValueError as exc:
            print(f"rollfleet serve: {exc}", file=sys.stderr)
            return 2
        await asyncio.sleep(0)  # let a signal that came meanwhile be seen before any worker starts
        if stop.is_set():
            return 0
        fleet = Supervisor(config)
        # Start while watching for a signal, so a signal during a slow engine start still
        # shuts down cleanly (start() tears the half-built fleet down when cancelled).
        starting = asyncio.create_task(fleet.start())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
        if stop.is_set():  # a signal before the fleet was up: no failure to report
            if not starting.cancelled():
                starting.exception()  # read, so that one the shutdown caused is not logged as lost
            return 0
        try:
            starting.result()
        except Exception as exc:  # WorkerStartError, a bad or busy --bind address (zmq), ...
            print(f"rollfleet serve: the fleet failed to start: {exc}", file=sys.stderr)
            return 1
        address = fleet.frontend_address or ""
        if args.store_bind is not None:
            from .actors.node import AGENT_CHECK_S, publish_router
            from .transport.sockets import join_host_port

            try:
                store = open_store(args.store_bind)
                publication = publish_router(store, fleet, host=args.advertise_host)
            except Exception as exc:  # the port taken, a host not of this machine, ...
                print(f"rollfleet serve: --store-bind {args.store_bind}: {exc}", file=sys.stderr)
                return 1
            store_host, _ = _host_port("--store-bind", args.store_bind)
            published = publication.address
            print(f"rollfleet store on {join_host_port(store_host, store.port)} (workers {published})", flush=True)
        if model_dir is not None:
            fleet.remove_with(model_dir)  # if this process is killed outright, its workers or sentinel remove it
        if args.ready_file:
            try:
                _write_atomic(args.ready_file, address + "\n")
                wrote_ready = True
                fleet.remove_with(args.ready_file)  # likewise: no ready file names a dead fleet
            except OSError as exc:
                print(f"rollfleet serve: --ready-file: {exc}", file=sys.stderr)
                return 1
        if fleet.metrics_address is not None:
            print(f"rollfleet metrics on {fleet.metrics_address}", flush=True)
        print(f"rollfleet serving on {address}", flush=True)
        logger.info("serving %d %s workers on %s", args.workers, args.engine, address)
        await stop.wait()
        logger.info("signal received; shutting down")
        return 0
    finally:
        if wrote_ready:  # first: it says the fleet serves, and a kill during the shutdown would leave it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.ready_file)
        if fleet is not None:
            await fleet.shutdown()
        if publication is not None and publication.admitted:
            # The store says the fleet closed: let the agents read that (they look every
            # AGENT_CHECK_S) and stop as asked, not find the store gone and warn of it.
            await asyncio.sleep(AGENT_CHECK_S + 0.5)
        del store
        for sig in signals:
            loop.remove_signal_handler(sig)
        _remove_dir(model_dir)


def _write_atomic(path: str, text: str) -> None:
    # A reader polling for the file never sees it half written.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
