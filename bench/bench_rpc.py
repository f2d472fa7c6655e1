"""RPC overhead: generate(max_tokens=1) on the echo engine through the fleet, against floors.

Measured side by side in one run, each between two processes over ipc://:

- ``raw``: the floor. A ROUTER here and a DEALER echo server in a child process, blocking
  pyzmq, msgpack maps of the same shape as a ``generate`` request and its ``result``.
  Latency one request at a time; throughput with ``--window`` requests in flight.
- ``fleet``: ``Supervisor`` + ``LLMClient`` (in-process client, one socket hop to the
  worker) with 1 and 4 echo workers, on uvloop as the CLI runs. Latency one call at a time;
  throughput with ``--window`` concurrent generate calls. With 1 worker the RemoteClient
  (one more hop, through the frontend socket) is timed as well.
- ``ray``: sequential ``ray.get(actor.echo.remote(x))`` when ``ray`` is importable (the
  baseline many RL stacks use today; never a dependency of rollfleet).

    python bench/bench_rpc.py --quick --json out/rpc.json     # < 1 min on 2 cores
    python bench/bench_rpc.py --json out/rpc.json --png out/rpc.png

Goals (from the issue): fleet p50 within 1.5x of raw, fleet throughput at least half of raw
pipelined, and at least 10x Ray's sequential actor calls.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgpack
import zmq

from common import bench_parser, machine_info, png_path, print_table, summarize, write_json

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.engines.echo import echo_next_token
from rollfleet.transport import codec
from rollfleet.transport.messages import Generate, Result, SamplingParams

PROMPT = [1, 2]
PARAMS = SamplingParams(max_tokens=1)
# Wire maps of a real generate request and its result, so the raw and Ray paths move
# exactly the bytes the fleet moves (only the id and token change per call).
REQUEST = msgpack.unpackb(codec.encode(Generate(id="r", prompt_ids=PROMPT, sampling=PARAMS)))
REPLY = msgpack.unpackb(codec.encode(Result(
    id="r", token_ids=[0], finish_reason="length", weight_versions=[0], worker="w0",
    timings={"queue": 0.0, "first_token": 0.0, "total": 0.0})))
STOP = b"stop"


def echo_reply(req: dict) -> dict:
    prompt = req["prompt_ids"]
    return dict(REPLY, id=req["id"], token_ids=[echo_next_token(prompt[-1], len(prompt), 32000)])


# ============================================================================ raw floor
def serve_raw(addr: str) -> None:
    """Child process: answer each request map with a result map until told to stop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    sock.send(b"hello")
    while True:
        raw = sock.recv()
        if raw == STOP:
            break
        sock.send(msgpack.packb(echo_reply(msgpack.unpackb(raw))))
    sock.close()
    ctx.term()


def bench_raw(n_rtt: int, n_pipe: int, window: int, warmup: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="rf-bench-")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{tmp}/raw.sock")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-server", f"ipc://{tmp}/raw.sock"])
    try:
        if not sock.poll(30_000):
            raise RuntimeError("raw echo server did not connect within 30 s")
        ident, _ = sock.recv_multipart()
        ids = itertools.count()

        def send() -> None:
            # (identity, header)
            sock.send_multipart([ident, msgpack.packb(dict(REQUEST, id=f"q{next(ids)}"))])

        def recv() -> None:
            reply = msgpack.unpackb(sock.recv_multipart()[1])
            if reply["type"] != "result":
                raise RuntimeError(f"unexpected reply {reply!r}")

        for _ in range(warmup):
            send()
            recv()
        lat = []
        for _ in range(n_rtt):
            t0 = time.perf_counter_ns()
            send()
            recv()
            lat.append((time.perf_counter_ns() - t0) / 1e3)
        t0 = time.perf_counter()
        sent = 0
        while sent < min(window, n_pipe):
            send()
            sent += 1
        for _ in range(n_pipe):
            recv()
            if sent < n_pipe:
                send()
                sent += 1
        rps = n_pipe / (time.perf_counter() - t0)
        sock.send_multipart([ident, STOP])
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"lat": lat, "rps": rps}


# ============================================================================ fleet
async def bench_fleet(num_workers: int, n_rtt: int, n_tput: int, window: int, warmup: int,
                      remote: bool) -> dict:
    config = FleetConfig(engine="echo", num_workers=num_workers, engine_options={"tokens_per_s": 0},
                         frontend_addr="tcp://127.0.0.1:0" if remote else None)
    t0 = time.perf_counter()
    async with Supervisor(config) as sup:
        start_s = time.perf_counter() - t0
        client = sup.client()
        ids = itertools.count()

        async def one() -> None:
            result = await client.generate(f"q{next(ids)}", PROMPT, PARAMS)
            if len(result.token_ids) != 1:
                raise RuntimeError(f"expected 1 token, got {result.token_ids}")

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

        for _ in range(warmup):
            await one()
        await flood(warmup * 4)
        lat = []
        for _ in range(n_rtt):
            t = time.perf_counter_ns()
            await one()
            lat.append((time.perf_counter_ns() - t) / 1e3)
        rps = await flood(n_tput)
        out = {"lat": lat, "rps": rps, "start_s": start_s}
        if remote:
            async with RemoteClient(sup.frontend_address) as rc:
                for i in range(warmup):
                    await rc.generate(f"w{i}", PROMPT, PARAMS)
                rlat = []
                for i in range(n_rtt):
                    t = time.perf_counter_ns()
                    await rc.generate(f"x{i}", PROMPT, PARAMS)
                    rlat.append((time.perf_counter_ns() - t) / 1e3)
            out["remote_lat"] = rlat
    return out


async def bench_fleets(sizes: dict) -> dict:
    return {
        1: await bench_fleet(1, sizes["rtt"], sizes["tput"], sizes["window"], sizes["warmup"], remote=True),
        4: await bench_fleet(4, sizes["rtt"], sizes["tput"], sizes["window"], sizes["warmup"], remote=False),
    }


def run_loop(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:  # the fleet runs on plain asyncio too, only slower
        return asyncio.run(coro)
    return uvloop.run(coro)


# ============================================================================ ray baseline
def bench_ray(n: int, warmup: int) -> dict | str:
    """Sequential actor calls; returns the measurement, or why Ray was skipped."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        import ray
    except ImportError:
        return "ray is not importable"
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
def plot(path: str, series: dict, bars: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, lat in series.items():
        ordered = sorted(lat)
        left.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    left.set_xscale("log")
    left.set_xlabel("round-trip latency (us, log)")
    left.set_ylabel("fraction of calls")
    left.set_title("generate(max_tokens=1), one call at a time")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    names = list(bars)
    right.bar(names, [bars[n] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        right.text(i, bars[n], f"{bars[n]:,.0f}", ha="center", va="bottom")
    right.set_ylabel("requests / s")
    right.set_title("throughput")
    right.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--window", type=int, default=256, help="Requests in flight for throughput.")
    parser.add_argument("--no-ray", action="store_true", help="Skip the Ray baseline even if importable.")
    parser.add_argument("--raw-server", metavar="ADDR", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.raw_server:
        serve_raw(args.raw_server)
        return 0
    if args.window < 1:
        parser.error("--window must be >= 1")
    if args.quick:
        sizes = {"rtt": 2000, "tput": 10_000, "pipe": 20_000, "warmup": 200, "ray": 500}
    else:
        sizes = {"rtt": 20_000, "tput": 100_000, "pipe": 200_000, "warmup": 1000, "ray": 2000}
    sizes["window"] = args.window

    t_all = time.perf_counter()
    raw = bench_raw(sizes["rtt"], sizes["pipe"], args.window, sizes["warmup"])
    fleets = run_loop(bench_fleets(sizes))
    ray = "skipped (--no-ray)" if args.no_ray else bench_ray(sizes["ray"], min(100, sizes["warmup"]))

    s_raw, s1, s4 = summarize(raw["lat"]), summarize(fleets[1]["lat"]), summarize(fleets[4]["lat"])
    s_rem = summarize(fleets[1]["remote_lat"])
    m: dict = {
        "quick": args.quick, "window": args.window, "num_rtt_calls": sizes["rtt"],
        "raw_rtt_p50_us": s_raw["p50"], "raw_rtt_p99_us": s_raw["p99"], "raw_seq_rps": 1e6 / s_raw["mean"],
        "raw_pipelined_rps": raw["rps"],
        "fleet_rtt_p50_us": s1["p50"], "fleet_rtt_p99_us": s1["p99"], "fleet_seq_rps_1w": 1e6 / s1["mean"],
        "fleet_rtt_p50_us_4w": s4["p50"], "fleet_rtt_p99_us_4w": s4["p99"],
        "fleet_rps_1w": fleets[1]["rps"], "fleet_rps_4w": fleets[4]["rps"],
        "fleet_start_s_1w": fleets[1]["start_s"], "fleet_start_s_4w": fleets[4]["start_s"],
        "remote_rtt_p50_us": s_rem["p50"], "remote_rtt_p99_us": s_rem["p99"],
    }
    best = max(m["fleet_rps_1w"], m["fleet_rps_4w"])
    m["fleet_rps_best"] = best
    m["fleet_vs_raw_p50"] = m["fleet_rtt_p50_us"] / m["raw_rtt_p50_us"]
    m["fleet_vs_raw_rps"] = best / m["raw_pipelined_rps"]
    m["goal_p50_met"] = m["fleet_vs_raw_p50"] <= 1.5
    m["goal_rps_met"] = m["fleet_vs_raw_rps"] >= 0.5
    m["ray_measured"] = isinstance(ray, dict)
    if isinstance(ray, dict):
        s_ray = summarize(ray["lat"])
        m.update(ray_sync_rps=ray["rps"], ray_sync_p50_us=s_ray["p50"], ray_sync_p99_us=s_ray["p99"],
                 fleet_vs_ray_rps=best / ray["rps"])
        m["goal_ray_met"] = m["fleet_vs_ray_rps"] >= 10
    m["elapsed_s"] = time.perf_counter() - t_all
    m.update(machine_info())

    w = args.window
    rows = [
        ("raw zmq+msgpack (floor)", "-", s_raw["p50"], s_raw["p99"], m["raw_seq_rps"], raw["rps"]),
        ("fleet LLMClient", 1, s1["p50"], s1["p99"], m["fleet_seq_rps_1w"], m["fleet_rps_1w"]),
        ("fleet LLMClient", 4, s4["p50"], s4["p99"], 1e6 / s4["mean"], m["fleet_rps_4w"]),
        ("fleet RemoteClient", 1, s_rem["p50"], s_rem["p99"], 1e6 / s_rem["mean"], None),
    ]
    if isinstance(ray, dict):
        rows.append(("ray actor, sync ray.get", "-", m["ray_sync_p50_us"], m["ray_sync_p99_us"], ray["rps"], None))
    else:
        rows.append((f"ray actor: {ray}", "-", None, None, None, None))
    print()
    print_table(["path", "workers", "p50 us", "p99 us", "seq req/s", f"req/s ({w} in flight)"], rows,
                title=f"generate(max_tokens=1), echo engine, {m['machine_cores']} cores, {m['machine_cpu']}"
                      f"{' (quick)' if args.quick else ''}")
    print()
    goals = [
        ("fleet p50 / raw p50", m["fleet_vs_raw_p50"], "<= 1.5", m["goal_p50_met"]),
        ("best fleet req/s / raw pipelined", m["fleet_vs_raw_rps"], ">= 0.5", m["goal_rps_met"]),
    ]
    if isinstance(ray, dict):
        goals.append(("best fleet req/s / ray sync", m["fleet_vs_ray_rps"], ">= 10", m["goal_ray_met"]))
    print_table(["ratio", "value", "goal", "met"], goals)
    print(f"\n{m['elapsed_s']:.1f} s in all; fleet start {m['fleet_start_s_1w']:.2f} s (1 worker), "
          f"{m['fleet_start_s_4w']:.2f} s (4 workers)")

    if args.json:
        write_json(args.json, m)
        print(f"wrote {args.json}")
    png = png_path(args)
    if png:
        series = {"raw": raw["lat"], "fleet 1w": fleets[1]["lat"], "fleet 4w": fleets[4]["lat"],
                  "fleet remote 1w": fleets[1]["remote_lat"]}
        bars = {"raw pipelined": raw["rps"], "fleet 1w": m["fleet_rps_1w"], "fleet 4w": m["fleet_rps_4w"]}
        if isinstance(ray, dict):
            series["ray sync"] = ray["lat"]
            bars["ray sync"] = ray["rps"]
        plot(png, series, bars)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
