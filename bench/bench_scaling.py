"""Scaling of the echo fleet: requests/s and p99 latency against the number of workers, weight
transfer GB/s against the number of receiving workers, and where the CPU time goes.

For each fleet size (1, 2, 4, 8, 16 workers; ``--quick``: shorter runs) one
Supervisor with echo workers (no model: every microsecond is rollfleet's) takes:

- a flood of ``generate(max_tokens=1)`` calls with ``--window`` in flight: requests/s, and the
  p50/p99 latency of those calls under that load;
- calls one at a time: the unloaded p50/p99 (routing among more workers must not cost more);
- the same number of requests as ``generate_batch`` calls of window / 2 prompts, two at a time,
  as a rollout step submits its prompts: requests/s and the loop's CPU.

During each flood the CPU time of the supervisor process (with the in-process client that
drives it, as in a training job), of its event-loop thread alone, of the worker processes and
of the whole machine is read with psutil. The event loop is one thread: when it is busy close
to 100% of a core, the supervisor is the bottleneck; when every core of the machine is busy and
the loop is not, the machine is (more workers only share the same cores); when neither is, but
the loop thread spent a tenth of the time or more ready to run with no core free (Linux
schedstat), the machine's cores are still what holds it back, in bursts.

Engine-paced: the same fleet sizes with each echo worker standing in for a real engine: at most
``--paced-running`` requests at once (its batch), ``--paced-tokens-per-s`` tokens/s each, made
8 at a time, requests of ``--paced-tokens`` tokens, with exactly a full batch per worker in flight.
The engines are then the limit by construction; what counts is whether the fleet delivers
their capacity as workers are added (``paced_vs_capacity``), and what that costs the loop. Each
result says how long it spent on its worker (``timings["worker"]``): a call's latency less that is
the fleet's share (sockets, the supervisor, the client, and any wait for a core).

Engine-paced, queued: in each round, after each paced fleet's flood, the same fleet with
``PACED_QUEUED`` (2) full batches per worker in flight, one running and one waiting on the
engine, as a rollout step submits more prompts than its engines have slots: 2 x max(2,
``--paced-batches``) rounds of every worker's batch, its rate taken from the first round's
middle to the last round's (the median end of each round's calls: the time the first dispatches
took drops out). A request then waits on its engine, not on the supervisor, while the loop works
through a round of results: what is measured is whether the supervisor still costs the engines
any of their capacity.

Running: long requests that all stay running (as a rollout's do for most of their time on an
engine), so that the loop's only work is to keep track of them. ``--running-workers`` paced echo
workers run ``--running-per-worker`` requests each at 50 tokens/s, 5 at a time (an engine step
every 0.1 s), none finishing while measured; the workers report their new tokens every
``report_interval_s``, a request at most once per step. One fleet per
interval of ``--running-intervals`` (default 0.05 and the fleet's default, 0.5), measured in turns.
What the loop spends per running request per report sets how many running requests one loop
can keep track of at an interval.

Ranks: the fleet size of 2 or more whose loop was busiest (``--ranks-workers`` to choose) run again
as K ranks of a job (``--ranks``, default 1, 2, 4; ``--quick`` 1, 2; those that divide the workers
evenly): K processes, each with a supervisor of
its own over workers / K of the workers and its own in-process flood of window / K in flight,
as examples/torchrun_rl.py runs a fleet per rank. Same workers and requests in flight in all;
the supervisor's work is spread over K loops. Requests/s is every rank's calls over the time
until the last rank finished; each round makes at least 20,000 calls in all.

Paced ranks: the largest engine-paced fleet again as K ranks (the ``--ranks`` that divide it, when
two or more do), each a process with a fleet of its own of workers / K paced workers and a full
batch of each in flight: the same engines and requests, each round of results shared out over K
loops instead of worked through by one. In turns, like the ranks: 3 rounds, each of
``--paced-batches`` full batches per rank.

Clients: the same fleet size as one fleet fed through its frontend by K client processes
(``--clients``, default 1, 2, 4; ``--quick`` 1, 2), each a RemoteClient with window / K in flight,
as agent-loop processes would share one fleet: the supervisor's loop routes every request and
runs no client, so its CPU per request is the supervisor's own. Rounds as for the ranks; in each,
after the client layouts, the baseline: the same fleet flooded by its in-process client with the
whole window in flight (the loop then runs that client too).

Weight transfer: ``update_weights`` with the same tensors (``--weights-mb``, bf16) to 1, 2 and 4
echo workers; the echo engine accepts any tensor, so this times the transport (bucketing, shm,
the workers' acknowledgements), not a model's copy. ``keep_last_weights`` is off so that the
supervisor's CPU copy for restarted workers is not timed. Each receiver count and a plain
memcpy of the same bytes (at one thread and at torch's default thread count, as bench_weights.py
times it) are timed in turns after a warm-up; the best of 6 (full: 9) of each counts.

    python bench/bench_scaling.py --quick --json bench/out/bench_scaling.json   # 1-3 min on 2 cores
    python bench/bench_scaling.py --json bench/out/bench_scaling.json           # a few minutes

Rates and CPU: every req/s figure is the median of the rounds' rates (each round: its calls / its
wall time); every figure in cores is the CPU seconds of all rounds / their wall seconds; every us
per request figure (the keys with ``us_per_req``) is the CPU seconds of all rounds / the calls of
all rounds. So a us-per-request figure is cores / (all calls / all wall time), the rounds' rate
weighted by their time, and equals cores / req/s only when the rounds ran at one rate: a slower
round (a first one, other work on the machine) lowers the weighted rate and not the median, and
the table's cores / req/s then reads less than its us/req. The loop's CPU is its thread's own clock
(exact); the workers' CPU (``workers_cpu_{n}w``, ``workers_us_per_req_{n}w``,
``paced_workers_cpu_{n}w``, ``running_workers_cpu_{ms}ms``, ``weights_workers_cpu_{k}w``) is read
from /proc, which counts 10 ms ticks per process: each reading can be 10 ms off per worker, so
with ``--quick``'s short floods (2,000 calls a round, a tenth of a second or so) the workers'
per-request CPU moves in steps of about 10 ms x workers / calls (5 us per worker at 2,000 calls)
and is a rough figure there.

Keys: ``rps_{n}w``, ``p50_us_{n}w``, ``p99_us_{n}w`` (under load), ``seq_p50_us_{n}w``,
``seq_p99_us_{n}w``, ``supervisor_cpu_{n}w`` (cores used by the supervisor process),
``supervisor_loop_cpu_{n}w`` (its event-loop thread, 1.0 = one core saturated),
``supervisor_loop_wait_{n}w`` (how long, per wall second, that thread was ready to run and waited
for a core: Linux schedstat, written where the kernel keeps it), ``workers_cpu_{n}w``,
``machine_busy_{n}w`` (cores busy machine-wide),
``supervisor_cpu_share_{n}w`` (supervisor / (supervisor + workers)), ``bottleneck_{n}w``,
``supervisor_us_per_req_{n}w``, ``loop_us_per_req_{n}w``, ``workers_us_per_req_{n}w`` (CPU per
request, all rounds: see above), ``loop_ceiling_rps_{n}w`` (what the loop could carry on a core of its own),
``start_s_{n}w`` (fleet start-up); ``batch_rps_{n}w``, ``batch_loop_cpu_{n}w``,
``batch_loop_us_per_req_{n}w``, ``batch_bottleneck_{n}w`` (the generate_batch floods),
``batch_loop_cpu_max``; ``gbps_{k}w`` (model bytes per second of update),
``update_s_{k}w``, ``weights_supervisor_cpu_{k}w``, ``weights_workers_cpu_{k}w``,
``memcpy_gbps`` (the best copy of the same bytes, at one thread or torch's default, for
scale), ``rps_scaling_max`` (rps at the largest fleet / rps at the smallest: one worker unless
``--workers`` leaves it out),
``p99_scaling_max`` (the same for p99 under load), ``gbps_scaling_max`` (GB/s to the most
receivers / to the fewest),
``supervisor_loop_cpu_max`` (the busiest loop of the single-call floods ``rps_{n}w`` only),
``no_model_loop_cpu_max`` (the busiest loop of every no-model flood: single calls, generate_batch
calls, ranks, client processes and their in-process baseline; the goal's figure) and
``no_model_loop_cpu_max_run`` (which flood that was), ``bottleneck`` (at the largest fleet),
``max_workers``, ``max_receivers``; the run: ``window``, ``num_tput_calls``, ``weights_mb``,
``bucket_mb``, ``quick``, ``elapsed_s``; engine-paced: ``paced_rps_{n}w``,
``paced_capacity_rps_{n}w``, ``paced_vs_capacity_{n}w``, ``paced_p50_ms_{n}w``, ``paced_p99_ms_{n}w``,
``paced_loop_cpu_{n}w``, ``paced_workers_cpu_{n}w``, ``paced_machine_busy_{n}w``,
``paced_loop_us_per_req_{n}w``, ``paced_bottleneck_{n}w``, ``paced_worker_p50_ms_{n}w`` (a request's
time on its worker, as its result's timings say), ``paced_outside_p50_ms_{n}w``,
``paced_outside_p99_ms_{n}w``, ``paced_outside_mean_ms_{n}w`` (its latency less that: the fleet's
share; a lane's cycle is its time on the worker plus this, so the mean sets the rate),
``paced_caller_wait_ms_{n}w`` (mean: a call's latency less its result's ``timings["total"]``, the
time from its arrival at the supervisor to its result: how long a finished request waited for
its caller to run on the loop), ``paced_loop_round_ms_{n}w`` (the loop's CPU per round of every
request in flight, ``paced_loop_us_per_req_{n}w`` x workers x ``--paced-running``: all it did
meanwhile, results, new requests, progress reports and heartbeats; the most that results of a
round which finish together can queue for, one after the other), ``paced_loop_wait_{n}w``
(as ``supervisor_loop_wait_{n}w``), ``paced_rps_scaling_max``,
``paced_vs_capacity_min``, ``paced_loop_cpu_max`` (the busiest loop of every engine-paced flood: a
batch per worker, two, and the paced ranks), ``paced_loop_cpu_max_run`` (which flood that was),
``paced_bottleneck``,
``paced_loop_ceiling_workers`` (workers of this kind one loop could feed); queued:
``paced_queued_rps_{n}w`` (from the first round's middle to the last's; the median of the rounds),
``paced_queued_vs_capacity_{n}w``, ``paced_queued_loop_cpu_{n}w`` (the whole flood),
``paced_queued_outside_mean_ms_{n}w`` (as ``paced_outside_mean_ms_{n}w``: a request's time
waiting on its engine counts as on the worker), ``paced_queued_vs_capacity_min``,
``paced_queued_loop_cpu_max``, ``paced_queued_batches`` (batches per worker in flight),
``paced_queued_rounds`` (rounds per flood); paced ranks:
``paced_ranks_workers`` (the paced workers in all), ``paced_ranks_max`` (the most ranks run),
``paced_ranks_rps_{k}r``, ``paced_ranks_vs_capacity_{k}r`` (of the same engines' capacity),
``paced_ranks_outside_mean_ms_{k}r`` (mean time outside a worker, every rank's calls),
``paced_ranks_loop_cpu_max_{k}r`` (the busiest rank's loop, cores); and the pacing:
``paced_running``, ``paced_tokens_per_s``, ``paced_tokens``, ``paced_step_tokens``,
``paced_worker_nice``, ``paced_report_interval_s``; running: ``running_requests``,
``running_workers``, per report interval in ms: ``running_loop_cpu_{ms}ms`` (cores),
``running_workers_cpu_{ms}ms``, ``running_loop_us_per_report_{ms}ms`` (loop CPU per running
request per report, a report per interval or per engine step, whichever is longer),
``running_loop_ceiling_{ms}ms`` (running requests one loop could keep track of at that interval,
a core of its own); ranks:
``ranks_workers`` (workers in all), ``ranks_rps_{k}r``, ``ranks_p99_us_{k}r`` (all ranks'
calls), ``ranks_loop_cpu_max_{k}r`` (the busiest rank's loop, cores), ``ranks_machine_busy_{k}r``,
``ranks_bottleneck_{k}r``, ``ranks_max`` (the most ranks run), ``ranks_rps_scaling_max``
(requests/s with the most ranks / with the fewest), ``ranks_bottleneck`` (with the most); clients:
``clients_workers``, ``clients_rps_{k}c``, ``clients_p99_us_{k}c``, ``clients_loop_cpu_{k}c`` (the
supervisor's loop, cores), ``clients_loop_us_per_req_{k}c``, ``clients_cpu_{k}c`` (the client
processes, cores), ``clients_client_us_per_req_{k}c``, ``clients_machine_busy_{k}c``,
``clients_bottleneck_{k}c``, ``clients_max``, ``clients_rps_scaling_max`` (most clients / fewest),
``clients_loop_cpu_max``, ``clients_bottleneck`` (with the most), ``clients_in_process_rps`` (the
baseline: the same fleet flooded by its in-process client, in turns with the client processes),
``clients_in_process_loop_cpu`` (its loop, cores); and the machine facts ``machine_*`` of
bench/common.py (``MACHINE_KEYS``; ``machine_busy_{n}w`` above is a measurement, not one of them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import threading
import time
from typing import Any


from common import (ENGINES_SATURATED, bench_parser, finite_float, machine_info, memcpy_gbps, png_path, print_table,
                    run_loop, run_main, child_env, stop_signals, stopped_by, summarize, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

import psutil
import torch

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.actors.config import REPORT_INTERVAL_S
from rollfleet.transport.messages import SamplingParams

MB = 1 << 20
PROMPT = [1, 2]
PARAMS = SamplingParams(max_tokens=1)
LOOP_SATURATED = 0.9  # of one core: the event loop has no time left to give
LOOP_WAITS = 0.1  # of the wall time: the loop thread, ready to run, waited this long for a core
MACHINE_SATURATED = 0.9  # of all cores
PACED_QUEUED = 2  # queued: full batches per paced worker in flight, one running and the rest waiting on it
ROUNDS = 3  # throughput: the median of this many floods per fleet size, taken in turns
BLOCK = 100  # unloaded latency: calls per fleet size per turn


def schedstat_path() -> str | None:
    """The calling thread's scheduler statistics (Linux: time on a core, then time waiting in a
    run queue for one, in ns), or None where the kernel keeps none."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    try:
        with open(path) as f:
            int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return path


class CpuMeter:
    """CPU seconds of the supervisor process, of its event-loop thread, of the workers and of
    the whole machine between ``start()`` and ``stop()``; and, where the kernel tells (Linux
    schedstat), how long the loop thread was ready to run but waited for a core (``loop_wait``:
    the machine's cores, not the loop, held it back). Use it from the event loop's thread."""

    def __init__(self, sup: Supervisor) -> None:
        self.schedstat = schedstat_path()
        self.workers = []
        for h in sup.workers.values():
            try:
                self.workers.append(psutil.Process(h.pid))
            except psutil.Error:  # a worker that died is simply not counted
                pass

    def _read(self) -> tuple[float, ...]:
        # Called on the loop's own thread: thread_time is that thread's CPU clock, exact to the
        # nanosecond, where /proc counts 10 ms ticks (still what the workers' figures rest on).
        loop, process = time.thread_time(), time.process_time()
        workers = 0.0
        for p in self.workers:
            try:
                w = p.cpu_times()
                workers += w.user + w.system
            except psutil.Error:
                pass
        m = psutil.cpu_times()
        idle = m.idle + getattr(m, "iowait", 0.0)
        wait = 0.0
        if self.schedstat is not None:
            with open(self.schedstat) as f:
                wait = int(f.read().split()[1]) / 1e9
        return time.perf_counter(), process, loop, workers, sum(m) - idle, wait

    def start(self) -> None:
        self.t0 = self._read()

    def stop(self) -> dict[str, float]:
        """Seconds of each between start and stop: wall, supervisor, loop, workers, machine,
        and loop_wait where the kernel tells."""
        t1 = self._read()
        names = ("wall", "supervisor", "loop", "workers", "machine") + (("loop_wait",) if self.schedstat else ())
        return dict(zip(names, (max(b - a, 0.0) for a, b in zip(self.t0, t1))))


def cores_used(samples: list[dict[str, float]]) -> dict[str, float]:
    """CPU seconds summed over samples per wall second: cores used, 1.0 = one core busy."""
    wall = max(sum(s["wall"] for s in samples), 1e-9)
    keys = ("supervisor", "loop", "workers", "machine") + tuple(k for k in ("clients", "loop_wait") if k in samples[0])
    return {k: sum(s[k] for s in samples) / wall for k in keys}


def bottleneck(cpu: dict[str, float], cores: int) -> str:
    """Where the time went, from CPU use alone (no guess from throughput)."""
    if cpu["loop"] >= LOOP_SATURATED:
        return "supervisor event loop"
    if cpu["supervisor"] + cpu["workers"] + cpu.get("clients", 0.0) >= MACHINE_SATURATED * cores:
        return "machine cores (rollfleet)"
    if cpu["machine"] >= MACHINE_SATURATED * cores:
        return "machine cores (other work)"
    if cpu.get("loop_wait", 0.0) >= LOOP_WAITS:
        # Not busy on average, but in bursts: the loop was ready and every core was taken.
        return "machine cores (the loop waits for one)"
    return "none saturated"


async def flood(client, n: int, window: int, tag: str,  # type: ignore[no-untyped-def]
                params: SamplingParams = PARAMS, outside: list[float] | None = None,
                caller: list[float] | None = None, done: list[float] | None = None) -> tuple[float, list[float]]:
    """n calls with ``window`` in flight; returns (requests/s, latency of each call in us).
    ``outside``, when given, gets each call's latency less the time its result says it spent
    on workers (``timings["worker"]``): the fleet's share, in us. ``caller`` gets each call's
    latency less the time the supervisor held the request (``timings["total"]``, from its
    arrival to its result): how long the finished request then waited for its caller to run
    on the loop, in us. ``done`` gets each call's end (``time.perf_counter()``, s)."""
    left = n
    lat: list[float] = []
    ids = itertools.count()

    async def lane() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter_ns()
            r = await client.generate(f"{tag}-{next(ids)}", PROMPT, params)
            us = (time.perf_counter_ns() - t) / 1e3
            lat.append(us)
            if outside is not None:
                outside.append(us - r.timings.get("worker", 0.0) * 1e6)
            if caller is not None:
                caller.append(us - r.timings["total"] * 1e6)
            if done is not None:
                done.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(min(window, n))))
    return n / (time.perf_counter() - t0), lat


async def metered_flood(sup: Supervisor, client, into: dict, n: int, window: int, tag: str,  # type: ignore[no-untyped-def]
                        params: SamplingParams = PARAMS) -> None:
    """One flood with the CPU meter running; its rate, latencies and CPU go into ``into``."""
    meter = CpuMeter(sup)
    meter.start()
    rps, lat = await flood(client, n, window, tag, params, into.get("outside"), into.get("caller"))
    into["cpu"].append(meter.stop())
    into["rps"].append(rps)
    into["lat"] += lat


async def metered_batches(sup: Supervisor, client, into: dict, n: int, window: int) -> None:  # type: ignore[no-untyped-def]
    """n calls as ``generate_batch`` calls of window / 2 prompts, two at a time (a rollout step
    submits its prompts so), with the CPU meter running; rate, calls and CPU go into ``into``."""
    size, left = max(window // 2, 1), n

    async def lane() -> None:
        nonlocal left
        while left > 0:
            k = min(size, left)
            left -= k
            await client.generate_batch([PROMPT] * k, PARAMS)

    meter = CpuMeter(sup)
    meter.start()
    t0 = time.perf_counter()
    await asyncio.gather(lane(), lane())
    into["rps"].append(n / (time.perf_counter() - t0))
    into["cpu"].append(meter.stop())
    into["num_calls"] += n


def totals(f: dict, cores: int) -> None:
    """A fleet size's floods, summed up in place: calls, CPU seconds and cores, median rate,
    latency percentiles, bottleneck."""
    f["num_calls"] = len(f["lat"])
    f["cpu_s"] = {k: sum(s[k] for s in f["cpu"]) for k in ("supervisor", "loop", "workers")}
    f["cpu"] = cores_used(f["cpu"])
    f["rps"] = statistics.median(f["rps"])
    if "outside" in f:
        # each call's time on its worker: its latency less the fleet's share
        f["worker"] = summarize([total - fleet for total, fleet in zip(f["lat"], f["outside"])])
        f["outside"] = summarize(f["outside"])
    if "caller" in f:
        f["caller"] = summarize(f["caller"])
    f["lat"] = summarize(f["lat"])
    f["bottleneck"] = bottleneck(f["cpu"], cores)


async def fleets_in_turns(sizes: dict, cores: int) -> dict:
    """Every fleet size started at once (an idle echo worker is ~30 MB and a heartbeat), then
    measured in turns, round after round, so that other work on a shared machine hits every
    size alike instead of whichever ran at the wrong moment."""
    out = {}
    async with contextlib.AsyncExitStack() as stack:
        sups = {}
        for n in sizes["workers"]:
            config = FleetConfig(engine="echo", num_workers=n, engine_options={"tokens_per_s": 0},
                                 frontend_addr=None, start_timeout_s=300)
            t0 = time.perf_counter()
            sups[n] = await stack.enter_async_context(Supervisor(config))
            out[n] = {"start_s": time.perf_counter() - t0, "seq": [], "lat": [], "rps": [], "cpu": [],
                      "batches": {"rps": [], "cpu": [], "num_calls": 0}}
        clients = {n: sup.client() for n, sup in sups.items()}
        for n, client in clients.items():
            await flood(client, sizes["warmup"], sizes["window"], f"warm{n}")
        for block in range(sizes["seq"] // BLOCK):
            for n, client in clients.items():
                for i in range(BLOCK):
                    t = time.perf_counter_ns()
                    await client.generate(f"s{n}-{block}-{i}", PROMPT, PARAMS)
                    out[n]["seq"].append((time.perf_counter_ns() - t) / 1e3)
        for r in range(ROUNDS):
            for n, client in clients.items():
                await metered_flood(sups[n], client, out[n], sizes["tput"] // ROUNDS, sizes["window"], f"f{n}-{r}")
                await metered_batches(sups[n], client, out[n]["batches"], sizes["tput"] // ROUNDS, sizes["window"])
    for n, f in out.items():
        totals(f, cores)
        b = f["batches"]
        b["loop_s"] = sum(s["loop"] for s in b["cpu"])
        b["cpu"], b["rps"] = cores_used(b["cpu"]), statistics.median(b["rps"])
        b["bottleneck"] = bottleneck(b["cpu"], cores)
        f["seq"] = summarize(f["seq"])
        print(f"{n:>3} workers: {f['rps']:,.0f} req/s, p99 {f['lat']['p99']:,.0f} us, loop {f['cpu']['loop']:.2f} "
              f"cores, workers {f['cpu']['workers']:.2f}, machine {f['cpu']['machine']:.2f} -> {f['bottleneck']}",
              flush=True)
    return out


def paced_config(p: dict, n: int) -> FleetConfig:
    """A fleet of n echo workers paced as ``p`` (``sizes["paced"]``) says."""
    # worker_nice: the workers yield a shared core to the supervisor (and the client)
    return FleetConfig(engine="echo", num_workers=n, frontend_addr=None, start_timeout_s=300,
                       engine_options={"tokens_per_s": p["tokens_per_s"], "max_running": p["running"],
                                       "step_tokens": p["step_tokens"]},
                       worker_nice=p["worker_nice"], report_interval_s=p["report_interval_s"])


def paced_capacity(sizes: dict, n: int) -> float:
    """Requests/s that n paced workers can finish at most: running x tokens/s / tokens per request."""
    p = sizes["paced"]
    return n * p["running"] * p["tokens_per_s"] / p["tokens"]


async def paced_in_turns(sizes: dict, cores: int) -> dict:
    """The echo fleet standing in for real engines: each worker runs at most ``running`` requests at
    once at ``tokens_per_s`` each (a GPU engine's batch), requests of ``tokens`` tokens. With
    exactly ``running`` requests in flight per worker the engines are the limit by construction;
    what is measured is whether the fleet delivers their capacity as workers are added, and
    what that load costs the supervisor's loop."""
    p = sizes["paced"]
    params = SamplingParams(max_tokens=p["tokens"])
    out = {}
    queued_rounds = queued_paced_rounds(p)
    async with contextlib.AsyncExitStack() as stack:
        sups = {}
        for n in sizes["workers"]:
            sups[n] = await stack.enter_async_context(Supervisor(paced_config(p, n)))
            out[n] = {"rps": [], "lat": [], "cpu": [], "outside": [], "caller": [],
                      "queued": {"rps": [], "cpu": [], "outside": []}}
        clients = {n: sup.client() for n, sup in sups.items()}
        for n, client in clients.items():  # warm-up: one batch per worker
            await flood(client, n * p["running"], n * p["running"], f"pw{n}", params)
        for r in range(ROUNDS):
            for n, client in clients.items():
                window = n * p["running"]
                await metered_flood(sups[n], client, out[n], window * p["batches"], window, f"p{n}-{r}", params)
                # Queued: PACED_QUEUED batches per worker in flight, as a rollout step submits more
                # prompts than its engines have slots; the rate from the first round's middle to the last's.
                q, done = out[n]["queued"], []
                meter = CpuMeter(sups[n])
                meter.start()
                await flood(client, window * queued_rounds, window * PACED_QUEUED, f"q{n}-{r}", params,
                            q["outside"], done=done)
                q["cpu"].append(meter.stop())
                q["rps"].append(steady_rate(done, window))
    for n, f in out.items():
        q = f.pop("queued")
        totals(f, cores)
        f["capacity"] = paced_capacity(sizes, n)
        f["queued"] = {"rps": statistics.median(q["rps"]), "cpu": cores_used(q["cpu"]),
                       "outside_mean": sum(q["outside"]) / len(q["outside"])}
        if f["bottleneck"] != "supervisor event loop" and f["rps"] >= ENGINES_SATURATED * f["capacity"]:
            f["bottleneck"] = "engines (their capacity)"  # delivered: whatever else was busy, they were the limit
        print(f"{n:>3} paced workers: {f['rps']:,.0f} req/s of {f['capacity']:,.0f}, p99 {f['lat']['p99'] / 1e3:,.0f} ms, "
              f"p50 {f['worker']['p50'] / 1e3:,.0f} ms on a worker and {f['outside']['p50'] / 1e3:,.1f} ms outside, "
              f"loop {f['cpu']['loop']:.2f} cores (waits {f['cpu'].get('loop_wait', float('nan')):.2f}), workers "
              f"{f['cpu']['workers']:.2f}, machine {f['cpu']['machine']:.2f} -> {f['bottleneck']}", flush=True)
        print(f"{n:>3} paced workers, {PACED_QUEUED} batches each in flight: {f['queued']['rps']:,.0f} req/s of "
              f"{f['capacity']:,.0f} (from the first round to the last), "
              f"{f['queued']['outside_mean'] / 1e3:,.1f} ms outside a worker on average, "
              f"loop {f['queued']['cpu']['loop']:.2f} cores", flush=True)
    return out


def queued_paced_rounds(p: dict) -> int:
    """Rounds of every worker's batch in a queued flood: 2 x max(2, batches), so that its rate is
    taken over 3 rounds or more, from the first round's middle to the last's."""
    return 2 * max(2, p["batches"])


def steady_rate(done: list[float], per_round: int) -> float:
    """Calls per second from the middle of the first round (the median end of its ``per_round``
    calls) to the middle of the last: (rounds - 1) rounds' calls apart. With every engine's queue
    filled, each slot runs one request after the other, so a round's results come as spread out as
    the first round's did; between their medians, the time the first dispatches took (the spread)
    and the end of the flood (its last results) drop out, and what is left is the engines' pace."""
    if per_round < 1:
        raise ValueError(f"per_round must be >= 1, got {per_round}")
    done = sorted(done)
    rounds = len(done) // per_round
    if rounds < 2:  # (not from paced_in_turns: 4 rounds or more) the calls after the first, over their span
        return (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else 0.0
    first = statistics.median(done[:per_round])
    last = statistics.median(done[(rounds - 1) * per_round:rounds * per_round])
    return (rounds - 1) * per_round / max(last - first, 1e-9)


RUNNING_TOKENS_PER_S = 50.0  # each running request's pace (a long rollout on a busy engine)
RUNNING_STEP = 5  # tokens an engine step makes: fewer wake-ups of the paced workers


async def running_in_turns(sizes: dict) -> dict:
    """Many requests running and none finishing: what keeping track of them costs the loop, per
    report interval. A fleet per interval; in each round, each fleet in turn gets its requests,
    is measured once they all run, and has them cancelled (the others idle meanwhile)."""
    r = sizes["running"]
    n, per = r["workers"], r["per_worker"]
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)  # outlasts the measurement
    out: dict = {}
    async with contextlib.AsyncExitStack() as stack:
        sups = {}
        for interval in r["intervals"]:
            options = {"tokens_per_s": RUNNING_TOKENS_PER_S, "max_running": per, "step_tokens": RUNNING_STEP}
            config = FleetConfig(engine="echo", num_workers=n, engine_options=options, frontend_addr=None,
                                 start_timeout_s=300, report_interval_s=interval)
            sups[interval] = await stack.enter_async_context(Supervisor(config))
            out[interval] = {"cpu": []}
        for rnd in range(r["rounds"]):
            for interval, sup in sups.items():
                client = sup.client()
                calls = [asyncio.create_task(client.generate(f"run{rnd}-{i}", PROMPT, params))
                         for i in range(n * per)]
                await asyncio.sleep(r["settle_s"] + interval)  # every request started and reported once
                meter = CpuMeter(sup)
                meter.start()
                await asyncio.sleep(r["measure_s"])
                out[interval]["cpu"].append(meter.stop())
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                await asyncio.sleep(0.2)  # the aborts reach the workers before the next fleet is measured
    for interval, f in out.items():
        f["cpu_s"] = {k: sum(s[k] for s in f["cpu"]) for k in ("loop", "workers")}
        f["wall_s"] = sum(s["wall"] for s in f["cpu"])
        f["cpu"] = cores_used(f["cpu"])
        # A running request is reported once per interval in which its engine made tokens: at most
        # once per engine step (RUNNING_STEP tokens) however short the interval.
        reports = n * per * f["wall_s"] * min(1 / interval, RUNNING_TOKENS_PER_S / RUNNING_STEP)
        f["us_per_report"] = f["cpu_s"]["loop"] / reports * 1e6
        f["ceiling"] = n * per / f["cpu"]["loop"] if f["cpu"]["loop"] > 0 else float("inf")
        print(f"{n * per} requests running, reports every {interval:g} s: loop {f['cpu']['loop']:.3f} cores "
              f"({f['us_per_report']:.1f} us per request per report), workers {f['cpu']['workers']:.2f}", flush=True)
    return out


async def rank_main(workers: int, window: int, paced: dict | None = None) -> None:
    """One rank of a job that runs a fleet per rank (``--rank-worker``, started by ranks_in_turns
    and paced_ranks_in_turns): its own supervisor, echo workers (no model; or paced as ``paced``
    says, ``--rank-paced``) and in-process client. Says ``{"ready": ...}`` on stdout once warm;
    then for each ``go N`` line on stdin floods N calls and answers with one JSON line (rate,
    latencies, CPU seconds; paced, each call's time outside its worker too); ends on ``exit`` or
    end of input."""
    if paced is None:
        config = FleetConfig(engine="echo", num_workers=workers, engine_options={"tokens_per_s": 0},
                             frontend_addr=None, start_timeout_s=300)
        params, warm = PARAMS, 1000
    else:
        config, params, warm = paced_config(paced, workers), SamplingParams(max_tokens=paced["tokens"]), window
    loop = asyncio.get_running_loop()
    async with Supervisor(config) as sup:
        client = sup.client()
        await flood(client, warm, window, "warm", params)
        print(json.dumps({"ready": workers}), flush=True)
        for turn in itertools.count():
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if len(line) != 2 or line[0] != "go":
                return
            f: dict = {"rps": [], "lat": [], "cpu": []}
            if paced is not None:
                f["outside"] = []
            await metered_flood(sup, client, f, int(line[1]), window, f"t{turn}", params)
            answer = {"rps": f["rps"][0], "cpu": f["cpu"][0], "lat": [round(x, 1) for x in f["lat"]]}
            if paced is not None:
                answer["outside"] = [round(x, 1) for x in f["outside"]]
            print(json.dumps(answer), flush=True)


async def start_children(argvs: list[list[str]]) -> list:
    """This script once per argv (a hidden child mode), each answering one JSON line once ready."""
    procs = []
    try:
        for argv in argvs:
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, os.path.abspath(__file__), *argv,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26, env=child_env()))
        for proc in procs:
            line = await asyncio.wait_for(proc.stdout.readline(), 300)
            if not line.startswith(b"{"):
                raise RuntimeError(f"a child process did not start (exit {await proc.wait()})")
    except BaseException:
        await stop_children(procs)
        raise
    return procs


async def stop_children(procs: list) -> None:
    """Tell each child to exit (end of input also does), and kill any that does not. Stopping on
    a signal, SIGTERM them at once: a child in the middle of a flood reads ``exit`` only after it."""
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                proc.stdin.write(b"exit\n")
                proc.stdin.close()
            if stopped_by() is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()  # a rank stops its own fleet on it (stop_signals)
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except asyncio.TimeoutError:
            proc.kill()  # a rank's workers die with it (they watch their parent)
            await proc.wait()


async def go_round(procs: list, calls: int) -> list[dict]:
    """Every child floods ``calls`` at once; their answers, in order."""
    for proc in procs:
        proc.stdin.write(f"go {calls}\n".encode())
    return [json.loads(await proc.stdout.readline()) for proc in procs]


def machine_busy_s(before: Any, after: Any) -> float:
    """Busy CPU seconds of the whole machine between two psutil.cpu_times() readings."""
    return (sum(after) - after.idle - getattr(after, "iowait", 0.0)) - (
        sum(before) - before.idle - getattr(before, "iowait", 0.0))


def finish_layouts(out: dict, cores: int) -> None:
    """Each layout's rounds summed up in place, like ``totals``."""
    for f in out.values():
        f["num_calls"] = len(f["lat"])
        f["cpu_s"] = {k: sum(s[k] for s in f["cpu"]) for k in f["cpu"][0] if k != "wall"}
        f["cpu"] = cores_used(f["cpu"])
        f["rps"] = statistics.median(f["rps"])
        f["lat"] = summarize(f["lat"])
        if f.get("outside"):
            f["outside"] = summarize(f["outside"])
        f["bottleneck"] = bottleneck(f["cpu"], cores)


def layout_calls(sizes: dict, k: int) -> int:
    # Rounds of at least 20,000 calls in all: a child's start and end, and the pipes that
    # start it, stay small against the flood (quick runs make few calls per fleet size).
    return max(sizes["tput"] // ROUNDS, 20_000) // k


async def layouts_in_turns(layouts: list[int], argv, sizes: dict, cores: int, metered,  # type: ignore[no-untyped-def]
                           also=None, calls_of=None) -> dict:
    """Each layout K runs K child processes (``argv(K)``: their command line, a hidden mode of
    this script); then rounds of floods by each layout's children, the layouts in turns like
    the fleet sizes; ``metered(children, calls)`` runs one round and returns the children's
    answers and the round's CPU seconds (with its wall time). ``also(round)``, when given, runs
    once per round after the layouts' turns (a baseline measured in turns with them);
    ``calls_of(K)``, when given, is each child's calls a round (else ``layout_calls``). Summed up
    per layout; no child outlives it."""
    out: dict[int, dict] = {k: {"rps": [], "lat": [], "cpu": [], "outside": []} for k in layouts}
    procs: dict[int, list] = {}
    try:
        for k in layouts:
            procs[k] = await start_children([argv(k)] * k)
        for r in range(ROUNDS):
            for k, ps in procs.items():
                calls = layout_calls(sizes, k) if calls_of is None else calls_of(k)
                answers, cpu = await metered(ps, calls)
                f = out[k]
                f["rps"].append(calls * k / cpu["wall"])
                f["lat"] += [x for a in answers for x in a["lat"]]
                f["outside"] += [x for a in answers for x in a.get("outside", ())]
                f["cpu"].append(cpu)
            if also is not None:
                await also(r)
    finally:
        await stop_children([p for ps in procs.values() for p in ps])
    finish_layouts(out, cores)
    return out


async def metered_ranks(ps: list, calls: int) -> tuple[list[dict], dict]:
    """One round of every rank's flood, with the machine's CPU and each rank's own."""
    machine = psutil.cpu_times()
    t = time.perf_counter()
    answers = await go_round(ps, calls)
    wall = time.perf_counter() - t
    return answers, {"wall": wall, "machine": machine_busy_s(machine, psutil.cpu_times()),
                     # the busiest rank's loop, as a share of its own flood's time
                     "loop": max(a["cpu"]["loop"] / max(a["cpu"]["wall"], 1e-9) for a in answers) * wall,
                     "supervisor": sum(a["cpu"]["supervisor"] for a in answers),
                     "workers": sum(a["cpu"]["workers"] for a in answers)}


async def ranks_in_turns(sizes: dict, cores: int, workers: int) -> dict:
    """``workers`` no-model echo workers as K ranks of a job (K in ``sizes["ranks"]``), each rank a
    process with a fleet of its own of workers / K and its own flood of window / K in flight, as
    in examples/torchrun_rl.py: the requests in flight and the workers in all stay the same, the
    supervisor's work is spread over K loops. The layouts run in turns like the fleet sizes."""

    def argv(k: int) -> list[str]:
        return ["--rank-worker", str(workers // k), "--window", str(max(1, sizes["window"] // k))]

    out = await layouts_in_turns(sizes["ranks"], argv, sizes, cores, metered_ranks)
    for k, f in out.items():
        print(f"{workers:>3} workers as {k} rank{'s' if k > 1 else ''}: {f['rps']:,.0f} req/s, p99 "
              f"{f['lat']['p99']:,.0f} us, busiest loop {f['cpu']['loop']:.2f} cores, machine "
              f"{f['cpu']['machine']:.2f} -> {f['bottleneck']}", flush=True)
    return out


async def paced_ranks_in_turns(sizes: dict, cores: int, workers: int) -> dict:
    """The largest engine-paced fleet (``workers``) again as K ranks (K in ``sizes["ranks"]`` that
    divide it), each rank a process with a fleet of its own of workers / K paced workers and
    exactly a full batch of each in flight: the same engines and requests, each round of
    results shared out over K loops instead of worked through by one."""
    p = sizes["paced"]

    def argv(k: int) -> list[str]:
        per = workers // k
        return ["--rank-worker", str(per), "--window", str(per * p["running"]), "--rank-paced", json.dumps(p)]

    out = await layouts_in_turns(sizes["ranks"], argv, sizes, cores, metered_ranks,
                                 calls_of=lambda k: workers // k * p["running"] * p["batches"])
    capacity = paced_capacity(sizes, workers)
    for k, f in out.items():
        f["capacity"] = capacity
        print(f"{workers:>3} paced workers as {k} rank{'s' if k > 1 else ''}: {f['rps']:,.0f} req/s of "
              f"{capacity:,.0f}, {f['outside']['mean'] / 1e3:,.1f} ms outside a worker on average, busiest loop "
              f"{f['cpu']['loop']:.2f} cores, machine {f['cpu']['machine']:.2f}", flush=True)
    return out


async def client_main(address: str, window: int) -> None:
    """One client process (``--client-of``, started by clients_in_turns): a RemoteClient on a
    fleet's frontend. Says ``{"ready": ...}`` once warm; then for each ``go N`` line floods N calls
    and answers with one JSON line (rate, latencies, its CPU seconds); ends on ``exit`` or end of
    input."""
    from rollfleet.actors import RemoteClient

    loop = asyncio.get_running_loop()
    async with RemoteClient(address) as client:
        await flood(client, 1000, window, f"warm{os.getpid()}")
        print(json.dumps({"ready": True}), flush=True)
        for turn in itertools.count():
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if len(line) != 2 or line[0] != "go":
                return
            cpu = time.process_time()
            rps, lat = await flood(client, int(line[1]), window, f"c{os.getpid()}-{turn}")
            print(json.dumps({"rps": rps, "cpu_s": time.process_time() - cpu, "lat": [round(x, 1) for x in lat]}),
                  flush=True)


async def clients_in_turns(sizes: dict, cores: int, workers: int) -> tuple[dict, dict]:
    """One fleet of ``workers`` no-model echo workers fed through its frontend by K client
    processes (K in ``sizes["clients"]``), each a RemoteClient with window / K in flight, as
    agent-loop processes would share one fleet: the supervisor's loop routes every request but
    runs no client. The layouts run in turns like the fleet sizes, and after them in each round
    the baseline: the same fleet flooded by its in-process client with the whole window in
    flight. Returns the layouts, and the baseline summed up like a fleet size's floods."""
    config = FleetConfig(engine="echo", num_workers=workers, engine_options={"tokens_per_s": 0},
                         start_timeout_s=300)
    in_process: dict = {"rps": [], "lat": [], "cpu": []}
    async with Supervisor(config) as sup:
        client = sup.client()
        await flood(client, sizes["warmup"], sizes["window"], "warm-in-process")

        async def baseline(r: int) -> None:
            await metered_flood(sup, client, in_process, layout_calls(sizes, 1), sizes["window"], f"in-process-{r}")

        async def metered(ps: list, calls: int) -> tuple[list[dict], dict]:
            meter = CpuMeter(sup)
            meter.start()
            answers = await go_round(ps, calls)
            cpu = meter.stop()
            cpu["clients"] = sum(a["cpu_s"] for a in answers)
            return answers, cpu

        def argv(k: int) -> list[str]:
            return ["--client-of", sup.frontend_address, "--window", str(max(1, sizes["window"] // k))]

        out = await layouts_in_turns(sizes["clients"], argv, sizes, cores, metered, also=baseline)
    totals(in_process, cores)
    for k, f in out.items():
        print(f"{workers:>3} workers, {k} client process{'es' if k > 1 else ''}: {f['rps']:,.0f} req/s, p99 "
              f"{f['lat']['p99']:,.0f} us, loop {f['cpu']['loop']:.2f} cores "
              f"({f['cpu_s']['loop'] / f['num_calls'] * 1e6:.1f} us/req), clients {f['cpu']['clients']:.2f}, "
              f"machine {f['cpu']['machine']:.2f} -> {f['bottleneck']}", flush=True)
    print(f"{workers:>3} workers, in-process client (baseline): {in_process['rps']:,.0f} req/s, p99 "
          f"{in_process['lat']['p99']:,.0f} us, loop {in_process['cpu']['loop']:.2f} cores", flush=True)
    return out, in_process


def ranks_workers(sizes: dict, fleets: dict) -> int:
    """The fleet size to spread over ranks: the one of at least 2 workers whose loop was busiest,
    unless ``--ranks-workers`` names one."""
    if sizes.get("ranks_workers"):
        return sizes["ranks_workers"]
    split = [n for n in fleets if n >= 2] or [2]
    return max(split, key=lambda n: fleets[n]["cpu"]["loop"] if n in fleets else 0.0)


def make_weights(total: int) -> list[tuple[str, torch.Tensor]]:
    size = min(32 * MB, max(MB, total // 8))
    return [(f"layer.{i}.weight", torch.full((size // 2,), float(i), dtype=torch.bfloat16))
            for i in range(max(1, total // size))]


async def updates_in_turns(sizes: dict) -> tuple[dict, float]:
    """A fleet per receiver count and the memcpy baseline, all set up first and then timed in
    turns (``rounds`` of ``reps`` updates each; the best counts), as the request floods are."""
    weights = make_weights(sizes["weights_mb"] * MB)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    bucket = sizes["bucket_mb"] * MB
    out: dict[int, dict] = {}
    memcpy = 0.0
    async with contextlib.AsyncExitStack() as stack:
        sups = {}
        for k in sizes["receivers"]:
            config = FleetConfig(engine="echo", num_workers=k, frontend_addr=None, keep_last_weights=False,
                                 start_timeout_s=300)
            sups[k] = await stack.enter_async_context(Supervisor(config))
            await sups[k].update_weights(weights, version=1, bucket_bytes=bucket)  # warm-up: buffers, mappings
            out[k] = {"gbps": 0.0, "cpu": {}}
        version = 1
        for _ in range(sizes["rounds"]):
            memcpy = max(memcpy, memcpy_gbps(weights, sizes["reps"]))  # as bench_weights.py's baseline
            for k, sup in sups.items():
                # This process keeps one set of shm segments between updates, mapped by the
                # receivers of the fleet that used it last: an untimed update hands it to this one.
                version += 1
                await sup.update_weights(weights, version=version, bucket_bytes=bucket)
                for _ in range(sizes["reps"]):
                    meter = CpuMeter(sup)
                    meter.start()
                    t = time.perf_counter()
                    version += 1
                    await sup.update_weights(weights, version=version, bucket_bytes=bucket)
                    gbps = nbytes / (time.perf_counter() - t) / 1e9
                    sample = cores_used([meter.stop()])
                    if gbps > out[k]["gbps"]:
                        out[k] = {"gbps": gbps, "cpu": sample}
    for k, u in out.items():
        u["seconds"] = nbytes / u["gbps"] / 1e9
        print(f"{k:>3} receivers: {u['gbps']:.2f} GB/s", flush=True)
    return out, memcpy


async def measure(sizes: dict, cores: int) -> tuple[dict, dict, dict, dict, dict, dict, dict, float]:
    fleets = await fleets_in_turns(sizes, cores)
    ranks: dict = {}
    clients: dict = {}
    if sizes["clients"]:
        workers = ranks_workers(sizes, fleets)
        by_clients, in_process = await clients_in_turns(sizes, cores, workers)
        clients = {"workers": workers, "by_clients": by_clients, "in_process": in_process}
    if sizes["ranks"]:
        workers = ranks_workers(sizes, fleets)
        layouts = [k for k in sizes["ranks"] if workers % k == 0]  # the same workers in all
        if layouts:
            ranks = {"workers": workers, "by_ranks": await ranks_in_turns(dict(sizes, ranks=layouts), cores, workers)}
        else:
            print(f"ranks: none of those asked for divides {workers} workers evenly: not run", flush=True)
    paced = await paced_in_turns(sizes, cores) if sizes["paced"]["batches"] else {}
    paced_ranks: dict = {}
    if paced and sizes["ranks"]:
        workers = max(paced)
        layouts = [k for k in sizes["ranks"] if workers % k == 0]
        if len(layouts) > 1:
            paced_ranks = {"workers": workers,
                           "by_ranks": await paced_ranks_in_turns(dict(sizes, ranks=layouts), cores, workers)}
        else:
            print(f"paced ranks: fewer than two of those asked for divide {workers} workers evenly: not run",
                  flush=True)
    running = await running_in_turns(sizes) if sizes["running"]["intervals"] else {}
    if not sizes["receivers"]:
        return fleets, ranks, clients, paced, paced_ranks, running, {}, 0.0
    updates, memcpy = await updates_in_turns(sizes)
    return fleets, ranks, clients, paced, paced_ranks, running, updates, memcpy



def metrics(sizes: dict, fleets: dict, ranks: dict, clients: dict, paced: dict, paced_ranks: dict, running: dict,
            updates: dict, memcpy: float) -> dict:
    m: dict = {"window": sizes["window"], "num_tput_calls": sizes["tput"], "weights_mb": sizes["weights_mb"],
               "bucket_mb": sizes["bucket_mb"]}
    for n, f in fleets.items():
        m[f"rps_{n}w"] = f["rps"]
        m[f"p50_us_{n}w"], m[f"p99_us_{n}w"] = f["lat"]["p50"], f["lat"]["p99"]
        m[f"seq_p50_us_{n}w"], m[f"seq_p99_us_{n}w"] = f["seq"]["p50"], f["seq"]["p99"]
        m[f"start_s_{n}w"] = f["start_s"]
        cpu = f["cpu"]
        m[f"supervisor_cpu_{n}w"], m[f"supervisor_loop_cpu_{n}w"] = cpu["supervisor"], cpu["loop"]
        m[f"workers_cpu_{n}w"], m[f"machine_busy_{n}w"] = cpu["workers"], cpu["machine"]
        m[f"supervisor_cpu_share_{n}w"] = cpu["supervisor"] / max(cpu["supervisor"] + cpu["workers"], 1e-9)
        m[f"bottleneck_{n}w"] = f["bottleneck"]
        if "loop_wait" in cpu:
            m[f"supervisor_loop_wait_{n}w"] = cpu["loop_wait"]
        # CPU per request: unlike cores used, it does not depend on what else ran meanwhile.
        m[f"supervisor_us_per_req_{n}w"] = f["cpu_s"]["supervisor"] / f["num_calls"] * 1e6
        m[f"loop_us_per_req_{n}w"] = f["cpu_s"]["loop"] / f["num_calls"] * 1e6
        m[f"workers_us_per_req_{n}w"] = f["cpu_s"]["workers"] / f["num_calls"] * 1e6
        # What the event loop alone could sustain if it had a core to itself.
        m[f"loop_ceiling_rps_{n}w"] = f["num_calls"] / max(f["cpu_s"]["loop"], 1e-9)
        b = f["batches"]
        m[f"batch_rps_{n}w"], m[f"batch_loop_cpu_{n}w"] = b["rps"], b["cpu"]["loop"]
        m[f"batch_loop_us_per_req_{n}w"] = b["loop_s"] / b["num_calls"] * 1e6
        m[f"batch_bottleneck_{n}w"] = b["bottleneck"]
    if ranks:
        by = ranks["by_ranks"]
        m["ranks_workers"] = ranks["workers"]
        for k, f in by.items():
            m[f"ranks_rps_{k}r"], m[f"ranks_p99_us_{k}r"] = f["rps"], f["lat"]["p99"]
            m[f"ranks_loop_cpu_max_{k}r"], m[f"ranks_machine_busy_{k}r"] = f["cpu"]["loop"], f["cpu"]["machine"]
            m[f"ranks_bottleneck_{k}r"] = f["bottleneck"]
        m["ranks_max"] = max(by)
        m["ranks_rps_scaling_max"] = by[max(by)]["rps"] / by[min(by)]["rps"]
        m["ranks_bottleneck"] = by[max(by)]["bottleneck"]
    if clients:
        by = clients["by_clients"]
        m["clients_workers"] = clients["workers"]
        m["clients_in_process_rps"] = clients["in_process"]["rps"]
        m["clients_in_process_loop_cpu"] = clients["in_process"]["cpu"]["loop"]
        for k, f in by.items():
            m[f"clients_rps_{k}c"], m[f"clients_p99_us_{k}c"] = f["rps"], f["lat"]["p99"]
            m[f"clients_loop_cpu_{k}c"], m[f"clients_cpu_{k}c"] = f["cpu"]["loop"], f["cpu"]["clients"]
            m[f"clients_machine_busy_{k}c"] = f["cpu"]["machine"]
            m[f"clients_loop_us_per_req_{k}c"] = f["cpu_s"]["loop"] / f["num_calls"] * 1e6
            m[f"clients_client_us_per_req_{k}c"] = f["cpu_s"]["clients"] / f["num_calls"] * 1e6
            m[f"clients_bottleneck_{k}c"] = f["bottleneck"]
        m["clients_max"] = max(by)
        m["clients_rps_scaling_max"] = by[max(by)]["rps"] / by[min(by)]["rps"]
        m["clients_loop_cpu_max"] = max(f["cpu"]["loop"] for f in by.values())
        m["clients_bottleneck"] = by[max(by)]["bottleneck"]
    for n, f in paced.items():
        m[f"paced_rps_{n}w"], m[f"paced_capacity_rps_{n}w"] = f["rps"], f["capacity"]
        m[f"paced_vs_capacity_{n}w"] = f["rps"] / f["capacity"]
        m[f"paced_p50_ms_{n}w"], m[f"paced_p99_ms_{n}w"] = f["lat"]["p50"] / 1e3, f["lat"]["p99"] / 1e3
        m[f"paced_loop_cpu_{n}w"], m[f"paced_workers_cpu_{n}w"] = f["cpu"]["loop"], f["cpu"]["workers"]
        m[f"paced_machine_busy_{n}w"] = f["cpu"]["machine"]
        m[f"paced_loop_us_per_req_{n}w"] = f["cpu_s"]["loop"] / f["num_calls"] * 1e6
        m[f"paced_bottleneck_{n}w"] = f["bottleneck"]
        m[f"paced_worker_p50_ms_{n}w"] = f["worker"]["p50"] / 1e3
        m[f"paced_outside_p50_ms_{n}w"], m[f"paced_outside_p99_ms_{n}w"] = (f["outside"]["p50"] / 1e3,
                                                                          f["outside"]["p99"] / 1e3)
        # Throughput follows the mean: a lane's cycle is its time on the worker plus this.
        m[f"paced_outside_mean_ms_{n}w"] = f["outside"]["mean"] / 1e3
        m[f"paced_caller_wait_ms_{n}w"] = f["caller"]["mean"] / 1e3
        # The loop's CPU per round of every request in flight (each worker's full batch), all of it:
        # what results of a round that finish together can queue for, at most.
        m[f"paced_loop_round_ms_{n}w"] = m[f"paced_loop_us_per_req_{n}w"] * n * sizes["paced"]["running"] / 1e3
        q = f["queued"]
        m[f"paced_queued_rps_{n}w"], m[f"paced_queued_vs_capacity_{n}w"] = q["rps"], q["rps"] / f["capacity"]
        m[f"paced_queued_loop_cpu_{n}w"] = q["cpu"]["loop"]
        m[f"paced_queued_outside_mean_ms_{n}w"] = q["outside_mean"] / 1e3
        if "loop_wait" in f["cpu"]:
            m[f"paced_loop_wait_{n}w"] = f["cpu"]["loop_wait"]
    if paced:
        p, top, low = sizes["paced"], max(paced), min(paced)
        m.update({"paced_running": p["running"], "paced_tokens_per_s": p["tokens_per_s"],
                  "paced_tokens": p["tokens"], "paced_step_tokens": p["step_tokens"],
                  "paced_worker_nice": p["worker_nice"], "paced_report_interval_s": p["report_interval_s"]})
        m["paced_rps_scaling_max"] = paced[top]["rps"] / paced[low]["rps"]
        m["paced_vs_capacity_min"] = min(f["rps"] / f["capacity"] for f in paced.values())
        m["paced_bottleneck"] = paced[top]["bottleneck"]
        m["paced_queued_batches"], m["paced_queued_rounds"] = PACED_QUEUED, queued_paced_rounds(p)
        m["paced_queued_vs_capacity_min"] = min(f["queued"]["rps"] / f["capacity"] for f in paced.values())
        m["paced_queued_loop_cpu_max"] = max(f["queued"]["cpu"]["loop"] for f in paced.values())
        # How many such workers one loop could feed, from its CPU per request at the largest fleet.
        ceiling = paced[top]["num_calls"] / max(paced[top]["cpu_s"]["loop"], 1e-9)
        m["paced_loop_ceiling_workers"] = ceiling / paced_capacity(sizes, 1)
    if paced_ranks:
        by = paced_ranks["by_ranks"]
        m["paced_ranks_workers"], m["paced_ranks_max"] = paced_ranks["workers"], max(by)
        for k, f in by.items():
            m[f"paced_ranks_rps_{k}r"], m[f"paced_ranks_vs_capacity_{k}r"] = f["rps"], f["rps"] / f["capacity"]
            m[f"paced_ranks_outside_mean_ms_{k}r"] = f["outside"]["mean"] / 1e3
            m[f"paced_ranks_loop_cpu_max_{k}r"] = f["cpu"]["loop"]
    if paced:
        # The busiest loop of every engine-paced flood, one batch or two per worker, one rank or
        # several: the goal's figure, as no_model_loop_cpu_max is for the floods without a model.
        loops = {f"a batch per worker, {n} workers": f["cpu"]["loop"] for n, f in paced.items()}
        loops.update({f"2 batches per worker, {n} workers": f["queued"]["cpu"]["loop"] for n, f in paced.items()})
        if paced_ranks:
            loops.update({f"{k} ranks (the busiest)": f["cpu"]["loop"] for k, f in paced_ranks["by_ranks"].items()})
        busiest = max(loops, key=loops.get)
        m["paced_loop_cpu_max"], m["paced_loop_cpu_max_run"] = loops[busiest], busiest
    if running:
        r = sizes["running"]
        m["running_requests"], m["running_workers"] = r["workers"] * r["per_worker"], r["workers"]
    for interval, f in running.items():
        ms = round(interval * 1000)
        m[f"running_loop_cpu_{ms}ms"], m[f"running_workers_cpu_{ms}ms"] = f["cpu"]["loop"], f["cpu"]["workers"]
        m[f"running_loop_us_per_report_{ms}ms"], m[f"running_loop_ceiling_{ms}ms"] = f["us_per_report"], f["ceiling"]
    for k, u in updates.items():
        m[f"gbps_{k}w"], m[f"update_s_{k}w"] = u["gbps"], u["seconds"]
        m[f"weights_supervisor_cpu_{k}w"] = u["cpu"].get("supervisor", 0.0)
        m[f"weights_workers_cpu_{k}w"] = u["cpu"].get("workers", 0.0)
    top, low = max(fleets), min(fleets)
    m["max_workers"] = top
    m["rps_scaling_max"] = fleets[top]["rps"] / fleets[low]["rps"]
    m["p99_scaling_max"] = fleets[top]["lat"]["p99"] / fleets[low]["lat"]["p99"]
    m["bottleneck"] = fleets[top]["bottleneck"]
    m["supervisor_loop_cpu_max"] = max(f["cpu"]["loop"] for f in fleets.values())
    m["batch_loop_cpu_max"] = max(f["batches"]["cpu"]["loop"] for f in fleets.values())
    # The busiest loop of every no-model flood this run made, whatever its kind: the goal's figure.
    loops = {f"single calls, {n} workers": f["cpu"]["loop"] for n, f in fleets.items()}
    loops.update({f"generate_batch calls, {n} workers": f["batches"]["cpu"]["loop"] for n, f in fleets.items()})
    if ranks:
        loops.update({f"{k} ranks (the busiest)": f["cpu"]["loop"] for k, f in ranks["by_ranks"].items()})
    if clients:
        loops.update({f"{k} client processes": f["cpu"]["loop"] for k, f in clients["by_clients"].items()})
        loops["in-process client, the client processes' fleet"] = clients["in_process"]["cpu"]["loop"]
    busiest = max(loops, key=loops.get)
    m["no_model_loop_cpu_max"], m["no_model_loop_cpu_max_run"] = loops[busiest], busiest
    if updates:
        m["memcpy_gbps"] = memcpy
        m["max_receivers"] = max(updates)
        m["gbps_scaling_max"] = updates[max(updates)]["gbps"] / updates[min(updates)]["gbps"]
    return m


def plot(path: str, fleets: dict, ranks: dict, clients: dict, paced: dict, updates: dict, memcpy: float,
         cores: int) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return False
    matplotlib.use("Agg")  # no display: benches run on servers and in CI
    import matplotlib.pyplot as plt

    ns = sorted(fleets)
    fig, axes = plt.subplots(1, 5 if paced else 4, figsize=(20 if paced else 16, 3.8))
    ax = axes[0]
    ax.plot(ns, [fleets[n]["rps"] for n in ns], marker="o", label="measured")
    # What the event loop's CPU per request would allow it, on a core of its own.
    ax.plot(ns, [fleets[n]["num_calls"] / max(fleets[n]["cpu_s"]["loop"], 1e-9) for n in ns], linestyle="--",
            color="grey", label="supervisor loop ceiling")
    if ranks:  # the same workers spread over K ranks, each with a fleet of its own
        w, by = ranks["workers"], ranks["by_ranks"]
        ax.scatter([w] * len(by), [f["rps"] for f in by.values()], marker="^", color="tab:green",
                   label=f"{w} workers as K ranks", zorder=3)
        for k, f in by.items():
            ax.annotate(f"{k}r", (w, f["rps"]), textcoords="offset points", xytext=(5, 0), fontsize=7)
    if clients:  # one fleet, its frontend fed by K client processes
        w, by = clients["workers"], clients["by_clients"]
        ax.scatter([w] * len(by), [f["rps"] for f in by.values()], marker="s", color="tab:purple",
                   label=f"{w} workers, K client processes", zorder=3)
        for k, f in by.items():
            ax.annotate(f"{k}c", (w, f["rps"]), textcoords="offset points", xytext=(-16, 0), fontsize=7)
    ax.set_ylim(bottom=0)
    ax.set_title("echo fleet throughput")
    ax.set_ylabel("requests / s")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(ns, [fleets[n]["lat"]["p99"] / 1e3 for n in ns], marker="o", label="p99 under load")
    ax.plot(ns, [fleets[n]["lat"]["p50"] / 1e3 for n in ns], marker=".", linestyle="--", label="p50 under load")
    ax.plot(ns, [fleets[n]["seq"]["p99"] / 1e3 for n in ns], marker="s", label="p99 one at a time")
    ax.set_yscale("log")
    ax.set_title("latency")
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)
    ax = axes[2]
    for key, label in (("loop", "supervisor event loop"), ("supervisor", "supervisor process"),
                       ("workers", "all workers"), ("machine", "whole machine")):
        ax.plot(ns, [fleets[n]["cpu"][key] for n in ns], marker="o", label=label)
    if all("loop_wait" in fleets[n]["cpu"] for n in ns):
        ax.plot(ns, [fleets[n]["cpu"]["loop_wait"] for n in ns], marker="x", linestyle=":",
                label="event loop waiting for a core")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.axhline(cores, color="black", linestyle="--", linewidth=1, label=f"{cores} cores")
    ax.set_title("CPU during the flood")
    ax.set_ylabel("cores used")
    ax.legend(fontsize=8)
    for ax in axes[:3]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("workers")
        ax.grid(True, alpha=0.3)
    ax = axes[3]
    ks = sorted(updates)
    if ks:
        ax.plot(ks, [updates[k]["gbps"] for k in ks], marker="o", label="update_weights")
        ax.axhline(memcpy, color="grey", linestyle="--", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("receiving workers")
        ax.set_ylabel("GB/s (model bytes / update time)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    else:  # --receivers ""
        ax.set_axis_off()
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("weight transfer")
    if paced:
        ax = axes[4]
        ps = sorted(paced)
        ax.plot(ps, [paced[n]["rps"] for n in ps], marker="o", label="a batch per worker in flight")
        ax.plot(ps, [paced[n]["queued"]["rps"] for n in ps], marker="^", label=f"{PACED_QUEUED} batches per worker")
        ax.plot(ps, [paced[n]["capacity"] for n in ps], linestyle="--", color="grey", label="engines' capacity")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("requests / s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps, [str(n) for n in ps])
        ax.set_xlabel("workers")
        ax.set_title("engine-paced echo fleet")
        ax.grid(True, alpha=0.3)
        twin = ax.twinx()
        twin.plot(ps, [paced[n]["cpu"]["loop"] for n in ps], marker="s", color="tab:red",
                  label="supervisor loop (cores)")
        if all("loop_wait" in paced[n]["cpu"] for n in ps):
            twin.plot(ps, [paced[n]["cpu"]["loop_wait"] for n in ps], marker="x", linestyle=":", color="tab:red",
                      label="loop waiting for a core")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("supervisor loop, cores")
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--workers", default=None, help="Fleet sizes, comma-separated (default 1,2,4,8,16).")
    parser.add_argument("--receivers", default="1,2,4",
                        help="Receiving workers for weight updates, comma-separated (default 1,2,4, with --quick "
                             "too; an empty value, --receivers '', skips the weight updates).")
    parser.add_argument("--window", type=int, default=256,
                        help="Requests in flight for throughput (default 256, with --quick too).")
    parser.add_argument("--weights-mb", type=int, default=None,
                        help="Size of each weight update, MiB of bf16 tensors (default 1024; --quick 256).")
    parser.add_argument("--calls", type=int, default=None,
                        help="Throughput calls per fleet size, all rounds together (default 40000; --quick 6000).")
    parser.add_argument("--paced-running", type=int, default=64,
                        help="Engine-paced fleet: requests each worker runs at once, its batch (default 64).")
    parser.add_argument("--paced-tokens-per-s", type=finite_float, default=200.0,
                        help="Engine-paced fleet: tokens/s of each running request (default 200).")
    parser.add_argument("--paced-tokens", type=int, default=64,
                        help="Engine-paced fleet: tokens per request (default 64).")
    parser.add_argument("--paced-batches", type=int, default=None,
                        help="Engine-paced fleet: requests per round, in full batches of every worker "
                             "(default 3, --quick 2; 0 skips the engine-paced fleet).")
    parser.add_argument("--paced-worker-nice", type=int, default=0, metavar="N",
                        help="Engine-paced fleet: its workers' FleetConfig.worker_nice (0..19; default 0, as "
                             "the supervisor). On a machine with fewer cores than workers, this shows how much of a "
                             "request's time outside its worker was the supervisor waiting for a core.")
    parser.add_argument("--paced-report-interval", type=finite_float, default=REPORT_INTERVAL_S,
                        metavar="S",
                        help="Engine-paced fleet: FleetConfig.report_interval_s, how often each worker reports the "
                             f"new tokens of its running requests (default {REPORT_INTERVAL_S}, the "
                             "fleet's own default). Each report costs the loop a few us per running request.")
    parser.add_argument("--running-workers", type=int, default=4,
                        help="Running: workers of each fleet (default 4, with --quick too).")
    parser.add_argument("--running-per-worker", type=int, default=256,
                        help="Running: requests each worker runs at once, all the time measured (default 256).")
    parser.add_argument("--running-intervals", default=None, metavar="S,S",
                        help="Running: report intervals to compare, seconds, comma-separated (default 0.05 and "
                             f"the fleet's default, {REPORT_INTERVAL_S}; 0 skips).")
    parser.add_argument("--ranks", default=None,
                        help="Job ranks to spread one no-model fleet over, each a process with a fleet of its own "
                             "(default 1,2,4, --quick 1,2; 0 skips).")
    parser.add_argument("--clients", default=None,
                        help="Client processes (RemoteClient) to feed one no-model fleet through its frontend "
                             "(default 1,2,4, --quick 1,2; 0 skips).")
    parser.add_argument("--ranks-workers", type=int, default=None,
                        help="Workers in all for the ranks and clients runs (default: the fleet size of 2 or more "
                             "whose loop was busiest).")
    parser.add_argument("--rank-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-paced", help=argparse.SUPPRESS)
    parser.add_argument("--client-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        run_loop(rank_main(args.rank_worker, args.window, json.loads(args.rank_paced) if args.rank_paced else None))
        return 0
    if args.client_of:
        run_loop(client_main(args.client_of, args.window))
        return 0
    if args.quick:
        sizes = {"workers": "1,2,4,8,16", "tput": 6000, "warmup": 500, "seq": 300, "weights_mb": 256,
                 "bucket_mb": 64, "rounds": 3, "reps": 2, "batches": 2}
    else:
        sizes = {"workers": "1,2,4,8,16", "tput": 40_000, "warmup": 2000, "seq": 2000, "weights_mb": 1024,
                 "bucket_mb": 256, "rounds": 3, "reps": 3, "batches": 3}
    if min(args.paced_running, args.paced_tokens) < 1 or args.paced_tokens_per_s <= 0 or (args.paced_batches or 0) < 0:
        parser.error("--paced-running, --paced-tokens and --paced-tokens-per-s must be > 0, --paced-batches >= 0")
    if not 0 <= args.paced_worker_nice <= 19:
        parser.error("--paced-worker-nice must be in 0..19")
    if not args.paced_report_interval > 0:
        parser.error("--paced-report-interval must be > 0")
    try:
        intervals = [float(x) for x in (args.running_intervals or f"0.05,{REPORT_INTERVAL_S}").split(",")
                     if x and float(x) != 0]
    except ValueError:
        parser.error("--running-intervals takes comma-separated seconds")
    if any(not 0.001 <= i <= 60 for i in intervals) or len({round(i * 1000) for i in intervals}) < len(intervals):
        parser.error("--running-intervals must be in 0.001..60 s, a millisecond apart at least (the keys name them "
                     "in ms)")
    if args.running_workers < 1:
        parser.error("--running-workers must be >= 1")
    if args.running_per_worker < 1:
        parser.error("--running-per-worker must be >= 1")
    sizes["running"] = {"workers": args.running_workers, "per_worker": args.running_per_worker,
                        "intervals": sorted(set(intervals)), "rounds": 2 if args.quick else ROUNDS,
                        "settle_s": 0.5 if args.quick else 1.0, "measure_s": 1.5 if args.quick else 3.0}
    sizes["paced"] = {"running": args.paced_running, "tokens_per_s": args.paced_tokens_per_s,
                      "tokens": args.paced_tokens, "step_tokens": max(1, min(8, args.paced_tokens)),
                      "batches": sizes.pop("batches") if args.paced_batches is None else args.paced_batches,
                      "worker_nice": args.paced_worker_nice, "report_interval_s": args.paced_report_interval}
    try:
        sizes["workers"] = [int(x) for x in (args.workers if args.workers is not None else sizes["workers"]).split(",")]
        sizes["receivers"] = [int(x) for x in args.receivers.split(",") if x]
        ranks = args.ranks if args.ranks is not None else ("1,2" if args.quick else "1,2,4")
        sizes["ranks"] = sorted({int(x) for x in ranks.split(",") if x and x != "0"})
        clients = args.clients if args.clients is not None else ("1,2" if args.quick else "1,2,4")
        sizes["clients"] = sorted({int(x) for x in clients.split(",") if x and x != "0"})
    except ValueError:
        parser.error("--workers, --receivers, --ranks and --clients take comma-separated integers")
    if sizes["clients"] and min(sizes["clients"]) < 1:
        parser.error("--clients must be >= 1 (0 skips)")
    if min(sizes["workers"]) < 1 or (sizes["receivers"] and min(sizes["receivers"]) < 1) or args.window < 1:
        parser.error("worker counts and --window must be >= 1")
    if sizes["ranks"] and min(sizes["ranks"]) < 1:
        parser.error("--ranks must be >= 1 (0 skips)")
    if args.ranks_workers is not None and args.ranks_workers < 2:
        parser.error("--ranks-workers must be >= 2")
    sizes["ranks_workers"] = args.ranks_workers
    if args.weights_mb is not None:
        if args.weights_mb < 1:
            parser.error("--weights-mb must be >= 1")
        sizes["weights_mb"] = args.weights_mb
    if args.calls is not None:
        if args.calls < ROUNDS:
            parser.error(f"--calls must be >= {ROUNDS}")
        sizes["tput"] = args.calls
        sizes["warmup"] = min(sizes["warmup"], args.calls)
    sizes["bucket_mb"] = min(sizes["bucket_mb"], sizes["weights_mb"])
    sizes["window"] = args.window
    logging.basicConfig(level=logging.WARNING)

    machine = machine_info()  # before the run: the load average is other work, not ours
    cores = machine["machine_cores"]
    t0 = time.perf_counter()
    fleets, ranks, clients, paced, paced_ranks, running, updates, memcpy = run_loop(measure(sizes, cores))
    m = metrics(sizes, fleets, ranks, clients, paced, paced_ranks, running, updates, memcpy)
    m["quick"] = args.quick
    m["elapsed_s"] = time.perf_counter() - t0
    m.update(machine)

    print()
    print_table(["workers", "req/s", "p50 us", "p99 us", "1-at-a-time p99 us", "loop cores", "loop waits",
                 "sup. cores", "workers cores", "machine busy", "loop us/req", "workers us/req", "bottleneck"],
                [(n, f["rps"], f["lat"]["p50"], f["lat"]["p99"], f["seq"]["p99"], f["cpu"]["loop"],
                  f["cpu"].get("loop_wait"), f["cpu"]["supervisor"], f["cpu"]["workers"], f["cpu"]["machine"], m[f"loop_us_per_req_{n}w"],
                  m[f"workers_us_per_req_{n}w"], f["bottleneck"])
                 for n, f in sorted(fleets.items())],
                title=f"echo fleet, generate(max_tokens=1), {args.window} in flight; {cores} cores, "
                      f"{machine['machine_cpu']}, load {machine['machine_load_1m']}{' (quick)' if args.quick else ''}")
    print()
    print_table(["workers", "req/s", "vs single calls", "loop cores", "loop us/req", "vs single calls", "bottleneck"],
                [(n, f["batches"]["rps"], f["batches"]["rps"] / f["rps"], f["batches"]["cpu"]["loop"],
                  m[f"batch_loop_us_per_req_{n}w"], m[f"batch_loop_us_per_req_{n}w"] / m[f"loop_us_per_req_{n}w"],
                  f["batches"]["bottleneck"]) for n, f in sorted(fleets.items())],
                title=f"the same requests as generate_batch calls of {max(args.window // 2, 1)} prompts, two at a time")
    print("req/s: the median round's rate; us/req: CPU seconds of all rounds / their calls (not cores / req/s "
          "when rounds ran at different rates); workers' CPU counts 10 ms ticks per worker"
          + (": rough at --quick" if args.quick else ""))
    if ranks:
        print()
        print_table(["ranks", "workers each", "req/s", "vs fewest ranks", "p99 us", "busiest loop cores", "sup. cores",
                     "workers cores", "machine busy", "bottleneck"],
                    [(k, ranks["workers"] // k, f["rps"], f["rps"] / ranks["by_ranks"][min(ranks["by_ranks"])]["rps"],
                      f["lat"]["p99"], f["cpu"]["loop"], f["cpu"]["supervisor"], f["cpu"]["workers"],
                      f["cpu"]["machine"], f["bottleneck"]) for k, f in sorted(ranks["by_ranks"].items())],
                    title=f"{ranks['workers']} no-model echo workers as K ranks, a fleet and a flood of "
                          f"{args.window}/K in flight each")
    if clients:
        print()
        base = clients["in_process"]
        print_table(["client processes", "req/s", "vs fewest", "vs in-process", "p99 us", "loop cores", "loop us/req",
                     "sup. cores", "workers cores", "clients cores", "client us/req", "machine busy", "bottleneck"],
                    [(k, f["rps"], f["rps"] / clients["by_clients"][min(clients["by_clients"])]["rps"],
                      f["rps"] / m["clients_in_process_rps"], f["lat"]["p99"], f["cpu"]["loop"],
                      m[f"clients_loop_us_per_req_{k}c"], f["cpu"]["supervisor"], f["cpu"]["workers"],
                      f["cpu"]["clients"], m[f"clients_client_us_per_req_{k}c"], f["cpu"]["machine"], f["bottleneck"])
                     for k, f in sorted(clients["by_clients"].items())]
                    + [("in-process client (baseline)", base["rps"], None, None, base["lat"]["p99"], base["cpu"]["loop"],
                        base["cpu_s"]["loop"] / base["num_calls"] * 1e6, base["cpu"]["supervisor"],
                        base["cpu"]["workers"], None, None, base["cpu"]["machine"], base["bottleneck"])],
                    title=f"one fleet of {clients['workers']} no-model echo workers fed through its frontend by K "
                          f"RemoteClient processes, {args.window}/K in flight each")
    if paced:
        p = sizes["paced"]
        print()
        print_table(["workers", "req/s", "capacity req/s", "of capacity", "p50 ms", "p99 ms", "on a worker p50 ms",
                     "outside p50 ms", "outside p99 ms", "outside mean ms", "caller wait ms", "loop cores",
                     "loop waits", "workers cores", "machine busy", "loop us/req", "loop ms per round", "bottleneck"],
                    [(n, f["rps"], f["capacity"], f["rps"] / f["capacity"], f["lat"]["p50"] / 1e3,
                      f["lat"]["p99"] / 1e3, f["worker"]["p50"] / 1e3, f["outside"]["p50"] / 1e3,
                      f["outside"]["p99"] / 1e3, m[f"paced_outside_mean_ms_{n}w"], m[f"paced_caller_wait_ms_{n}w"],
                      f["cpu"]["loop"], f["cpu"].get("loop_wait"), f["cpu"]["workers"], f["cpu"]["machine"],
                      m[f"paced_loop_us_per_req_{n}w"], m[f"paced_loop_round_ms_{n}w"], f["bottleneck"])
                     for n, f in sorted(paced.items())],
                    title=f"engine-paced echo fleet: {p['running']} requests at once per worker, "
                          f"{p['tokens_per_s']:g} tokens/s each, {p['tokens']} tokens a request; one loop "
                          f"could feed ~{m['paced_loop_ceiling_workers']:,.0f} such workers")
        print()
        print_table(["workers", "req/s", "of capacity", "vs 1 batch in flight", "outside mean ms", "loop cores"],
                    [(n, f["queued"]["rps"], f["queued"]["rps"] / f["capacity"], f["queued"]["rps"] / f["rps"],
                      f["queued"]["outside_mean"] / 1e3, f["queued"]["cpu"]["loop"]) for n, f in sorted(paced.items())],
                    title=f"the same paced fleets with {PACED_QUEUED} full batches per worker in flight (one running, "
                          f"one waiting on the engine, as a rollout step's prompts outnumber its engines' slots): "
                          f"req/s from the first of {m['paced_queued_rounds']} rounds to the last")
    if paced_ranks:
        print()
        print_table(["ranks", "workers each", "req/s", "of capacity", "outside mean ms", "p99 ms", "busiest loop cores",
                     "machine busy"],
                    [(k, paced_ranks["workers"] // k, f["rps"], f["rps"] / f["capacity"], f["outside"]["mean"] / 1e3,
                      f["lat"]["p99"] / 1e3, f["cpu"]["loop"], f["cpu"]["machine"])
                     for k, f in sorted(paced_ranks["by_ranks"].items())],
                    title=f"the {paced_ranks['workers']} paced workers as K ranks, each a process with a fleet and a "
                          f"loop of its own")
    if running:
        print()
        print_table(["report every s", "running requests", "loop cores", "loop us per request per report",
                     "running one loop could track", "workers cores"],
                    [(i, m["running_requests"], f["cpu"]["loop"], f["us_per_report"], f["ceiling"], f["cpu"]["workers"])
                     for i, f in sorted(running.items())],
                    title=f"{m['running_requests']} long requests running on {m['running_workers']} paced echo workers, "
                          f"none finishing: the loop keeps track of them")
    if updates:
        print()
        print_table(["receivers", "GB/s", "update s", "sup. process cores"],
                    [(k, u["gbps"], u["seconds"], u["cpu"].get("supervisor")) for k, u in sorted(updates.items())],
                    title=f"update_weights, {sizes['weights_mb']} MiB bf16 in {sizes['bucket_mb']} MiB buckets "
                          f"(memcpy of the same bytes: {memcpy:.2f} GB/s)")
    print(f"\n{m['elapsed_s']:.1f} s in all; bottleneck at {m['max_workers']} workers: {m['bottleneck']} "
          f"(no model), {m.get('paced_bottleneck', 'not run')} (engine-paced)"
          + (f"; {m['ranks_workers']} workers as {m['ranks_max']} ranks: {m['ranks_bottleneck']}" if ranks else "")
          + (f"; fed by {m['clients_max']} client processes: {m['clients_bottleneck']}" if clients else ""))
    if args.json:
        write_json(args.json, m)
        print(f"wrote {args.json}")
    png = png_path(args)
    if png and plot(png, fleets, ranks, clients, paced, updates, memcpy, cores):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
