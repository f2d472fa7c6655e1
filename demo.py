"""The demo behind ``rollfleet demo``: a small fleet, a batch of rollouts, one abort, a summary."""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
import time
from collections import Counter
from typing import Any

from .actors import FleetConfig, Supervisor
from .actors.result import GenerationResult
from .errors import RolloutError
from .transport.messages import SamplingParams

__all__ = ["run_demo", "summarize"]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: list[GenerationResult], errors: int, elapsed: float, stats: dict[str, Any]) -> list[tuple[str, str]]:
    tokens = sum(len(r.token_ids) for r in results)
    latencies = [r.timings.get("total", 0.0) for r in results]
    versions = sorted({v for r in results for v in r.weight_versions})
    by_version = Counter(v for r in results for v in r.token_weight_versions())
    return [
        ("requests", str(len(results) + errors)),
        ("completed", str(sum(1 for r in results if not r.aborted))),
        ("aborted", str(sum(1 for r in results if r.aborted))),
        ("failed", str(errors)),
        ("resumed (preemptions)", str(sum(r.num_preemptions for r in results))),
        ("tokens generated", str(tokens)),
        ("tokens/s", f"{tokens / elapsed:.1f}" if elapsed > 0 else "-"),
        ("latency p50 (s)", f"{_percentile(latencies, 0.5):.3f}"),
        ("latency p99 (s)", f"{_percentile(latencies, 0.99):.3f}"),
        ("weight versions seen", ", ".join(map(str, versions)) or "-"),
        ("tokens by weight version", ", ".join(f"v{v}: {n}" for v, n in sorted(by_version.items())) or "-"),
        ("workers", ", ".join(f"{w['worker_id']}@{w['device']}" for w in stats["workers"])),
    ]


def _same_weights(engine: str, seed: int) -> list[tuple[str, Any]]:
    """The weights the workers already hold, as a trainer would push them after a step."""
    import torch

    if engine == "echo":
        return [("offset", torch.tensor([0]))]
    from .engines.tiny import tiny_llama_model

    return [(name, p.detach()) for name, p in tiny_llama_model(seed).named_parameters()]


def _print_table(rows: list[tuple[str, str]], out: Any = sys.stdout) -> None:
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 20), file=out)
    for key, value in rows:
        print(f"{key:<{width}}  {value}", file=out)
    print("-" * (width + 20), file=out)


async def run_demo(*, engine: str = "torch", num_workers: int = 2, num_requests: int = 64, max_tokens: int = 96,
                   model: str | None = None, update_weights: bool = True, seed: int = 0) -> dict[str, Any]:
    """Run the demo and return its summary as a dict (also printed)."""
    scratch: list[str] = []  # a model directory the demo wrote, removed whatever happens
    try:
        return await _run_demo(engine, num_workers, num_requests, max_tokens, model, update_weights, seed, scratch)
    finally:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)


async def _run_demo(engine: str, num_workers: int, num_requests: int, max_tokens: int, model: str | None,
                    update_weights: bool, seed: int, scratch: list[str]) -> dict[str, Any]:
    from tqdm import tqdm

    options: dict[str, Any] = {}
    if engine in ("torch", "vllm"):
        if model is None and engine == "vllm":
            import tempfile

            from .engines.tiny import build_tiny_llama

            scratch.append(tempfile.mkdtemp(prefix="rollfleet-demo-model-"))
            model = build_tiny_llama(scratch[-1], seed=seed)
        if model is not None:
            options["model"] = model
        options.setdefault("seed", seed)
    elif engine == "echo":
        options["tokens_per_s"] = 400
    # vLLM on a CPU takes 20-30 s per engine to start, more on a busy machine. The update below
    # goes out once the running requests are a third of the way through, as their workers'
    # reports say: reports every 20 ms (the fleet's default is 0.5 s) show that within requests
    # that take a fraction of a second here.
    config = FleetConfig(engine=engine, engine_options=options, num_workers=num_workers,
                         start_timeout_s=600.0 if engine == "vllm" else 120.0, report_interval_s=0.02)
    rng = random.Random(seed)
    print(f"starting {num_workers} {engine} workers ...", flush=True)
    t_start = time.monotonic()
    # The weights the update pushes are built while the workers start (the first build imports
    # transformers: seconds on a small CPU), not on the rollouts' clock.
    weights = asyncio.ensure_future(asyncio.to_thread(_same_weights, engine, seed)) if update_weights else None
    async with Supervisor(config) as fleet:
        print(f"fleet ready in {time.monotonic() - t_start:.1f}s; frontend at {fleet.frontend_address}", flush=True)
        client = fleet.client()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 16))] for _ in range(num_requests)]
        results: list[GenerationResult] = []
        errors = 0
        new_weights = await weights if weights is not None else []
        t0 = time.monotonic()
        tasks = {asyncio.create_task(client.generate(f"demo-{i}", p, params)): i for i, p in enumerate(prompts)}
        to_abort = f"demo-{num_requests - 1}"

        async def abort_one() -> None:
            await asyncio.sleep(0.05)
            if not await client.abort(to_abort):
                tqdm.write(f"{to_abort} had finished before its abort (nothing to stop)", file=sys.stdout)

        update = ["skipped" if not update_weights else "not done"]

        async def update_midway() -> None:
            # Once the running requests are a third of the way through, push weights (same
            # values, version 1): they are interrupted and resume with their partial output.
            while True:
                running = [e for e in fleet.table if e.inner_id is not None]
                if not running and all(t.done() for t in tasks):  # failed ones included
                    break
                if running and sum(len(e.token_ids) for e in running) >= len(running) * max_tokens // 3:
                    break
                await asyncio.sleep(0.002)
            running = sum(1 for e in fleet.table if e.inner_id is not None)
            try:
                report = await client.update_weights(new_weights, version=1)
                update[0] = "version 1"
                tqdm.write(f"pushed weights version 1 ({report.bytes} bytes, {report.seconds * 1e3:.0f} ms) "
                           + (f"while {running} requests were running" if running else "after the requests ended"),
                           file=sys.stdout)
            except RolloutError as exc:
                update[0] = "failed"
                tqdm.write(f"weight update failed: {exc}", file=sys.stdout)

        side = [asyncio.create_task(abort_one())]
        if update_weights:
            side.append(asyncio.create_task(update_midway()))
        try:
            with tqdm(total=num_requests, desc="rollouts", unit="req", file=sys.stdout) as bar:
                for fut in asyncio.as_completed(tasks):
                    try:
                        results.append(await fut)
                    except RolloutError as exc:
                        errors += 1
                        tqdm.write(f"request failed: {exc}", file=sys.stdout)
                    bar.update(1)
            for t in side:
                await t
        finally:  # interrupted (Ctrl-C): stop what still runs while the fleet is up, quietly
            for t in [*tasks, *side]:
                t.cancel()
            await asyncio.gather(*tasks, *side, return_exceptions=True)
        elapsed = time.monotonic() - t0
        stats = await fleet.stats(engines=False)
    rows = summarize(results, errors, elapsed, stats) + [("weight update", update[0])]
    _print_table(rows)
    print("fleet shut down cleanly", flush=True)
    return dict(rows)
