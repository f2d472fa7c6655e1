"""RPC overhead: generate(max_tokens=1) on the echo engine through the fleet, against floors.

Measured side by side in one run, each between two processes over ipc://:

- ``raw``: the floor. A ROUTER here and a DEALER echo server in a child process, blocking
  pyzmq, msgpack maps of the same shape as a ``generate`` request and its ``result``.
  Latency one request at a time; throughput with ``--window`` requests in flight.
- ``raw uvloop``: the same exchange driven from uvloop through rollfleet's LoopSocket with
  a future per call: the event loop's share, before any supervisor or worker logic.
- ``fleet``: ``Supervisor`` + ``LLMClient`` (in-process client, one socket hop to the
  worker) with 1 and 4 echo workers, on uvloop as the CLI runs. Latency one call at a time;
  throughput with ``--window`` concurrent generate calls. With 1 worker the RemoteClient
  (one more hop, through the frontend socket; the client runs in this same process, so
  its socket work shares the supervisor's core) is timed one call at a time; and a RemoteClient
  in a process of its own, as an agent-loop process would hold one, floods the 1-worker fleet's
  frontend with ``--window`` calls in flight (its hello lets requests and answers go several to
  a frame). The frontend is the fleet's default, loopback ``tcp://``.
- ``ray``: sequential ``ray.get(actor.echo.remote(x))`` when ``ray`` is importable (the
  baseline many RL stacks use today; never a dependency of rollfleet).

    python bench/bench_rpc.py --quick --json bench/out/bench_rpc.json   # < 1 min on 2 cores
    python bench/bench_rpc.py --json bench/out/bench_rpc.json            # a few minutes
    python bench/bench_rpc.py --quick --prompt-len 4096             # per-token costs

Every path but Ray is set up first and then measured in turns (blocks of 100 calls, then rounds
of floods), so changes in the machine's state hit all of them alike: on a VM, one idle core's
wake-up latency alone moves the raw round trip between ~45 and ~130 us. Ray, when importable,
runs after them (its fleets closed by then), in the same process: ``num_ray_calls`` sequential
calls after 100 to warm up.

Goals (from the issue): fleet p50 within 1.5x of raw, fleet throughput at least half of raw
pipelined, and at least 10x Ray's sequential actor calls.

Keys: latencies are in microseconds over ``num_rtt_calls`` calls made one at a time per path; each
``..._seq_rps`` is 1e6 / the mean of those latencies (not a separately timed run):
``raw_rtt_p50_us``, ``raw_rtt_p99_us``, ``raw_seq_rps`` (blocking floor), ``raw_async_rtt_p50_us``,
``raw_async_rtt_p99_us``, ``raw_async_seq_rps`` (uvloop + LoopSocket), ``fleet_rtt_p50_us``,
``fleet_rtt_p99_us``, ``fleet_seq_rps`` (1 worker; no suffix), ``fleet_rtt_p50_us_4w``,
``fleet_rtt_p99_us_4w``, ``fleet_seq_rps_4w``, ``remote_rtt_p50_us``, ``remote_rtt_p99_us``,
``remote_seq_rps`` (RemoteClient, 1 worker). Requests/s with ``window`` in flight, the median of 3
floods: ``raw_pipelined_rps``, ``raw_async_pipelined_rps``, ``fleet_rps_1w``, ``fleet_rps_4w``,
``fleet_rps_best`` (the larger of the two fleet figures), ``remote_rps_1w`` (RemoteClient in a
process of its own, 1 worker), ``remote_client_us_per_req`` (that process's CPU per request);
``fleet_start_s_1w``, ``fleet_start_s_4w``
(Supervisor start-up, s). Ratios: ``fleet_vs_raw_p50`` (``fleet_rtt_p50_us`` / ``raw_rtt_p50_us``),
``fleet_vs_raw_rps`` (``fleet_rps_best`` / ``raw_pipelined_rps``), ``fleet_vs_raw_async_p50``,
``fleet_vs_raw_async_rps`` (the same over the uvloop path's figures), ``remote_vs_raw_rps``
(``remote_rps_1w`` / ``raw_pipelined_rps``), ``remote_vs_fleet_rps`` (``remote_rps_1w`` /
``fleet_rps_1w``: the frontend hop against the in-process client); goals: ``goal_p50_met``
(``fleet_vs_raw_p50`` <= 1.5), ``goal_rps_met`` (``fleet_vs_raw_rps`` >= 0.5). Ray: ``ray_measured``
(always written), then only when it is true: ``ray_sync_rps`` (calls / wall time of the sequential
loop), ``ray_sync_p50_us``, ``ray_sync_p99_us``, ``fleet_vs_ray_rps`` (``fleet_rps_best`` /
``ray_sync_rps``), ``goal_ray_met`` (``fleet_vs_ray_rps`` >= 10), ``num_ray_calls`` (500; full run
2000); when it is false, ``ray_not_measured_reason`` (why: --no-ray, the import error, or how Ray
failed to start). The run: ``quick``, ``window``,
``prompt_len``, ``num_rtt_calls`` (per path), ``num_tput_calls`` (per path, split over the 3
floods), ``elapsed_s``; and the machine facts ``machine_*`` of bench/common.py (``MACHINE_KEYS``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


from common import (bench_parser, machine_info, plot_cdfs_and_bars, png_path, print_table, run_loop, run_main,
                    STOP_SIGNALS, child_env, stop_signals, stopped_by, summarize, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

import msgpack
import zmq

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.engines.echo import echo_next_token
from rollfleet.transport import codec
from rollfleet.transport.aio import LoopSocket
from rollfleet.transport.messages import Generate, Result, SamplingParams

PROMPT = [1, 2]  # --prompt-len replaces it
PARAMS = SamplingParams(max_tokens=1)
# Wire maps of a real generate request and its result, so the raw and Ray paths move
# exactly the bytes the fleet moves (only the id and token change per call).
REQUEST = msgpack.unpackb(codec.encode(Generate(id="r", prompt_ids=PROMPT, sampling=PARAMS)))
REPLY = msgpack.unpackb(codec.encode(Result(
    id="r", token_ids=[0], finish_reason="length", weight_versions=[0], worker="w0",
    timings={"queue": 0.0, "first_token": 0.0, "total": 0.0})))
STOP = b"stop"
ROUNDS = 3  # throughput: the median of this many floods per path, taken in turns
BLOCK = 100  # latency: calls per path per turn


def echo_reply(req: dict) -> dict:
    prompt = req["prompt_ids"]
    return dict(REPLY, id=req["id"], token_ids=[echo_next_token(prompt[-1], len(prompt), 32000)])


# ============================================================================ raw floor
def serve_raw(addr: str) -> None:
    """Child process: answer each request map with a result map until told to stop, or until
    its parent is gone. It ignores stop signals: its parent waits on it in blocking calls, so
    it serves them to the end, and its parent stops it (STOP, or a kill) as it cleans up."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    sock.send(b"hello")
    while True:
        if not sock.poll(1000):
            if os.getppid() != parent:  # the parent was killed outright: nobody will stop us
                break
            continue
        raw = sock.recv()
        if raw == STOP:
            break
        sock.send(msgpack.packb(echo_reply(msgpack.unpackb(raw))))
    sock.close()
    ctx.term()


@contextlib.contextmanager
def raw_peer():
    """A ROUTER here and the echo server in a child process; yields (socket, server identity)."""
    tmp = tempfile.mkdtemp(prefix="rf-bench-")
    addr = f"ipc://{tmp}/raw.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-server", addr], env=child_env())
    try:
        deadline = time.monotonic() + 30
        while not sock.poll(200):  # in slices: a server that died (a stop signal) ends the wait
            if proc.poll() is not None:
                raise RuntimeError(f"raw echo server exited with status {proc.returncode} before it connected")
            if time.monotonic() > deadline:
                raise RuntimeError("raw echo server did not connect within 30 s")
        ident, _ = sock.recv_multipart()
        yield sock, ident
        if not sock.closed:  # else its user sent STOP through its own wrapper
            sock.send_multipart([ident, STOP])
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


class Path:
    """One way to make the call: ``one()`` makes a single call (None: throughput only);
    ``flood(n)`` makes n calls with the window in flight and returns requests/s (None:
    latency only)."""

    def __init__(self, name: str, one, flood=None):  # type: ignore[no-untyped-def]
        self.name, self.one, self.flood = name, one, flood


def lanes(one, window: int):  # type: ignore[no-untyped-def]
    """A flood function running ``window`` tasks that each call ``one()`` until n are done."""

    async def flood(n: int) -> float:
        left = n

        async def lane() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one()

        t = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(min(window, n))))
        return n / (time.perf_counter() - t)

    return flood


def raw_blocking(sock, ident: bytes, window: int) -> Path:  # type: ignore[no-untyped-def]
    """Blocking pyzmq: the least any Python RPC over ZeroMQ costs. It blocks the event loop
    while it runs, on purpose: nothing else may share its time."""
    ids = itertools.count()

    def send() -> None:
        # (identity, header)
        sock.send_multipart([ident, msgpack.packb(dict(REQUEST, id=f"b{next(ids)}"))])

    def recv() -> None:
        if msgpack.unpackb(sock.recv_multipart()[1])["type"] != "result":
            raise RuntimeError("raw echo server sent something else than a result")

    async def one() -> None:
        send()
        recv()

    async def flood(n: int) -> float:
        t0 = time.perf_counter()
        sent = 0
        while sent < min(window, n):
            send()
            sent += 1
        for _ in range(n):
            recv()
            if sent < n:
                send()
                sent += 1
        return n / (time.perf_counter() - t0)

    return Path("raw", one, flood)


def raw_uvloop(stack: contextlib.AsyncExitStack, sock, ident: bytes, window: int) -> Path:  # type: ignore[no-untyped-def]
    """The same exchange through rollfleet's LoopSocket, one future per call: what the
    event loop adds before any supervisor or worker logic."""
    waiting: dict[str, asyncio.Future] = {}

    def on_frames(frames: list) -> None:
        reply = msgpack.unpackb(frames[1])
        waiting.pop(reply["id"]).set_result(reply)

    lsock = LoopSocket(sock, on_frames)

    def close() -> None:
        lsock.send([ident, STOP])
        lsock.close()

    stack.callback(close)
    ids = itertools.count()
    loop = asyncio.get_running_loop()

    async def one() -> None:
        rid = f"a{next(ids)}"
        fut = waiting[rid] = loop.create_future()
        lsock.send([ident, msgpack.packb(dict(REQUEST, id=rid))])  # (identity, header)
        await fut

    return Path("raw_async", one, lanes(one, window))


async def fleet(stack: contextlib.AsyncExitStack, num_workers: int, window: int) -> tuple[list[Path], float]:
    """Supervisor + LLMClient on echo workers, and a RemoteClient through its frontend."""
    config = FleetConfig(engine="echo", num_workers=num_workers, engine_options={"tokens_per_s": 0})
    t0 = time.perf_counter()
    sup = await stack.enter_async_context(Supervisor(config))
    start_s = time.perf_counter() - t0
    client = sup.client()
    remote = await stack.enter_async_context(RemoteClient(sup.frontend_address))
    ids = itertools.count()

    async def one() -> None:
        result = await client.generate(f"f{num_workers}-{next(ids)}", PROMPT, PARAMS)
        if len(result.token_ids) != 1:
            raise RuntimeError(f"expected 1 token, got {result.token_ids}")

    async def one_remote() -> None:
        await remote.generate(f"r{num_workers}-{next(ids)}", PROMPT, PARAMS)

    in_process = Path(f"fleet_{num_workers}w", one, lanes(one, window))
    in_process.supervisor = sup  # type: ignore[attr-defined]
    return [in_process, Path(f"remote_{num_workers}w", one_remote)], start_s


async def remote_client_main(address: str, window: int) -> None:
    """The client process (``--remote-client``): a RemoteClient on ``address``. Says
    ``{"ready": true}`` once warm; then for each ``go N`` line on stdin floods N calls with
    ``window`` in flight and answers one JSON line (requests/s, CPU seconds); ends on ``exit``
    or end of input."""
    loop = asyncio.get_running_loop()
    async with RemoteClient(address) as remote:
        ids = itertools.count()

        async def one() -> None:
            result = await remote.generate(f"p{next(ids)}", PROMPT, PARAMS)
            if len(result.token_ids) != 1:
                raise RuntimeError(f"expected 1 token, got {result.token_ids}")

        flood = lanes(one, window)
        await flood(window * 4)
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if len(line) != 2 or line[0] != "go":
                return
            cpu = time.process_time()
            rps = await flood(int(line[1]))
            print(json.dumps({"rps": rps, "cpu_s": time.process_time() - cpu}), flush=True)


async def remote_process(stack: contextlib.AsyncExitStack, address: str, window: int) -> Path:
    """A RemoteClient in a child process flooding ``address``: throughput only. The child's
    CPU per request goes into ``client_cpu`` (a list of (calls, seconds))."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "--remote-client", address, "--window", str(window),
        "--prompt-len", str(len(PROMPT)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=child_env())

    async def stop() -> None:
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                proc.stdin.write(b"exit\n")
                proc.stdin.close()
            if stopped_by() is not None:  # stopping on a signal: do not wait for its flood to end
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()

    stack.push_async_callback(stop)
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    if not line.startswith(b"{"):
        raise RuntimeError(f"the RemoteClient process did not start (exit {await proc.wait()})")

    async def flood(n: int) -> float:
        proc.stdin.write(f"go {n}\n".encode())
        answer = json.loads(await asyncio.wait_for(proc.stdout.readline(), 300))
        path.client_cpu.append((n, answer["cpu_s"]))
        return answer["rps"]

    path = Path("remote_proc_1w", None, flood)
    path.client_cpu = []  # type: ignore[attr-defined]
    return path


async def measure(sizes: dict) -> dict:
    """Every path set up at once, then measured in turns (blocks of calls, round after round),
    so a change in the machine's state (other work, idle-state wake-ups) hits all alike."""
    window = sizes["window"]
    async with contextlib.AsyncExitStack() as stack:
        paths = [raw_blocking(*stack.enter_context(raw_peer()), window)]
        paths.append(raw_uvloop(stack, *stack.enter_context(raw_peer()), window))
        one_worker, start_1w = await fleet(stack, 1, window)
        four_workers, start_4w = await fleet(stack, 4, window)
        paths += one_worker + four_workers[:1]  # the frontend hop is timed with one worker
        sup_1w = one_worker[0].supervisor  # type: ignore[attr-defined]
        remote = await remote_process(stack, sup_1w.frontend_address, window)
        paths.append(remote)
        for path in paths:
            if path.one:
                for _ in range(sizes["warmup"]):
                    await path.one()
            if path.flood:
                await path.flood(sizes["warmup"] * 4)
        remote.client_cpu.clear()
        lat: dict[str, list[float]] = {p.name: [] for p in paths if p.one}
        for _ in range(sizes["rtt"] // BLOCK):
            for path in paths:
                if not path.one:
                    continue
                samples = lat[path.name]
                for _ in range(BLOCK):
                    t = time.perf_counter_ns()
                    await path.one()
                    samples.append((time.perf_counter_ns() - t) / 1e3)
        rps: dict[str, list[float]] = {p.name: [] for p in paths if p.flood}
        for _ in range(ROUNDS):
            for path in paths:
                if path.flood:
                    rps[path.name].append(await path.flood(sizes["tput"] // ROUNDS))
    out = {p.name: {"lat": lat.get(p.name), "rps": statistics.median(rps[p.name]) if p.name in rps else None}
           for p in paths}
    out["fleet_1w"]["start_s"], out["fleet_4w"]["start_s"] = start_1w, start_4w
    calls, seconds = map(sum, zip(*remote.client_cpu))
    out["remote_proc_1w"]["client_us_per_req"] = seconds / calls * 1e6
    return out



# ============================================================================ ray baseline
def bench_ray(n: int, warmup: int) -> dict | str:
    """Sequential actor calls; returns the measurement, or why Ray was skipped."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        import ray
    except ImportError as exc:
        return f"ray is not importable ({type(exc).__name__}: {exc})"
    # Short path: Ray puts unix sockets under it, and those have a ~100-byte path limit.
    tmp = tempfile.mkdtemp(prefix="rfray", dir="/tmp")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
                 logging_level=logging.WARNING)

        @ray.remote
        class Echo:
            def echo(self, req: dict) -> dict:
                return echo_reply(req)

        actor = Echo.remote()
        for i in range(warmup):
            ray.get(actor.echo.remote(dict(REQUEST, id=f"w{i}")))
        lat = []
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter_ns()
            ray.get(actor.echo.remote(dict(REQUEST, id=f"q{i}")))
            lat.append((time.perf_counter_ns() - t) / 1e3)
        return {"lat": lat, "rps": n / (time.perf_counter() - t0)}
    except Exception as exc:  # a Ray that cannot start here is a skipped baseline, not a failed bench
        return f"ray failed: {type(exc).__name__}: {exc}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# ============================================================================ report
def metrics(args: argparse.Namespace, sizes: dict, res: dict, ray: dict | str) -> dict:
    m: dict = {"quick": args.quick, "window": args.window, "prompt_len": args.prompt_len,
               "num_rtt_calls": sizes["rtt"], "num_tput_calls": sizes["tput"]}
    # (result name, metric prefix, suffix): the names for the 1-worker fleet have no suffix
    for name, prefix, suffix in (("raw", "raw", ""), ("raw_async", "raw_async", ""), ("fleet_1w", "fleet", ""),
                                 ("fleet_4w", "fleet", "_4w"), ("remote_1w", "remote", "")):
        stats = summarize(res[name]["lat"])
        m[f"{prefix}_rtt_p50_us{suffix}"] = stats["p50"]
        m[f"{prefix}_rtt_p99_us{suffix}"] = stats["p99"]
        m[f"{prefix}_seq_rps{suffix}"] = 1e6 / stats["mean"]
    m["raw_pipelined_rps"] = res["raw"]["rps"]
    m["raw_async_pipelined_rps"] = res["raw_async"]["rps"]
    m["fleet_rps_1w"], m["fleet_rps_4w"] = res["fleet_1w"]["rps"], res["fleet_4w"]["rps"]
    m["remote_rps_1w"] = res["remote_proc_1w"]["rps"]
    m["remote_client_us_per_req"] = res["remote_proc_1w"]["client_us_per_req"]
    m["fleet_start_s_1w"], m["fleet_start_s_4w"] = res["fleet_1w"]["start_s"], res["fleet_4w"]["start_s"]
    best = max(m["fleet_rps_1w"], m["fleet_rps_4w"])
    m["fleet_rps_best"] = best
    m["fleet_vs_raw_p50"] = m["fleet_rtt_p50_us"] / m["raw_rtt_p50_us"]
    m["fleet_vs_raw_rps"] = best / m["raw_pipelined_rps"]
    # Against the same exchange driven from uvloop: what the supervisor and worker logic add.
    m["fleet_vs_raw_async_p50"] = m["fleet_rtt_p50_us"] / m["raw_async_rtt_p50_us"]
    m["fleet_vs_raw_async_rps"] = best / m["raw_async_pipelined_rps"]
    m["remote_vs_raw_rps"] = m["remote_rps_1w"] / m["raw_pipelined_rps"]
    m["remote_vs_fleet_rps"] = m["remote_rps_1w"] / m["fleet_rps_1w"]
    m["goal_p50_met"] = m["fleet_vs_raw_p50"] <= 1.5
    m["goal_rps_met"] = m["fleet_vs_raw_rps"] >= 0.5
    m["ray_measured"] = isinstance(ray, dict)
    if not isinstance(ray, dict):
        m["ray_not_measured_reason"] = ray
    if isinstance(ray, dict):
        s_ray = summarize(ray["lat"])
        m.update(ray_sync_rps=ray["rps"], ray_sync_p50_us=s_ray["p50"], ray_sync_p99_us=s_ray["p99"],
                 fleet_vs_ray_rps=best / ray["rps"], num_ray_calls=len(ray["lat"]))
        m["goal_ray_met"] = m["fleet_vs_ray_rps"] >= 10
    return m


def report(m: dict, ray: dict | str) -> None:
    rows = [
        ("raw zmq+msgpack, blocking (floor)", "-", "raw_rtt", "raw_seq_rps", "raw_pipelined_rps"),
        ("raw zmq+msgpack, uvloop+LoopSocket", "-", "raw_async_rtt", "raw_async_seq_rps", "raw_async_pipelined_rps"),
        ("fleet LLMClient", 1, "fleet_rtt", "fleet_seq_rps", "fleet_rps_1w"),
        ("fleet LLMClient", 4, "fleet_rtt@4w", "fleet_seq_rps_4w", "fleet_rps_4w"),
        ("fleet RemoteClient, same process", 1, "remote_rtt", "remote_seq_rps", None),
        ("fleet RemoteClient, own process", 1, None, None, "remote_rps_1w"),
    ]
    if isinstance(ray, dict):
        rows.append(("ray actor, sequential ray.get", "-", "ray_sync", "ray_sync_rps", None))

    def lat(prefix: str, q: str) -> float:
        name, _, suffix = prefix.partition("@")
        return m[f"{name}_{q}_us" + (f"_{suffix}" if suffix else "")]

    table = [(name, w, lat(p, "p50") if p else None, lat(p, "p99") if p else None, m[seq] if seq else None,
              m[tput] if tput else None) for name, w, p, seq, tput in rows]
    if not isinstance(ray, dict):
        table.append((f"ray actor: {ray}", "-", None, None, None, None))
    print()
    print_table(["path", "workers", "p50 us", "p99 us", "1-at-a-time req/s", f"{m['window']} in flight req/s"],
                table, title=f"generate(max_tokens=1) on the echo engine; {m['machine_cores']} cores, "
                             f"{m['machine_cpu']}, load {m['machine_load_1m']}{' (quick)' if m['quick'] else ''}")
    print()
    goals = [
        ("fleet p50 / raw p50", m["fleet_vs_raw_p50"], "<= 1.5", m["goal_p50_met"]),
        ("best fleet req/s / raw pipelined", m["fleet_vs_raw_rps"], ">= 0.5", m["goal_rps_met"]),
    ]
    if isinstance(ray, dict):
        goals.append(("best fleet req/s / ray sequential", m["fleet_vs_ray_rps"], ">= 10", m["goal_ray_met"]))
    goals += [("fleet p50 / raw uvloop p50", m["fleet_vs_raw_async_p50"], "-", None),
              ("best fleet req/s / raw uvloop pipelined", m["fleet_vs_raw_async_rps"], "-", None),
              ("RemoteClient (own process) req/s / raw pipelined", m["remote_vs_raw_rps"], "-", None),
              ("RemoteClient (own process) req/s / LLMClient, 1 worker", m["remote_vs_fleet_rps"], "-", None)]
    print_table(["ratio", "value", "goal", "met"], goals)
    print(f"\n{m['elapsed_s']:.1f} s in all; fleet start {m['fleet_start_s_1w']:.2f} s (1 worker), "
          f"{m['fleet_start_s_4w']:.2f} s (4 workers); the RemoteClient process used "
          f"{m['remote_client_us_per_req']:.1f} us of CPU per request")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--window", type=int, default=256,
                        help="Requests in flight for throughput (default 256, with --quick too).")
    parser.add_argument("--prompt-len", type=int, default=2,
                        help="Prompt tokens per request (default 2: pure overhead; try 4096 to see per-token "
                             "costs).")
    parser.add_argument("--no-ray", action="store_true", help="Skip the Ray baseline even if importable.")
    parser.add_argument("--raw-server", metavar="ADDR", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--remote-client", metavar="ADDR", help=argparse.SUPPRESS)  # the child client
    args = parser.parse_args(argv)
    if args.raw_server:
        serve_raw(args.raw_server)
        return 0
    if args.window < 1 or args.prompt_len < 1:
        parser.error("--window and --prompt-len must be >= 1")
    global PROMPT, REQUEST
    PROMPT = [(7 * i + 1) % 32000 for i in range(args.prompt_len)]
    REQUEST = msgpack.unpackb(codec.encode(Generate(id="r", prompt_ids=PROMPT, sampling=PARAMS)))
    if args.remote_client:  # the child client: the same prompt as every other path
        run_loop(remote_client_main(args.remote_client, args.window))
        return 0
    if args.quick:
        sizes = {"rtt": 2000, "tput": 15_000, "warmup": 200, "ray": 500}
    else:
        sizes = {"rtt": 20_000, "tput": 150_000, "warmup": 1000, "ray": 2000}
    sizes["window"] = args.window

    t0 = time.perf_counter()
    machine = machine_info()  # before the run: the load average is other work, not ours
    res = run_loop(measure(sizes))
    ray = "skipped (--no-ray)" if args.no_ray else bench_ray(sizes["ray"], min(100, sizes["warmup"]))
    m = metrics(args, sizes, res, ray)
    m["elapsed_s"] = time.perf_counter() - t0
    m.update(machine)
    report(m, ray)

    if args.json:
        write_json(args.json, m)
        print(f"wrote {args.json}")
    png = png_path(args)
    if png:
        labels = {"raw": "raw blocking", "raw_async": "raw uvloop", "fleet_1w": "fleet 1w", "fleet_4w": "fleet 4w",
                  "remote_1w": "fleet remote 1w"}
        series = {label: res[name]["lat"] for name, label in labels.items()}
        bars = {label: res[name]["rps"] for name, label in labels.items() if res[name]["rps"]}
        bars["remote, own process 1w"] = res["remote_proc_1w"]["rps"]
        if isinstance(ray, dict):
            series["ray sync"] = ray["lat"]
            bars["ray sync"] = ray["rps"]
        if plot_cdfs_and_bars(png, series, bars, xlabel="round-trip latency (us, log)",
                              left_title="generate(max_tokens=1), one call at a time",
                              right_title=f"throughput, {args.window} in flight"):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
