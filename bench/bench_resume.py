"""Partial rollouts: useful tokens/s of a steady request stream while weights update every k s.

Two strategies, each with the same workload (the same prompts and lengths, from a seeded
generator), measured side by side: each on a fleet of its own, at the same time, so a
change in the machine's load (other work on a shared machine) hits both alike:

- ``resume`` (rollfleet's default): at an update, running requests are interrupted, keep
  their partial tokens, and continue under the new weights from where they were.
- ``restart`` (what RL frameworks did before partial rollouts): requests ask for hard abort
  (``resume=False``), so an update ends them with finish_reason 'abort'; the client then
  submits the same prompt again from scratch, under a new request id. The partial tokens
  are thrown away.

A steady stream is ``--inflight`` lanes, each submitting one request after another; a
request's max_tokens is drawn around ``--max-tokens`` (``--spread``), so lanes do not fall
into step. Each strategy runs a window: the lanes start, ramp for one update interval (no
update, so a cold start counts against neither strategy), then run ``--duration`` measured
seconds; every ``--every`` seconds from the lanes' start the bench calls ``update_weights``
with the same weights under a new version. Measured per strategy:

- useful tokens/s: tokens of requests that completed (length or stop) within the measured
  window, over its wall time;
- wasted tokens: tokens the engines generated (their ``num_tokens`` stats, from the lanes'
  start until every lane has stopped) less the tokens of completed requests and of the
  requests still running when the window closed (the bench aborts those and counts them
  apart). Under resume this should be 0; under restart it is what the aborts threw away.
  The client's own count of discarded partial outputs is reported next to it
  (``*_client``); the two differ only if tokens were lost on the way;
- update pause: time from calling ``update_weights(v)`` until the first token generated
  under version v reaches a client (every request streams, chunks carry their version);
  and how long the ``update_weights`` call itself took (interrupt, drain, send).

Every request sets ``ignore_eos``, so a completed one must hold exactly max_tokens tokens;
``wrong_length_*`` counts those that do not (a resume that lost or repeated tokens).

The default engine is ``torch`` (the tiny random Llama, real forward passes on the CPU);
``--engine echo`` paces tokens with ``--echo-tokens-per-s`` instead.

    python bench/bench_resume.py --quick --json bench/out/bench_resume.json   # < 1 min on 2 cores
    python bench/bench_resume.py --json bench/out/bench_resume.json            # ~2 min

``--sequential`` runs both on one fleet instead, in turns (resume, restart, restart,
resume, ...; ``--rounds`` windows each), for a machine that cannot hold two fleets (one GPU).

Keys: per strategy, totals over all ``rounds`` windows ("window": the measured seconds, ramp
excluded): ``resume_tps``, ``restart_tps`` (useful tokens/s: tokens of requests completed inside the
windows / the windows' seconds), ``generated_tps_resume``, ``generated_tps_restart`` (engine tokens
inside the windows / their seconds), ``engine_cpu_share_resume``, ``engine_cpu_share_restart`` (CPU
seconds of the worker processes inside the windows / their seconds: cores' worth),
``useful_per_cpu_s_resume``, ``useful_per_cpu_s_restart`` (window useful tokens per engine CPU
second; left out when no CPU time was read), ``useful_tokens_resume``, ``useful_tokens_restart``
(tokens of every request completed from the lanes' start to the end, ramp included),
``generated_tokens_resume``, ``generated_tokens_restart`` (engine tokens from the lanes' start until
every lane stopped), ``wasted_tokens_resume``, ``wasted_tokens_restart`` (generated minus useful
minus tail), ``wasted_tokens_resume_client``, ``wasted_tokens_restart_client`` (partial tokens of
requests an update ended, as the client saw them), ``wasted_per_update_resume``,
``wasted_per_update_restart`` (wasted / updates), ``wasted_fraction_resume``,
``wasted_fraction_restart`` (wasted / generated), ``tail_tokens_resume``, ``tail_tokens_restart``
(tokens of the requests the bench aborted when the window closed), ``completed_resume``,
``completed_restart`` (requests completed, counted as useful tokens are),
``completed_mean_tokens_resume``, ``completed_mean_tokens_restart`` (useful tokens per completed
request; left out when none completed), ``restarts_resume``, ``restarts_restart`` (requests ended by
an update and submitted again), ``wrong_length_resume``, ``wrong_length_restart``,
``preemptions_resume``, ``preemptions_restart`` (interruptions the completed requests resumed from),
``engine_requests_resume``, ``engine_requests_restart`` (requests the engines started, fresh or
resumed), ``updates_resume``, ``updates_restart`` (``update_weights`` calls),
``pauses_measured_resume``, ``pauses_measured_restart`` (updates whose first new-version token was
seen), ``update_pause_ms_resume``, ``update_pause_ms_restart`` (median pause, ms),
``update_pause_max_ms_resume``, ``update_pause_max_ms_restart`` (the longest),
``update_call_ms_resume``, ``update_call_ms_restart`` (median duration of the ``update_weights``
call, ms), ``window_s_resume``, ``window_s_restart`` (measured seconds); the pause keys are left out
when no pause was measured, the call key when no update ran. Summary: ``update_pause_ms`` (a copy of
``update_pause_ms_resume``), ``resume_vs_restart_tps`` (``resume_tps`` / ``restart_tps``; left out
when that is 0), ``resume_vs_restart_per_cpu`` (``useful_per_cpu_s_resume`` /
``useful_per_cpu_s_restart``; only when both are non-zero). The run: ``quick``, ``engine``,
``workers``, ``inflight``, ``max_tokens``, ``spread``, ``prompt_len``, ``duration_s``,
``update_every_s``, ``rounds``, ``side_by_side`` (false with ``--sequential``), ``start_s`` (fleet
start-up, s; side by side, both fleets start together), ``load_1m_end`` (the 1-minute load average
at the end), ``elapsed_s``; and the machine facts ``machine_*`` of bench/common.py (``MACHINE_KEYS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from common import (bench_parser, finite_float, machine_info, png_path, print_table, quick_defaults, run_loop,
                    run_main, stop_signals, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

import psutil

from rollfleet.actors import FleetConfig, StreamChunk, Supervisor
from rollfleet.transport.messages import SamplingParams

STRATEGIES = ("resume", "restart")
BIN_S = 0.5  # width of the tokens/s bins in the plot


@dataclass(kw_only=True, slots=True)
class Phase:
    """What one strategy did in one measurement window."""

    strategy: str
    ramp_s: float = 0.0
    """Lanes ran this long before the measurement window opened (no update in it)."""
    wall_s: float = 0.0
    """From the lanes' start to the window's end."""
    useful_tokens: int = 0
    """Tokens of every request completed, ramp included."""
    wasted_client: int = 0
    """Partial tokens of requests ended by an update (restart only), as the client saw them."""
    tail_tokens: int = 0
    """Tokens of requests still running when the window closed (aborted by the bench)."""
    engine_tokens: int = 0
    """Tokens the engines generated from the lanes' start to the end."""
    engine_tokens_window: int = 0
    """The same, within the measurement window only."""
    engine_cpu_window_s: float = 0.0
    """CPU time the engine processes got within the window (on a shared machine, their share)."""
    engine_requests: int = 0
    """Requests the engines started, fresh or resumed; each began with a prefill."""
    num_completed: int = 0
    num_restarts: int = 0
    num_preemptions: int = 0
    num_wrong_length: int = 0
    """Completed requests whose length is not their max_tokens (must stay 0)."""
    pauses_ms: list[float] = field(default_factory=list)
    update_call_ms: list[float] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the lanes started, tokens) of every streamed chunk."""
    completions: list[tuple[float, int]] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)
    """Seconds since the lanes started of each update_weights call."""

    @property
    def window_s(self) -> float:
        return self.wall_s - self.ramp_s

    @property
    def useful_window(self) -> int:
        """Tokens of requests completed within the window (whenever they started)."""
        return sum(n for t, n in self.completions if self.ramp_s <= t <= self.wall_s)

    @property
    def wasted_tokens(self) -> int:
        return self.engine_tokens - self.useful_tokens - self.tail_tokens


def workload(lane: int, seed: int, prompt_len: int, max_tokens: int, spread: float,
             vocab: int) -> Iterator[tuple[list[int], int]]:
    """An endless, reproducible sequence of (prompt, max_tokens) for one lane."""
    rng = random.Random(seed * 100_003 + lane)
    low = max(1, round(max_tokens * (1 - spread)))
    high = max(low, round(max_tokens * (1 + spread)))
    while True:
        # Ids from 3 up: 0-2 are pad, bos and eos in the tiny model.
        yield [rng.randrange(3, vocab) for _ in range(prompt_len)], rng.randint(low, high)


async def engine_counts(sup: Supervisor) -> tuple[int, int, float]:
    """(tokens generated, requests started, CPU seconds used) summed over the fleet's engines."""
    stats = await sup.stats()
    tokens = requests = 0
    cpu_s = 0.0
    for worker in stats["workers"]:
        engine = worker.get("engine_stats") or {}
        tokens += int(engine.get("num_tokens", 0))
        requests += int(engine.get("num_requests", 0))
        try:
            times = psutil.Process(worker["pid"]).cpu_times()
            cpu_s += times.user + times.system
        except (psutil.Error, KeyError, TypeError):
            pass  # a worker gone or not reporting its pid: its share is simply not counted
    return tokens, requests, cpu_s


class Bench:
    def __init__(self, sup: Supervisor, args: Any, weights: list[tuple[str, Any]], vocab: int):
        self.sup = sup
        self.client = sup.client()
        self.args = args
        self.weights = weights
        self.vocab = vocab
        self.version = 0

    async def update(self) -> float:
        """One update_weights call with the same weights under the next version; returns ms."""
        self.version += 1
        t = time.perf_counter()
        await self.client.update_weights(self.weights, self.version)
        return (time.perf_counter() - t) * 1e3

    async def warm_up(self) -> None:
        """Run every path once (prefill, decode, weights) so the first phase is not the slow one."""
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        jobs = workload(10_000, self.args.seed, self.args.prompt_len, 8, 0.0, self.vocab)
        await asyncio.gather(*(self.client.generate(f"warm-{i}", next(jobs)[0], params)
                               for i in range(self.args.inflight)))
        await self.update()

    async def phase(self, strategy: str, index: int) -> Phase:
        """Run the lanes for ramp + duration seconds under one strategy, updating every k s.

        The ramp (one update interval, no update in it) lets the lanes reach a steady state
        before the window opens, so a cold start does not count against either strategy.
        """
        args = self.args
        out = Phase(strategy=strategy, ramp_s=args.every)
        total_s = args.every + args.duration
        resume = strategy == "resume"
        stop = asyncio.Event()
        running: dict[int, str] = {}  # lane -> request id in flight
        ended_by_us: set[str] = set()
        first_chunk: dict[int, float] = {}  # weight version -> time its first token arrived
        tokens0, requests0, _ = await engine_counts(self.sup)
        t0 = time.perf_counter()

        async def lane(i: int) -> None:
            jobs = workload(i, args.seed, args.prompt_len, args.max_tokens, args.spread, self.vocab)
            job = 0
            while not stop.is_set():
                prompt, max_tokens = next(jobs)
                params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=job * 1000 + i,
                                        ignore_eos=True)
                job += 1
                attempt = 0
                while True:
                    rid = f"{strategy}{index}-{i}-{job}-{attempt}"
                    running[i] = rid
                    result = None
                    async for item in self.client.stream(rid, prompt, params, resume=resume):
                        if isinstance(item, StreamChunk):
                            now = time.perf_counter()
                            out.chunks.append((now - t0, len(item.token_ids)))
                            first_chunk.setdefault(item.weight_version, now)
                        else:
                            result = item
                    del running[i]
                    if result is None:
                        raise RuntimeError(f"request {rid} ended without a result")
                    n = len(result.token_ids)
                    if rid in ended_by_us:
                        out.tail_tokens += n
                        return
                    if not result.aborted:
                        if n != max_tokens:  # ignore_eos: a resumed request lost or repeated tokens
                            out.num_wrong_length += 1
                        out.useful_tokens += n
                        out.num_completed += 1
                        out.num_preemptions += result.num_preemptions
                        out.completions.append((time.perf_counter() - t0, n))
                        break
                    # Ended by an update: the restart strategy starts the prompt over.
                    out.wasted_client += n
                    out.num_restarts += 1
                    attempt += 1
                    if stop.is_set():
                        return

        async def updater() -> None:
            calls: list[tuple[int, float]] = []
            j = 1
            while j * args.every < total_s - 1e-9:
                delay = t0 + j * args.every - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = time.perf_counter()
                out.updates.append(t - t0)
                out.update_call_ms.append(await self.update())
                calls.append((self.version, t))
                j += 1
            # The last update's first token may still be on its way when the window closes.
            deadline = time.perf_counter() + max(1.0, args.every)
            while any(v not in first_chunk for v, _ in calls) and time.perf_counter() < deadline:
                await asyncio.sleep(0.005)
            out.pauses_ms.extend((first_chunk[v] - t) * 1e3 for v, t in calls if v in first_chunk)

        async def window_open() -> tuple[int, int, float]:
            await asyncio.sleep(max(0.0, t0 + out.ramp_s - time.perf_counter()))
            return await engine_counts(self.sup)

        lanes = [asyncio.create_task(lane(i)) for i in range(args.inflight)]
        updates = asyncio.create_task(updater())
        opened = asyncio.create_task(window_open())
        await asyncio.sleep(max(0.0, t0 + total_s - time.perf_counter()))
        tokens_open, _, cpu_open = await opened
        out.wall_s = time.perf_counter() - t0
        tokens_close, _, cpu_close = await engine_counts(self.sup)
        stop.set()
        for rid in list(running.values()):
            ended_by_us.add(rid)
            await self.client.abort(rid)
        await asyncio.gather(*lanes)
        await updates  # its last pause may still have been waiting for a token
        tokens1, requests1, _ = await engine_counts(self.sup)
        out.engine_tokens, out.engine_requests = tokens1 - tokens0, requests1 - requests0
        out.engine_tokens_window = tokens_close - tokens_open
        out.engine_cpu_window_s = cpu_close - cpu_open
        return out


def fleet_config(args: Any) -> tuple[FleetConfig, list[tuple[str, Any]], int]:
    """The fleet, the weights every update sends, and the vocabulary size prompts draw from."""
    import torch

    # Frequent updates interrupt a long request many times; that is the point, not a failure.
    shared = dict(num_workers=args.workers, frontend_addr=None, max_resume_attempts=1_000_000)
    if args.engine == "torch":
        from rollfleet.engines.tiny import TINY_LLAMA, tiny_llama_model

        model = tiny_llama_model(args.seed)
        weights = [(name, t.detach().clone()) for name, t in model.state_dict().items()]
        options = {"seed": args.seed, "max_batch_size": max(args.inflight, 1)}
        return FleetConfig(engine="torch", engine_options=options, **shared), weights, TINY_LLAMA["vocab_size"]
    options = {"tokens_per_s": args.echo_tokens_per_s}
    return FleetConfig(engine="echo", engine_options=options, **shared), [("offset", torch.tensor([0]))], 32000


async def measure(args: Any) -> tuple[list[Phase], float]:
    config, weights, vocab = fleet_config(args)
    t = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        sups = [Supervisor(config) for _ in range(1 if args.sequential else len(STRATEGIES))]
        for sup in sups:
            stack.push_async_callback(sup.shutdown)
        await asyncio.gather(*(sup.start() for sup in sups))
        start_s = time.perf_counter() - t
        benches = [Bench(sup, args, weights, vocab) for sup in sups]
        await asyncio.gather(*(b.warm_up() for b in benches))
        phases: list[Phase] = []
        for r in range(args.rounds):
            if args.sequential:  # one fleet, strategies in turns: A B B A ...
                for strategy in STRATEGIES if r % 2 == 0 else reversed(STRATEGIES):
                    phases.append(await benches[0].phase(strategy, len(phases)))
                    report_window(phases[-1], r)
            else:  # a fleet per strategy, side by side: the same machine state for both
                done = await asyncio.gather(*(b.phase(s, r) for b, s in zip(benches, STRATEGIES)))
                for p in done:
                    report_window(p, r)
                phases += done
    return phases, start_s


def report_window(p: Phase, r: int) -> None:
    print(f"  round {r + 1} {p.strategy:8s}: {p.useful_window / p.window_s:,.0f} useful tokens/s, "
          f"{p.engine_tokens_window / p.window_s:,.0f} generated", flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def metrics(args: Any, phases: list[Phase]) -> dict[str, Any]:
    m: dict[str, Any] = {
        "quick": args.quick, "engine": args.engine, "workers": args.workers, "inflight": args.inflight,
        "max_tokens": args.max_tokens, "spread": args.spread, "prompt_len": args.prompt_len,
        "duration_s": args.duration, "update_every_s": args.every, "rounds": args.rounds,
        "side_by_side": not args.sequential,
    }
    for s in STRATEGIES:
        ps = [p for p in phases if p.strategy == s]
        window = sum(p.window_s for p in ps)
        wasted = sum(p.wasted_tokens for p in ps)
        engine = sum(p.engine_tokens for p in ps)
        num_updates = sum(len(p.updates) for p in ps)
        pauses = [x for p in ps for x in p.pauses_ms]
        calls = [x for p in ps for x in p.update_call_ms]
        m[f"{s}_tps"] = sum(p.useful_window for p in ps) / window
        m[f"generated_tps_{s}"] = sum(p.engine_tokens_window for p in ps) / window
        # Per CPU second the engines got: fair between strategies even when other work on the
        # machine gave one fleet's worker more CPU than the other's.
        cpu = sum(p.engine_cpu_window_s for p in ps)
        m[f"engine_cpu_share_{s}"] = cpu / window
        m[f"useful_per_cpu_s_{s}"] = sum(p.useful_window for p in ps) / cpu if cpu > 0 else None
        m[f"useful_tokens_{s}"] = sum(p.useful_tokens for p in ps)
        m[f"generated_tokens_{s}"] = engine
        m[f"wasted_tokens_{s}"] = wasted
        m[f"wasted_tokens_{s}_client"] = sum(p.wasted_client for p in ps)
        m[f"wasted_per_update_{s}"] = wasted / num_updates if num_updates else 0.0
        m[f"wasted_fraction_{s}"] = wasted / max(1, engine)
        m[f"tail_tokens_{s}"] = sum(p.tail_tokens for p in ps)
        m[f"completed_{s}"] = sum(p.num_completed for p in ps)
        # When restart keeps losing long requests, the ones it completes are shorter: a length bias.
        m[f"completed_mean_tokens_{s}"] = (sum(p.useful_tokens for p in ps) / m[f"completed_{s}"]
                                           if m[f"completed_{s}"] else None)
        m[f"restarts_{s}"] = sum(p.num_restarts for p in ps)
        m[f"wrong_length_{s}"] = sum(p.num_wrong_length for p in ps)
        m[f"preemptions_{s}"] = sum(p.num_preemptions for p in ps)
        m[f"engine_requests_{s}"] = sum(p.engine_requests for p in ps)
        m[f"updates_{s}"] = num_updates
        m[f"pauses_measured_{s}"] = len(pauses)
        m[f"update_pause_ms_{s}"] = median(pauses)
        m[f"update_pause_max_ms_{s}"] = max(pauses) if pauses else None
        m[f"update_call_ms_{s}"] = median(calls)
        m[f"window_s_{s}"] = window
    m["update_pause_ms"] = m["update_pause_ms_resume"]  # the library's default path
    m["resume_vs_restart_tps"] = m["resume_tps"] / m["restart_tps"] if m["restart_tps"] else None
    if m.get("useful_per_cpu_s_resume") and m.get("useful_per_cpu_s_restart"):
        m["resume_vs_restart_per_cpu"] = m["useful_per_cpu_s_resume"] / m["useful_per_cpu_s_restart"]
    return {k: v for k, v in m.items() if v is not None}


def report(m: dict[str, Any]) -> None:
    title = (f"{m['inflight']} requests in flight on {m['workers']} {m['engine']} worker(s), max_tokens "
             f"{m['max_tokens']}±{m['spread']:.0%}, prompt {m['prompt_len']}, update every {m['update_every_s']:g} s, "
             f"{m['rounds']}x{m['duration_s']:g} s measured per strategy "
             f"{'side by side' if m['side_by_side'] else 'in turns'}; {m['machine_cores']} cores, "
             f"load {m['machine_load_1m']} at start, {m['load_1m_end']} at end{' (quick)' if m['quick'] else ''}")
    print()
    print_table(["strategy", "useful tok/s", "generated tok/s", "engine CPU", "useful tok/CPU-s", "completed",
                 "mean tokens", "wasted tokens", "wasted (client)", "wasted/update", "wasted %"],
                [(s, m[f"{s}_tps"], m[f"generated_tps_{s}"], m[f"engine_cpu_share_{s}"],
                  m.get(f"useful_per_cpu_s_{s}"), m[f"completed_{s}"], m.get(f"completed_mean_tokens_{s}"),
                  m[f"wasted_tokens_{s}"], m[f"wasted_tokens_{s}_client"], m[f"wasted_per_update_{s}"],
                  100 * m[f"wasted_fraction_{s}"]) for s in STRATEGIES],
                title=title)
    print()
    print_table(["strategy", "updates", "restarts", "resumes", "engine requests", "pause p50 ms", "pause max ms",
                 "update call p50 ms"],
                [(s, m[f"updates_{s}"], m[f"restarts_{s}"], m[f"preemptions_{s}"], m[f"engine_requests_{s}"],
                  m.get(f"update_pause_ms_{s}"), m.get(f"update_pause_max_ms_{s}"), m.get(f"update_call_ms_{s}"))
                 for s in STRATEGIES])
    ratio, per_cpu = m.get("resume_vs_restart_tps"), m.get("resume_vs_restart_per_cpu")
    print(f"\nresume / restart useful tokens/s: {ratio:.2f}x" if ratio is not None else "\nrestart completed nothing", end="")
    print(f"; per engine CPU second: {per_cpu:.2f}x" if per_cpu is not None else "")
    print("engine CPU: cores' worth the engine processes got; pause: from the update_weights call to the "
          "first token of the new version at a client; mean tokens: per completed request")
    for s in STRATEGIES:
        if m[f"wrong_length_{s}"]:
            print(f"WARNING: {m[f'wrong_length_{s}']} completed {s} requests do not hold max_tokens tokens")
    print(f"fleet start {m['start_s']:.1f} s, {m['elapsed_s']:.0f} s in all")


def plot(path: str, phases: list[Phase], every: float) -> bool:
    """Tokens/s over time with the update marks, and cumulative useful tokens, per strategy
    (the first window of each). Returns False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = {"resume": "tab:blue", "restart": "tab:red"}
    for s in STRATEGIES:
        p = next(p for p in phases if p.strategy == s)
        bins = [0] * int(p.wall_s / BIN_S)  # whole bins only: a partial last one would dip
        for t, n in p.chunks:
            if t < len(bins) * BIN_S:
                bins[int(t / BIN_S)] += n
        left.plot([(i + 0.5) * BIN_S for i in range(len(bins))], [b / BIN_S for b in bins],
                  color=colors[s], label=f"{s}: generated")
        done = sorted(p.completions)
        right.step([0.0] + [t for t, _ in done], list(itertools.accumulate([0] + [n for _, n in done])),
                   where="post", color=colors[s], label=s)
        for u in p.updates:
            left.axvline(u, color=colors[s], linestyle=":", alpha=0.5)
    ramp = phases[0].ramp_s
    for ax in (left, right):
        ax.axvspan(0, ramp, color="0.9", zorder=0)  # the ramp: not in the measured window
    for ax, ylabel, title in ((left, "tokens / s reaching clients",
                               f"generation rate; dotted: update_weights every {every:g} s; grey: ramp"),
                              (right, "tokens of completed requests", "useful tokens, cumulative")):
        ax.set_xlabel("seconds")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True



def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--engine", choices=("torch", "echo"), default="torch",
                        help="torch: the tiny random Llama, real forward passes on the CPU; echo: no model, "
                             "tokens paced by --echo-tokens-per-s (default torch).")
    parser.add_argument("--workers", type=int, default=1, help="Engine worker processes per fleet (default 1).")
    parser.add_argument("--inflight", type=int, default=32, help="Requests kept in flight, lanes (default 32).")
    parser.add_argument("--max-tokens", type=int, default=128, help="Mean max_tokens of a request (default 128).")
    parser.add_argument("--spread", type=finite_float, default=0.5,
                        help="max_tokens is drawn uniformly from mean*(1 +- spread), so lanes stay out of step "
                             "(default 0.5).")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="Tokens of every prompt, random ids (default 16).")
    parser.add_argument("--duration", type=finite_float,
                        help="Seconds of each measurement window, after a ramp of one update interval "
                             "(default 30; --quick 8).")
    parser.add_argument("--every", type=finite_float, help="Seconds between weight updates (default 3; --quick 2).")
    parser.add_argument("--rounds", type=int, help="Measured windows per strategy (default 3; --quick 1).")
    parser.add_argument("--sequential", action="store_true",
                        help="One fleet, strategies in turns (A B B A ...), instead of a fleet per strategy "
                             "side by side (for a machine that cannot hold two fleets, e.g. one GPU).")
    parser.add_argument("--echo-tokens-per-s", type=finite_float, default=100.0,
                        help="Per-request pace of the echo engine, tokens/s (default 100; 0: as fast as possible; "
                             "torch ignores it).")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seed of the prompts and their max_tokens and, with torch, of the tiny model's "
                             "weights and the engine (default 0).")
    args = parser.parse_args(argv)
    quick_defaults(args, duration=(8.0, 30.0), every=(2.0, 3.0), rounds=(1, 3))
    if min(args.workers, args.inflight, args.max_tokens, args.prompt_len, args.rounds) < 1:
        parser.error("--workers, --inflight, --max-tokens, --prompt-len and --rounds must be >= 1")
    if args.echo_tokens_per_s < 0:
        parser.error("--echo-tokens-per-s must be >= 0 (0: unpaced)")
    if not 0 <= args.spread < 1:
        parser.error("--spread must be in [0, 1)")
    if args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.every <= 0 or args.duration < args.every:
        parser.error("--every must be > 0 and at most --duration")
    if args.engine == "torch" and args.prompt_len + round(args.max_tokens * (1 + args.spread)) >= 512:
        parser.error("the tiny model holds 512 positions: lower --prompt-len, --max-tokens or --spread")
    logging.basicConfig(level=logging.WARNING)

    t0 = time.perf_counter()
    machine = machine_info()  # before the run: the load average is other work, not ours
    phases, start_s = run_loop(measure(args))
    m = metrics(args, phases)
    m["start_s"] = start_s
    m["load_1m_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0
    m["elapsed_s"] = time.perf_counter() - t0
    m.update(machine)
    report(m)
    if args.json:
        write_json(args.json, m)
        print(f"wrote {args.json}")
    png = png_path(args)
    if png and plot(png, phases, args.every):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
