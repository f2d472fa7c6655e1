"""Soak: mixed load on an echo fleet for a while, with random worker kills and weight updates.

Every request must end as completed (tokens checked exactly), aborted on purpose, or failed
with a typed RolloutError; anything else (an untyped exception, no answer in time, wrong
tokens) is counted as lost. After shutdown no worker process, socket file or shared-memory
segment may remain.

    python bench/soak.py                 # 10 minutes
    python bench/soak.py --quick         # 1 minute
    python bench/soak.py --duration 3600 --workers 8 --json bench/out/soak.json

Exit status 1 when anything was lost, wrong or left behind. It draws no plot: ``--png`` is an
error here.

Keys: ``duration_s`` (seconds of load, measured), ``workers``, ``concurrency``, ``requests`` (every
request that ended, however), ``completed``, ``resumed`` (completed after a resume), ``aborted``
(finish_reason abort, its tokens checked: the soak's own aborts, and requests without resume
that an update ended), ``failed_typed`` (a typed RolloutError),
``lost`` (untyped error, no answer within ``--timeout``, or a load task that did not end),
``wrong_tokens``, ``worker_kills`` (SIGKILL), ``worker_stops`` (SIGSTOP), ``restarts`` (the
supervisor's worker restarts), ``updates_ok``, ``updates_failed``, ``requests_per_s``,
``orphans`` (worker processes alive after shutdown), ``leaked_shm`` (rollfleet segments left in
/dev/shm), ``private_dir_left`` (the supervisor's private directory still there),
``supervisor_rss_growth_mb`` (the bench process's RSS, which holds the supervisor, from the start of
the load to its end), ``supervisor_rss_growth_second_half_mb`` (the same over the load's second half
alone, where one-time allocations such as the first weight update's buffers no longer show; a leak
per request still does), ``error_codes`` (a "code=count, ..." string, "-" when none),
``quick``, ``passed`` (nothing lost, wrong or left behind); and the machine facts ``machine_*``
of bench/common.py (``MACHINE_KEYS``), read before the load starts.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections import Counter


from common import (bench_parser, finite_float, machine_info, print_table, quick_defaults, run_loop, run_main,
                    stop_signals, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

import psutil

from rollfleet.actors import FleetConfig, RestartPolicy, Supervisor
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import RolloutError, WeightUpdateError
from rollfleet.transport.messages import SamplingParams
from rollfleet.weights.shm import SHM_DIR


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.pids: set[int] = set()
        self.stop = asyncio.Event()
        self.next_id = 0

    async def one(self, client) -> None:
        rng = self.rng
        self.next_id += 1
        rid = f"q{self.next_id}"
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 9))]
        n = rng.randrange(1, 200)
        resume = rng.random() > 0.1
        stream = rng.random() < 0.3
        abort_after = rng.uniform(0.01, 0.3) if rng.random() < 0.05 else None
        params = SamplingParams(max_tokens=n)
        try:
            if abort_after is not None:
                asyncio.get_running_loop().call_later(abort_after, lambda: asyncio.ensure_future(client.abort(rid)))
            if stream:
                streamed, result = [], None
                async for item in client.stream(rid, prompt, params, resume=resume, timeout=self.args.timeout):
                    if hasattr(item, "finish_reason"):
                        result = item
                    else:
                        streamed.extend(item.token_ids)
                if streamed != result.token_ids:
                    self.counts["wrong"] += 1
                    return
            else:
                result = await client.generate(rid, prompt, params, resume=resume, timeout=self.args.timeout)
        except RolloutError as exc:
            if exc.code == "timeout":
                self.counts["lost"] += 1  # no answer within the deadline
            else:
                self.counts["failed_typed"] += 1
                self.errors[exc.code] += 1
            return
        except Exception as exc:  # untyped: a bug
            self.counts["lost"] += 1
            self.errors[type(exc).__name__] += 1
            return
        want = echo_tokens(prompt, n)
        if result.finish_reason == "abort":
            ok = result.token_ids == want[: len(result.token_ids)]
            self.counts["aborted" if ok else "wrong"] += 1
            return
        if result.token_ids != want:
            self.counts["wrong"] += 1
            return
        self.counts["completed"] += 1
        if result.num_preemptions:
            self.counts["resumed"] += 1

    async def load(self, client) -> None:
        while not self.stop.is_set():
            await self.one(client)

    async def chaos(self, sup) -> None:
        loop = asyncio.get_running_loop()
        next_kill = loop.time() + self.args.kill_every
        while not self.stop.is_set():
            await asyncio.sleep(0.2)
            self.pids |= {h.pid for h in sup.workers.values()}
            if loop.time() < next_kill:
                continue
            next_kill = loop.time() + self.args.kill_every * self.rng.uniform(0.5, 1.5)
            ready = sup.ready_workers()
            if len(ready) < 2:
                continue  # keep one worker serving
            victim = self.rng.choice(ready)
            sig = signal.SIGKILL if self.rng.random() < 0.7 else signal.SIGSTOP
            try:
                os.kill(victim.pid, sig)
                self.counts["kills" if sig == signal.SIGKILL else "stops"] += 1
            except ProcessLookupError:
                pass

    async def updates(self, client) -> None:
        import torch

        version = 0
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), self.args.update_every)
                return
            except asyncio.TimeoutError:
                pass
            version += 1
            tensors = [("offset", torch.tensor([0])), ("layer.weight", torch.zeros(1 << 18))]
            try:
                await client.update_weights(tensors, version=version)
                self.counts["updates_ok"] += 1
            except WeightUpdateError:
                self.counts["updates_failed"] += 1  # typed; a worker died during it

    async def run(self) -> dict:
        args = self.args
        cfg = FleetConfig(
            engine="echo", num_workers=args.workers, engine_options={"tokens_per_s": args.tokens_per_s},
            # 10 s, not less: a worker blocks its loop importing torch on its first weight update.
            heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0, stall_timeout_s=30.0,
            restart=RestartPolicy(max_restarts=10_000, window_s=60.0, backoff_s=0.1, max_backoff_s=1.0),
            weights={"transport": "shm", "bucket_bytes": 1 << 20}, max_resume_attempts=32)
        sup = Supervisor(cfg)
        await sup.start()
        private_dir = sup.private_dir
        client = sup.client()
        me = psutil.Process()
        rss0 = me.memory_info().rss
        t0 = time.monotonic()
        tasks = [asyncio.create_task(self.load(client)) for _ in range(args.concurrency)]
        tasks += [asyncio.create_task(self.chaos(sup)), asyncio.create_task(self.updates(client))]
        rss_half: int | None = None
        try:
            # RSS at half time too: what the first weight updates and the fleet's first restarts
            # allocate once lands in the first half; a per-request leak grows in both.
            await asyncio.sleep(args.duration / 2)
            rss_half = me.memory_info().rss
            await asyncio.sleep(args.duration / 2)
        finally:
            self.stop.set()
            done, pending = await asyncio.wait(tasks, timeout=args.timeout + 30)
            for t in pending:
                t.cancel()
            self.counts["lost"] += len(pending)  # a load task stuck past every deadline
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    self.counts["lost"] += 1
                    self.errors[repr(t.exception())[:60]] += 1
            elapsed = time.monotonic() - t0
            stats = await sup.stats(engines=False)
            self.pids |= {h.pid for h in sup.workers.values()}
            rss1 = me.memory_info().rss
            await sup.shutdown()
        time.sleep(1.0)  # let killed processes be reaped
        orphans = [p for p in self.pids if _alive(p)]
        orphans += [c.pid for c in me.children(recursive=True) if c.pid not in orphans and _alive(c.pid)]
        prefixes = tuple(f"rf-{pid}-" for pid in {os.getpid(), *self.pids})
        leaked = [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)] if os.path.isdir(SHM_DIR) else []
        c = self.counts
        total = c["completed"] + c["aborted"] + c["failed_typed"] + c["lost"] + c["wrong"]
        return {
            "duration_s": round(elapsed, 1), "workers": args.workers, "concurrency": args.concurrency,
            "requests": total, "completed": c["completed"], "resumed": c["resumed"], "aborted": c["aborted"],
            "failed_typed": c["failed_typed"], "lost": c["lost"], "wrong_tokens": c["wrong"],
            "worker_kills": c["kills"], "worker_stops": c["stops"], "restarts": sum(w["restarts"] for w in stats["workers"]),
            "updates_ok": c["updates_ok"], "updates_failed": c["updates_failed"],
            "requests_per_s": round(total / elapsed, 1) if elapsed else 0.0,
            "orphans": len(orphans), "leaked_shm": len(leaked), "private_dir_left": os.path.exists(private_dir),
            "supervisor_rss_growth_mb": round((rss1 - rss0) / 2**20, 1),
            "supervisor_rss_growth_second_half_mb": round((rss1 - rss_half) / 2**20, 1) if rss_half is not None else None,
            "error_codes": ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "-",
            "quick": bool(args.quick),
        }


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    parser = bench_parser(__doc__)
    parser._option_string_actions["--png"].help = "Not supported: soak.py draws no plot."
    parser.add_argument("--duration", type=finite_float, default=None, help="Seconds of load (default 600; --quick 60).")
    parser.add_argument("--workers", type=int, default=4, help="Echo workers, at least 2 (default 4).")
    parser.add_argument("--concurrency", type=int, default=64, help="Requests kept in flight (default 64).")
    parser.add_argument("--kill-every", type=finite_float, default=None, help="Mean seconds between worker kills (default 15; --quick 6).")
    parser.add_argument("--update-every", type=finite_float, default=None, help="Seconds between weight updates (default 20; --quick 8).")
    parser.add_argument("--tokens-per-s", type=finite_float, default=500.0,
                        help="Echo pacing per request (default 500; 0: as fast as possible).")
    parser.add_argument("--timeout", type=finite_float, default=120.0,
                        help="Per-request deadline, seconds; past it a request is lost (default 120).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the requests, kills and signals (default 0).")
    args = parser.parse_args()
    quick_defaults(args, duration=(60.0, 600.0), kill_every=(6.0, 15.0), update_every=(8.0, 20.0))
    if args.workers < 2:
        parser.error("--workers must be >= 2 (one always stays up while another is killed)")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if min(args.duration, args.kill_every, args.update_every, args.timeout) <= 0 or args.tokens_per_s < 0:
        parser.error("--duration, --kill-every, --update-every and --timeout must be > 0, --tokens-per-s >= 0")
    if args.png:
        parser.error("soak.py draws no plot: --png is not supported")
    print(f"soak: {args.duration:.0f}s, {args.workers} echo workers, {args.concurrency} in flight, "
          f"a kill every ~{args.kill_every:.0f}s, an update every {args.update_every:.0f}s")
    machine = machine_info()  # before the run: the load average is other work, not ours
    metrics = run_loop(Soak(args).run(), use_uvloop=False)
    rows = [(k, v) for k, v in metrics.items()]
    print_table(["metric", "value"], rows,
                title=f"soak results; {machine['machine_cores']} cores, {machine['machine_memory_gb']} GB, "
                      f"{machine['machine_cpu']}, load {machine['machine_load_1m']}")
    bad = metrics["lost"] + metrics["wrong_tokens"] + metrics["orphans"] + metrics["leaked_shm"]
    bad += int(metrics["private_dir_left"])
    if args.json:
        write_json(args.json, {**metrics, **machine, "passed": bad == 0})
    print("PASSED" if bad == 0 else "FAILED: requests lost or resources left behind")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
