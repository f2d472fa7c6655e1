"""The ``rollfleet`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["main"]


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # (only the import: an ImportError of the command itself is the command's)
        return asyncio.run(coro)
    return uvloop.run(coro)


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (and <= ``maximum`` if given; argparse exits 2
    with one line otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fleet_address(text: str) -> str:
    """An argparse type: the address of a fleet's client socket, tcp://HOST:PORT or ipc://PATH."""
    address = text.strip()
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc" and rest:
        return address
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if colon and host and port.isdigit() and 0 < int(port) <= 65535:
            return address
    raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT (a port in 1..65535) or ipc://PATH, got {text!r}")


def log_level(text: str) -> int:
    """An argparse type: a logging level by name (any case) or number."""
    name = text.strip().upper()
    if name.isdigit():
        return int(name)
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(f"not a logging level: {text!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL "
                                         "or a number)")
    return level


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .errors import RolloutError

    bad = None
    if args.model is not None and args.engine == "echo":
        bad = "the echo engine takes no --model"
    elif args.model is not None and not os.path.isdir(args.model):
        bad = f"--model {args.model}: not a directory"
    if bad is not None:  # as the parser says it
        print(f"rollfleet demo: error: {bad} (see rollfleet demo --help)", file=sys.stderr)
        return 2

    try:
        summary = _run(run_demo(engine=args.engine, num_workers=args.workers, num_requests=args.requests,
                                max_tokens=args.max_tokens, model=args.model, update_weights=not args.no_update))
    except KeyboardInterrupt:
        print("rollfleet demo: interrupted", file=sys.stderr)
        return 130
    except (RolloutError, ValueError, OSError) as exc:  # a fleet that cannot start, a bad model directory
        # One line; a worker that could not start adds the end of its output below it.
        print(f"rollfleet demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    # Exit 1 when a rollout or the weight update failed (the aborted request is the demo's own).
    return 0 if summary.get("failed") == "0" and summary.get("weight update") != "failed" else 1


def _nobody_serves(address: str) -> str | None:
    """Why no process can be serving an ``ipc://`` address (its socket file is missing, or no
    one listens on it), or None when one may (or the address is of another kind, or the probe
    cannot tell: a directory this user may not enter, say)."""
    import errno

    from .transport.sockets import ipc_probe

    return {errno.ENOENT: "no such socket file",
            errno.ECONNREFUSED: "a socket file no process serves"}.get(ipc_probe(address))


def _cmd_stats(args: argparse.Namespace) -> int:
    from .actors.client import RemoteClient

    if args.keys_dir is not None and not os.path.isdir(args.keys_dir):  # a bad option, as serve says it
        args.command_parser.error(f"--keys-dir {args.keys_dir}: not a directory (`rollfleet keys DIR` makes one)")

    nobody = _nobody_serves(args.address)
    if nobody is not None:  # no need to wait --timeout to know
        print(f"rollfleet stats: {args.address}: no fleet serves it ({nobody})", file=sys.stderr)
        return 1

    async def go() -> dict[str, Any]:
        keys = None
        if args.keys_dir:
            from .transport.auth import load_client_keys

            keys = load_client_keys(args.keys_dir)
        async with RemoteClient(args.address, call_timeout_s=args.timeout, curve_keys=keys) as client:
            client.keys_hint = "--keys-dir DIR"
            return await client.stats()

    import zmq

    from .errors import RolloutError

    try:
        stats = _run(go())
    except (RolloutError, zmq.ZMQError, OSError, ValueError) as exc:  # no fleet there, bad keys, a bad address
        print(f"rollfleet stats: {args.address}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    cols = ("worker_id", "host", "state", "pid", "device", "num_inflight", "num_tokens", "weight_version", "restarts",
            "last_error")
    rows = []
    for w in stats["workers"]:
        row = [str(w.get(c, "")) for c in cols]
        engine = w.get("engine_stats")
        if not row[-1] and isinstance(engine, dict) and list(engine) == ["error"]:
            row[-1] = f"no stats: {engine['error']}"  # its own stats did not come (a hung worker)
        rows.append(row)
    # Every column as wide as its longest cell (ids and hosts are never cut), but the last
    # error, which is free text, is cut to keep a row on one line.
    rows = [row[:-1] + [row[-1][:60]] for row in rows]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(widths[i]) for i, c in enumerate(cols)).rstrip())
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    print(f"in flight: {stats['num_inflight']} ({stats['num_pending']} pending)  completed: {stats['num_completed']}  "
          f"aborted: {stats['num_aborted']}  failed: {stats['num_failed']}  cancelled: {stats['num_cancelled']}  "
          f"resumed: {stats['num_resumed']}  weight version: {stats['weight_version']}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from .transport.auth import make_keys

    if os.path.exists(args.directory) and not os.path.isdir(args.directory):
        print(f"rollfleet keys: {args.directory} is not a directory", file=sys.stderr)
        return 1
    try:
        paths = make_keys(args.directory, overwrite=args.force)
    except FileExistsError as exc:
        print(f"rollfleet keys: {exc}; pass --force to replace them", file=sys.stderr)
        return 1
    except OSError as exc:  # not writable, a path that cannot be made
        print(f"rollfleet keys: {exc}", file=sys.stderr)
        return 1
    print(f"server keys: {paths['server_secret']} (keep private), {paths['server_public']} (give to clients)")
    print(f"client keys: {paths['client_secret']} (for one client), authorized public keys in {paths['authorized']}/")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serve import serve

    return _run(serve(args))


def _cmd_node(args: argparse.Namespace) -> int:
    from .actors.node import run

    return run(args, args.command_parser)


class OneLineParser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2 (the usage is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rollfleet", description="Run LLM rollout engines for RL training, without Ray.")
    parser.add_argument("--log-level", default=logging.WARNING, type=log_level,
                        help="Logging level of rollfleet's messages on stderr: DEBUG, INFO, WARNING, ERROR, "
                             "CRITICAL (any case) or a number (default WARNING).")
    sub = parser.add_subparsers(dest="command", required=True)

    demo_help = "Run a demo: a fleet, a batch of rollouts, an abort, a weight update, a summary."
    demo = sub.add_parser("demo", help=demo_help, description=demo_help)
    demo.add_argument("--engine", default="torch", choices=["torch", "vllm", "echo"],
                      help="Engine of the workers (default torch, on CPU; vllm needs the vllm extra).")
    demo.add_argument("--workers", type=at_least(1), default=2, help="Number of worker processes (default 2).")
    demo.add_argument("--requests", type=at_least(1), default=64, help="Number of rollouts (default 64).")
    demo.add_argument("--max-tokens", type=at_least(1), default=96, help="Tokens per rollout (default 96).")
    demo.add_argument("--model", default=None,
                      help="Local model directory for torch and vllm (default: a tiny built-in random Llama); "
                           "echo takes none.")
    demo.add_argument("--no-update", action="store_true", help="Skip the weight update in the middle of the batch.")
    demo.set_defaults(func=_cmd_demo, command_parser=demo)

    stats = sub.add_parser("stats", help="Print the stats of a running fleet (e.g. one started by `rollfleet serve`).",
                           description="Print the stats of a running fleet (e.g. one started by `rollfleet serve`): "
                                       "a table of its workers and a line of fleet counters, or with --json the "
                                       "whole stats map (PROTOCOL.md 6.5). Exit 1 when no answer comes within "
                                       "--timeout, at once for an ipc:// address that no process serves.")
    stats.add_argument("address", type=fleet_address,
                       help="The fleet's frontend address, e.g. tcp://127.0.0.1:5555 or ipc:///path/to/socket.")
    stats.add_argument("--json", action="store_true", help="Print the raw stats map as JSON.")
    stats.add_argument("--timeout", type=positive_float, default=10.0,
                       help="Seconds to wait for the answer (default 10).")
    stats.add_argument("--keys-dir", default=None, metavar="DIR",
                       help="CurveZMQ keys (from `rollfleet keys`) when the fleet requires them.")
    stats.set_defaults(func=_cmd_stats, command_parser=stats)

    keys = sub.add_parser("keys", help="Create CurveZMQ keys for a fleet reachable from other hosts.",
                          description="Create CurveZMQ keys for a fleet reachable from other hosts: the server's "
                                      "key pair, one client key pair, and authorized/ holding that client's public "
                                      "key (pass DIRECTORY to `rollfleet serve --keys-dir`).")
    keys.add_argument("directory", help="Where to write server.key(_secret), client.key(_secret) and authorized/: "
                                        "a directory of their own, created if missing and made private (mode 0700).")
    keys.add_argument("--force", action="store_true",
                      help="Replace keys already in DIRECTORY (clients given the old keys are then refused). "
                           "Default: refuse and exit 1.")
    keys.set_defaults(func=_cmd_keys, command_parser=keys)

    node_help = "Run this node's workers for a fleet on another host (rollfleet serve --store-bind, or a job's store)."
    node = sub.add_parser("node", help=node_help)
    from .actors.node import add_arguments as add_node_arguments

    add_node_arguments(node)
    node.set_defaults(func=_cmd_node, command_parser=node)

    try:
        from .serve import add_arguments
    except ImportError:
        add_arguments = None
    if add_arguments is not None:
        serve = sub.add_parser("serve", help="Run a fleet and serve its client socket until SIGINT/SIGTERM/SIGHUP.")
        add_arguments(serve)
        serve.set_defaults(func=_cmd_serve, command_parser=serve)
    return parser


COMMANDS = ("demo", "stats", "keys", "node", "serve")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 done, 1 failed, 2 bad options, 130
    interrupted by Ctrl-C before the command had its own handling of it)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (its imports, before serve installs its handlers; a stats call)
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), "")
        print(f"rollfleet{' ' + command if command in COMMANDS else ''}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command they were given to, so that its --help is the one named
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rollfleet").setLevel(args.log_level)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `rollfleet stats ADDR | head`: the reader left, nothing is wrong here
        # Python would report the pipe again as it flushes stdout at exit: point stdout elsewhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
