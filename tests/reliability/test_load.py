"""Load: many concurrent requests complete, the in-flight table empties, memory stays
bounded, and a client over its in-flight cap gets a clear 'overloaded' error."""

from __future__ import annotations

import asyncio
import gc
import itertools
import tracemalloc

import psutil
import pytest

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.errors import Overloaded
from rollfleet.transport.messages import SamplingParams

from .helpers import assert_clean, expected_tokens, fleet, worker_pids

pytestmark = pytest.mark.usefixtures("no_leaks")


def rss_mb(pids=()):
    total = psutil.Process().memory_info().rss
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def assert_empty(sup):
    assert len(sup.table) == 0 and sup.table.num_inner == 0
    assert not sup._pending and not sup._per_origin


@pytest.mark.slow
async def test_10k_concurrent_requests_over_4_echo_workers_complete_with_bounded_memory():
    sup = fleet(4, max_sticky=2000)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()

        async def one(i):
            prompt, n = [i % 101 + 1, i % 7], 1 + i % 16
            result = await client.generate(f"r{i}", prompt, SamplingParams(max_tokens=n))
            assert result.token_ids == expected_tokens(prompt, n), i
            return result.worker

        async def wave(start):
            # All 10k submitted at once: nothing paces them but the fleet itself.
            workers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(start, start + 10_000))), 240)
            assert_empty(sup)
            return workers

        used = set(await wave(0))
        assert len(used) == 4, f"only {used} served"
        gc.collect()
        base = rss_mb(pids)
        await wave(10_000)
        await wave(20_000)
        gc.collect()
        grown = rss_mb(pids) - base
        assert sup.counters["completed"] == 30_000 and sup.counters["failed"] == 0
        assert worker_pids(sup) == pids
        # Two more waves of 10k after the warm-up: per-request leftovers would show as tens of MiB.
        assert grown < 64, f"supervisor + workers grew by {grown:.1f} MiB"
    assert_clean(sup.private_dir, pids)


@pytest.mark.slow
async def test_the_python_objects_a_fleet_and_a_remote_client_keep_do_not_grow_with_requests():
    # Finer than RSS: what this process (the supervisor, its in-process client and a RemoteClient)
    # still holds, as tracemalloc counts it, after 40k more requests than a warm-up made. Sessions
    # (reused), streams, aborts and both client paths are in the mix; 1 MiB over 40k requests is
    # 26 bytes a request, far below any per-request leftover (an entry, an id, a sink).
    sup = fleet(2, max_sticky=2000, engine_options={"tokens_per_s": 20_000})  # 5 tokens: 0.25 ms
    aborted = 0
    async with sup:
        local = sup.client()
        async with RemoteClient(sup.frontend_address) as remote:
            ids = itertools.count()

            async def lane(client, n):
                nonlocal aborted
                for _ in range(n):
                    i = next(ids)
                    prompt, tokens = [i % 97 + 1, 3], 1 + i % 5
                    params = SamplingParams(max_tokens=tokens)
                    if i % 50 == 7:
                        *chunks, last = [c async for c in client.stream(f"s{i}", prompt, params)]
                        assert [t for c in chunks for t in c.token_ids] == last.token_ids
                        assert last.token_ids == expected_tokens(prompt, tokens)
                    elif i % 50 == 9:
                        pending = asyncio.create_task(client.generate(
                            f"a{i}", prompt, SamplingParams(max_tokens=2_000), session_id=f"u{i % 13}"))
                        await asyncio.sleep(0.001)
                        await client.abort(f"a{i}")  # (0.1 s of tokens: it is running, as a rule)
                        finish = (await pending).finish_reason
                        assert finish in ("abort", "length")
                        aborted += finish == "abort"
                    else:
                        result = await client.generate(f"r{i}", prompt, params,
                                                       session_id=f"u{i % 13}" if i % 3 == 0 else None)
                        assert result.token_ids == expected_tokens(prompt, tokens), i

            async def phase(n):
                await asyncio.wait_for(asyncio.gather(*(lane(c, n) for c in (local, remote) for _ in range(32))), 240)
                assert_empty(sup)

            await phase(300)  # 19,200 requests: first-use allocations (codec caches, socket buffers)
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                await phase(625)  # 40,000 requests
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
            assert grown < 2**20, f"{grown} bytes still held after 40,000 requests"
            assert sup.counters["failed"] == 0 and aborted > 0


@pytest.mark.slow
async def test_1k_concurrent_requests_over_2_torch_workers_complete():
    pytest.importorskip("torch")
    sup = Supervisor(FleetConfig(engine="torch", num_workers=2, start_timeout_s=240, max_sticky=2000))
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompts = [[(i * 37) % 500 + 1, (i * 11) % 300 + 2, 5] for i in range(50)]
        results = await asyncio.wait_for(asyncio.gather(
            *(client.generate(f"t{i}", prompts[i % 50], greedy) for i in range(1000))), 300)
        by_prompt = {}
        for i, r in enumerate(results):
            assert r.finish_reason == "length" and len(r.token_ids) == 8
            # Greedy decoding: the same prompt gives the same tokens, on either worker, in any batch.
            assert by_prompt.setdefault(i % 50, r.token_ids) == r.token_ids, i
        assert {r.worker for r in results} == {h.worker_id for h in sup.workers.values()}
        assert_empty(sup)
        assert worker_pids(sup) == pids
    assert_clean(sup.private_dir, pids)


async def test_a_client_over_its_inflight_cap_is_refused_with_overloaded():
    sup = fleet(2, engine_options={"tokens_per_s": 100}, max_inflight_per_client=50)
    async with sup:
        client = sup.client()
        params = SamplingParams(max_tokens=10)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], params)) for i in range(60)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, Overloaded)]
        assert len(refused) == 10 and "max_inflight_per_client" in str(refused[0])
        assert all(o.token_ids == expected_tokens([i + 1], 10) for i, o in enumerate(outcomes[:50]))
        # The cap is per client: a remote client has its own, and the local one has room again.
        async with RemoteClient(sup.frontend_address) as remote:
            remote_tasks = [asyncio.create_task(remote.generate(f"x{i}", [3], params)) for i in range(55)]
            local_tasks = [asyncio.create_task(client.generate(f"y{i}", [4], params)) for i in range(50)]
            remote_out = await asyncio.gather(*remote_tasks, return_exceptions=True)
            local_out = await asyncio.gather(*local_tasks, return_exceptions=True)
        assert sum(isinstance(o, Overloaded) for o in remote_out) == 5
        assert all(o.token_ids == expected_tokens([4], 10) for o in local_out)
        assert_empty(sup)
