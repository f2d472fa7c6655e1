"""Partial rollouts on the echo engine: resume across weight updates and dead workers."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal

import pytest
import torch

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.errors import ResumeExhausted, WeightUpdateError
from rollfleet.transport.messages import SamplingParams
from rollfleet.weights.bucket import named_pairs

from .test_fleet_echo import expected_tokens, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")


def fleet(num_workers=2, tokens_per_s=200, **kw):
    return Supervisor(FleetConfig(engine="echo", num_workers=num_workers,
                                  engine_options={"tokens_per_s": tokens_per_s}, **kw))


def offset(value):
    return [("offset", torch.tensor([value]))]


async def running_with_tokens(sup, count):
    """Wait until ``count`` requests run and each has tokens the fleet knows of (a fleet made
    with a short report_interval_s): an update after a fixed sleep could, on a busy machine,
    land before any token, or after a short request ended."""
    return await wait_for(lambda: len(sup.table) == count and all(e.token_ids for e in sup.table), 10.0)


async def test_weight_update_mid_stream_resumes_with_exact_tokens_and_versions():
    N = 200  # 1 s of work at 200 tokens/s
    async with fleet(report_interval_s=0.02) as sup:
        client = sup.client()
        await client.update_weights(offset(0), version=0)  # warm the weights path

        def every_request_made_tokens_under(versions):
            return lambda: len(sup.table) == 6 and all(e.versions == versions for e in sup.table)

        params = SamplingParams(max_tokens=N)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], params)) for i in range(6)]
        # Each update once every request made tokens under the last one (after a fixed sleep, a
        # busy machine could let the next update land before a resumed request made a token).
        assert await wait_for(every_request_made_tokens_under([0]), 10.0)
        report = await client.update_weights(offset(0), version=1)
        assert report.ok
        assert await wait_for(every_request_made_tokens_under([0, 1]), 10.0)
        await client.update_weights(offset(0), version=2)
        for i, t in enumerate(tasks):
            r = await t
            assert r.token_ids == expected_tokens([i + 1], N)
            assert r.finish_reason == "length" and len(r.token_ids) == N
            assert r.num_preemptions == 2 and r.weight_versions == [0, 1, 2]
            assert (r.min_version, r.max_version) == (0, 2)
        assert params.max_tokens == N and params.stop_token_ids == []
        assert len(sup.table) == 0


async def test_new_weights_apply_to_the_resumed_part_only():
    async with fleet(1, report_interval_s=0.02) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [3], SamplingParams(max_tokens=100)))
        assert await running_with_tokens(sup, 1)  # 0.5 s of work in all
        await client.update_weights(offset(7), version=1)
        r = await task
        # The tokens before the update follow the old weights; the rest continue from them
        # under the new ones (offset 7).
        first = next(k for k in range(1, 101) if r.token_ids[:k] != expected_tokens([3], k)) - 1
        assert 0 < first < 100
        rest = expected_tokens([3] + r.token_ids[:first], 100 - first, offset=7)
        assert r.token_ids[first:] == rest and r.weight_versions == [0, 1] and r.num_preemptions == 1


async def test_each_token_says_which_weights_made_it_streamed_or_not():
    # An update splits each request in two. The result says where the second segment begins,
    # and that is where the tokens start to follow the new weights (offset 7); the streamed
    # request's chunks say the same version for the same tokens. Through the frontend too.
    N = 100
    async with fleet(1, report_interval_s=0.05) as sup:
        client = sup.client()
        async with RemoteClient(sup.frontend_address) as remote:
            plain = asyncio.create_task(client.generate("plain", [3], SamplingParams(max_tokens=N)))
            outside = asyncio.create_task(remote.generate("outside", [4], SamplingParams(max_tokens=N)))
            chunks, final = [], []

            async def streamed() -> None:
                async for item in client.stream("streamed", [5], SamplingParams(max_tokens=N)):
                    (final if hasattr(item, "finish_reason") else chunks).append(item)

            stream_task = asyncio.create_task(streamed())
            # all three running, each with some tokens the fleet holds (0.5 s of work each)
            assert await wait_for(lambda: len(sup.table) == 3 and all(e.token_ids for e in sup.table), 10.0)
            await client.update_weights(offset(7), version=1)
            results = {3: await plain, 4: await outside}
            await stream_task
        results[5] = final[0]
        for prompt, r in results.items():
            first = next(k for k in range(1, N + 1) if r.token_ids[:k] != expected_tokens([prompt], k)) - 1
            assert 0 < first < N, r
            assert r.token_ids[first:] == expected_tokens([prompt] + r.token_ids[:first], N - first, offset=7)
            assert r.weight_versions == [0, 1] and r.weight_version_starts == [0, first], r
            assert r.token_weight_versions() == [0] * first + [1] * (N - first)
        per_chunk = [v for c in chunks for v in [c.weight_version] * len(c.token_ids)]
        assert per_chunk == results[5].token_weight_versions()


async def test_a_resume_after_a_dead_worker_starts_a_segment_where_the_kept_tokens_end():
    # 100 tokens at 200 tokens/s: 0.5 s of work, and the worker dies some 0.05-0.1 s into it.
    async with fleet(2, report_interval_s=0.05, deterministic_routing=True) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [6], SamplingParams(max_tokens=100)))
        assert await wait_for(lambda: any(e.token_ids for e in sup.table), 5.0)
        kept = len(next(iter(sup.table)).token_ids)
        victim = next(slot for slot in sup.slots.values() if sup.table.on_worker(slot.worker_id))
        os.kill(victim.pid, signal.SIGKILL)
        r = await task
        assert r.token_ids == expected_tokens([6], 100) and r.num_preemptions == 1
        assert r.weight_versions == [0, 0]
        starts = r.weight_version_starts
        assert starts[0] == 0 and kept <= starts[1] < 100, (kept, starts)
        assert r.token_weight_versions() == [0] * 100


async def test_a_resumed_requests_worker_time_adds_up_its_attempts():
    # 100 tokens at 200 tokens/s: at least 0.5 s of engine time over both attempts, however the
    # update splits them; the second attempt alone is shorter, and the update's pause between
    # them is the fleet's time, not the workers'.
    async with fleet(1, report_interval_s=0.02) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [3], SamplingParams(max_tokens=100)))
        assert await running_with_tokens(sup, 1)
        await client.update_weights(offset(0), version=1)
        r = await task
        assert r.num_preemptions == 1 and r.weight_versions == [0, 1] and len(r.token_ids) == 100
        assert 0.5 <= r.timings["worker"] <= r.timings["total"]


async def test_hard_abort_requests_return_their_partial_output_on_update():
    async with fleet(1, report_interval_s=0.02) as sup:
        client = sup.client()
        hard = asyncio.create_task(client.generate("hard", [2], SamplingParams(max_tokens=160), resume=False))
        soft = asyncio.create_task(client.generate("soft", [2], SamplingParams(max_tokens=80)))
        assert await running_with_tokens(sup, 2)  # 0.4 s of work left to soft at least
        await client.update_weights(offset(0), version=1)
        h, s = await hard, await soft
        assert h.finish_reason == "abort" and 0 < len(h.token_ids) < 160
        assert h.token_ids == expected_tokens([2], len(h.token_ids)) and h.num_preemptions == 0
        assert s.finish_reason == "length" and s.token_ids == expected_tokens([2], 80) and s.num_preemptions == 1


async def test_worker_sigkill_resumes_its_requests_on_a_healthy_worker():
    async with fleet(2, deterministic_routing=True) as sup:
        client = sup.client()
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=60)))
                 for i in range(6)]
        await asyncio.sleep(0.1)
        victim = sup.slots[0]
        moved = {e.request_id for e in sup.table.on_worker(victim.worker_id)}
        assert moved  # requests were running on it: the checks below are about them
        os.kill(victim.pid, signal.SIGKILL)
        for i, t in enumerate(tasks):
            r = await t
            assert r.token_ids == expected_tokens([i + 1], 60)
            assert r.num_preemptions == (1 if f"r{i}" in moved else 0)
            if f"r{i}" in moved:  # finished on the worker it was resumed on
                assert r.worker == sup.slots[1].worker_id
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10.0)


async def test_a_request_aborted_while_it_waits_to_resume_names_the_worker_it_ran_on():
    # one worker, restarted 2 s after its death: the request waits for it, then is aborted
    from rollfleet.actors import RestartPolicy

    async with fleet(1, tokens_per_s=100, restart=RestartPolicy(backoff_s=2.0)) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [5], SamplingParams(max_tokens=500)))
        assert await wait_for(lambda: len(getattr(sup.table.get("local", "r"), "token_ids", [])) >= 5)
        victim = sup.slots[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.table.get("local", "r").worker_id is None)
        assert await client.abort("r")
        r = await task
        assert r.finish_reason == "abort" and r.num_preemptions == 1 and len(r.token_ids) >= 5
        assert r.worker == victim.worker_id and r.weight_versions == [0]


async def test_resume_attempts_are_bounded():
    async with fleet(1, tokens_per_s=100, max_resume_attempts=1) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [1], SamplingParams(max_tokens=200)))
        await asyncio.sleep(0.05)
        await client.update_weights(offset(0), version=1)
        await asyncio.sleep(0.05)
        await client.update_weights(offset(0), version=2)
        with pytest.raises(ResumeExhausted):
            await task
        stats = await sup.stats()  # resumed once: the second interruption ended it
        assert stats["num_resumed"] == 1 and stats["num_failed"] == 1


async def test_without_kept_weights_a_restarted_worker_is_at_a_version_only_after_an_update_of_everything():
    # keep_last_weights off, tensors not a callable: a worker restarted after version 1 serves
    # its initial weights (version 0). A partial update would leave it with a mix stamped 2
    # (initial offset 0, the other worker's offset 5): it is restarted again instead; an
    # update that sends every name again brings it to that version.
    async with fleet(2, tokens_per_s=0, keep_last_weights=False, deterministic_routing=True) as sup:
        client = sup.client()
        await client.update_weights(offset(5) + [("other", torch.zeros(1))], version=1)
        victim = sup.slots[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 15.0)
        restarted = sup.slots[0]
        assert restarted.weight_version == 0

        async def versions_and_offsets():
            rows = [w for w in (await sup.stats())["workers"] if w["state"] == "ready"]
            return {w["worker_id"]: (w["weight_version"], w["engine_stats"]["offset"]) for w in rows}

        await client.update_weights([("other", torch.ones(1))], version=2)  # "offset" not sent again
        assert await wait_for(lambda: sup.slots[0] is not restarted and sup.slots[0].state.value == "ready", 15.0)
        assert set((await versions_and_offsets()).values()) == {(0, 0), (2, 5)}  # never (2, 0)
        await client.update_weights(offset(5) + [("other", torch.ones(1))], version=3)  # every name again
        assert set((await versions_and_offsets()).values()) == {(3, 5)}
        assert (await sup.stats())["workers"][0]["restarts"] == 2


async def test_restarted_worker_is_brought_to_the_current_version_before_serving():
    async with fleet(2, tokens_per_s=0, deterministic_routing=True) as sup:
        client = sup.client()
        await client.update_weights(offset(5), version=3)
        victim = sup.slots[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 15.0)
        assert sup.slots[0].weight_version == 3
        # Both workers now answer with the offset-5 weights.
        for i in range(6):
            r = await client.generate(f"after{i}", [4], SamplingParams(max_tokens=4))
            assert r.token_ids == expected_tokens([4], 4, offset=5) and r.weight_versions == [3]
        workers = (await sup.stats())["workers"]
        assert [w["weight_version"] for w in workers] == [3, 3]


@pytest.mark.parametrize("kept", ["kept-copy", "callable"])
async def test_a_worker_restarted_after_an_update_labelled_version_0_is_caught_up_all_the_same(kept):
    # Its initial weights are version 0 too: the numbers alone said it was not behind, and it
    # served them beside the updated workers, under the same version.
    async with fleet(2, tokens_per_s=0, deterministic_routing=True) as sup:
        client = sup.client()
        await client.update_weights(offset(5) if kept == "kept-copy" else (lambda: offset(5)), version=0)
        victim = sup.slots[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 15.0)
        workers = (await sup.stats())["workers"]
        assert [(w["weight_version"], w["engine_stats"]["offset"]) for w in workers] == [(0, 5), (0, 5)]
        for i in range(4):
            r = await client.generate(f"after{i}", [4], SamplingParams(max_tokens=4))
            assert r.token_ids == expected_tokens([4], 4, offset=5) and r.weight_versions == [0]


def test_a_ctrl_c_in_the_tensors_generator_comes_out_as_itself_and_the_fleet_is_put_back():
    # It came out as WeightUpdateError. Run apart: a KeyboardInterrupt that left the test's own
    # event loop would stop the test session.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import asyncio, torch
        from rollfleet.actors import FleetConfig, Supervisor
        from rollfleet.transport.messages import SamplingParams

        async def main():
            async with Supervisor(FleetConfig(engine="echo", num_workers=1)) as sup:
                await sup.update_weights([("offset", torch.tensor([2]))], version=1)

                def tensors():
                    yield "offset", torch.tensor([9])
                    yield "big", torch.zeros(1 << 20)  # a second bucket: the first has gone out
                    raise KeyboardInterrupt

                try:
                    await sup.update_weights(tensors(), version=2)
                except KeyboardInterrupt:
                    print("KeyboardInterrupt", flush=True)
                stats = await sup.stats()
                result = await sup.client().generate("r", [4], SamplingParams(max_tokens=3))
                print(stats["weight_version"], [w["engine_stats"]["offset"] for w in stats["workers"]],
                      result.weight_versions, result.token_ids, flush=True)

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["KeyboardInterrupt", f"1 [2] [1] {expected_tokens([4], 3, offset=2)}"], \
        out.stdout + out.stderr


async def assert_both_serve_version_1_offset_3(sup):
    """Both workers of ``sup`` ready at version 1 with offset 3, and serving it."""
    workers = (await sup.stats())["workers"]
    assert [(w["state"], w["weight_version"], w["engine_stats"]["offset"]) for w in workers] == \
        [("ready", 1, 3), ("ready", 1, 3)]
    for i in range(4):
        r = await sup.client().generate(f"after{i}", [4], SamplingParams(max_tokens=3), session_id=f"s{i}")
        assert r.token_ids == expected_tokens([4], 3, offset=3) and r.weight_versions == [1]


async def test_a_worker_that_stalls_past_the_update_timeout_is_put_back_after_its_queued_buckets():
    # The update fails on the stalled worker; the check of what it holds came by stats, which it
    # answered at once with the version before, and only then took its queued buckets and the
    # abort: it served part of the failed update, READY, at -1.
    def update(value, pads=3000):
        yield "offset", torch.tensor([value])
        for i in range(pads):
            yield f"pad{i}", torch.zeros(4096)

    async with fleet(2, tokens_per_s=0, deterministic_routing=True, weights={"timeout_s": 1.0}) as sup:
        client = sup.client()
        for _ in range(5):  # an echo worker's first update imports torch, which may take over 1 s
            try:
                await client.update_weights(update(3), version=1)
                break
            except WeightUpdateError:
                await asyncio.sleep(2)
        assert sup.weight_version == 1
        victim = sup.slots[1]
        task = asyncio.create_task(client.update_weights(update(50), version=2, bucket_bytes=1 << 14))
        await asyncio.sleep(0.3)
        os.kill(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(3)  # past the update's 1 s, short of the heartbeat timeout
        os.kill(victim.pid, signal.SIGCONT)
        with pytest.raises(WeightUpdateError):
            await task
        await asyncio.sleep(1.0)
        await assert_both_serve_version_1_offset_3(sup)


async def test_an_update_cancelled_as_it_fails_still_puts_every_worker_back_before_the_fleet_goes_on():
    # The cancel lands as the repair begins (timed by the failure's log record, where a caller's
    # timeout may fire): the repair stopped there, and the workers it had not reached served the
    # failed update's weights at -1 once the fleet went on.
    def update(value, fail):
        yield "offset", torch.tensor([value])
        for i in range(20):
            yield f"pad{i}", torch.zeros(4096)
        yield "fail", torch.ones(4) if fail else torch.zeros(0)  # (an empty one loads)

    async with fleet(2, tokens_per_s=0, deterministic_routing=True) as sup:
        client = sup.client()
        await client.update_weights(update(3, False), version=1)
        task: asyncio.Task | None = None

        class CancelOnFailure(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "failed" in record.getMessage() and task is not None and not task.done():
                    asyncio.get_running_loop().call_soon(task.cancel)

        hook = CancelOnFailure()
        logging.getLogger("rollfleet.actors.updates").addHandler(hook)
        try:
            task = asyncio.create_task(client.update_weights(update(50, True), version=2, bucket_bytes=4096))
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            logging.getLogger("rollfleet.actors.updates").removeHandler(hook)
        await assert_both_serve_version_1_offset_3(sup)


async def test_failed_first_update_restarts_the_workers_it_left_with_a_mix_of_weights():
    async with fleet(2) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [6], SamplingParams(max_tokens=40)))
        await asyncio.sleep(0.05)
        before = {h.index: h.worker_id for h in sup.ready_workers()}
        # Bucket 0 (the new offset) is applied before bucket 1 fails, and the fleet has no
        # copy of its first weights: the workers are restarted with their initial ones.
        with pytest.raises(WeightUpdateError) as info:
            await client.update_weights(offset(5) + [("fail", torch.zeros(32))], version=1, bucket_bytes=64)
        assert "w" in str(info.value) and "fail" in str(info.value)
        r = await task  # resumed on a restarted worker: offset 0 all along, not 5
        assert r.token_ids == expected_tokens([6], 40) and r.finish_reason == "length"
        assert set(r.weight_versions) == {0}
        assert sup.weight_version == 0
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 15.0)
        assert not set(before.values()) & set(sup.workers)
        workers = (await sup.stats())["workers"]
        assert [(w["weight_version"], w["restarts"]) for w in workers] == [(0, 1), (0, 1)]
        assert all("partly applied" in w["last_error"] for w in workers)
        for i in range(4):
            r = await client.generate(f"after{i}", [4], SamplingParams(max_tokens=5))
            assert r.token_ids == expected_tokens([4], 5) and r.weight_versions == [0]


async def test_an_update_right_after_a_failed_first_one_waits_for_the_restarted_workers():
    # The failed first update restarts the workers; a retry at once is not refused with "no
    # ready worker" while they start again: it waits for them and lands.
    async with fleet(2) as sup:
        client = sup.client()
        with pytest.raises(WeightUpdateError):
            await client.update_weights(offset(5) + [("fail", torch.zeros(32))], version=1, bucket_bytes=64)
        assert not sup.ready_workers()  # both restarting
        report = await client.update_weights(offset(5), version=1)
        assert report.version == 1 and sup.weight_version == 1
        r = await client.generate("after", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=5) and r.weight_versions == [1]
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 15.0)
        assert {h.weight_version for h in sup.ready_workers()} == {1}  # the later one caught up


async def test_without_a_kept_copy_a_failed_update_restarts_to_the_initial_weights_and_says_so(caplog):
    caplog.set_level(logging.WARNING, logger="rollfleet")
    async with fleet(1, tokens_per_s=0, keep_last_weights=False) as sup:
        client = sup.client()
        await client.update_weights(offset(3), version=5)
        r = await client.generate("v5", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=3) and r.weight_versions == [5]
        with pytest.raises(WeightUpdateError):
            await client.update_weights(offset(9) + [("fail", torch.zeros(32))], version=6, bucket_bytes=64)
        # Version 5's tensors are gone: the worker is restarted and serves its initial
        # weights as version 0, never offset 9 under some version.
        r = await client.generate("after", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5) and r.weight_versions == [0]
        assert sup.weight_version == 5
        assert [w["weight_version"] for w in (await sup.stats())["workers"]] == [0]
        assert any("serves weight version 0 while the fleet is at 5" in r.getMessage() for r in caplog.records)
        # The next good update brings it to the fleet's version again.
        await client.update_weights(offset(3), version=7)
        r = await client.generate("v7", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=3) and r.weight_versions == [7]


async def test_a_failed_update_is_repaired_from_the_last_good_versions_source_not_its_own():
    async with fleet(1, tokens_per_s=0) as sup:
        client = sup.client()

        async def offset_now():
            r = await client.generate("probe", [4], SamplingParams(max_tokens=5))  # one at a time: the id is free again
            return [k for k in range(10) if r.token_ids == expected_tokens([4], 5, offset=k)], r.weight_versions

        await client.update_weights(lambda: offset(3), version=1)
        # A failing callable must not become the source the repair calls again.
        with pytest.raises(WeightUpdateError):
            await client.update_weights(lambda: offset(7) + [("fail", torch.zeros(32))], version=2, bucket_bytes=64)
        assert await offset_now() == ([3], [1])
        # A failing list after a callable: the callable (version 1) still restores it.
        with pytest.raises(WeightUpdateError):
            await client.update_weights(offset(9) + [("fail", torch.zeros(32))], version=3, bucket_bytes=64)
        assert await offset_now() == ([3], [1])
        assert [(w["weight_version"], w["restarts"]) for w in (await sup.stats())["workers"]] == [(1, 0)]
        # A committed list replaces the callable; its kept copy restores the next failure.
        await client.update_weights(offset(5), version=4)
        with pytest.raises(WeightUpdateError):
            await client.update_weights(lambda: offset(8) + [("fail", torch.zeros(32))], version=5, bucket_bytes=64)
        assert await offset_now() == ([5], [4])


async def test_bad_update_arguments_fail_before_any_request_is_interrupted():
    async with fleet(1) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [6], SamplingParams(max_tokens=40)))
        await asyncio.sleep(0.05)
        for version in (-1, 1 << 63, 1.0, True, "1"):
            with pytest.raises(ValueError, match="version"):
                await client.update_weights(offset(0), version=version)
        with pytest.raises(ValueError):
            await client.update_weights(offset(0), version=1, bucket_bytes=1)
        with pytest.raises(ValueError):
            await client.update_weights(offset(0), version=1, transport="pigeon")
        r = await task
        assert r.num_preemptions == 0 and r.weight_versions == [0]
        assert (await client.update_weights(offset(0), version=(1 << 63) - 1)).ok
        r = await client.generate("big", [6], SamplingParams(max_tokens=2))
        assert r.weight_versions == [(1 << 63) - 1]


async def test_update_takes_a_state_dict_and_says_what_is_wrong_with_bad_pairs():
    async with fleet(1, tokens_per_s=0) as sup:
        client = sup.client()
        await client.update_weights({"offset": torch.tensor([3])}, version=1)
        await client.update_weights(lambda: {"offset": torch.tensor([3])}, version=2)
        r = await client.generate("r", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=3) and r.weight_versions == [2]
        cases = (([("offset", [3])], "(str, torch.Tensor) pairs, got (str, list)"),
                 ([("offset",)], "(name, tensor) pairs, got tuple"),
                 ([torch.tensor([3])], "(name, tensor) pairs, got Tensor"),
                 ((("offset", torch.tensor([3]), 1),), "(name, tensor) pairs, got tuple"),
                 ({3: torch.tensor([3])}, "(str, torch.Tensor) pairs, got (int, Tensor)"))
        # Built (a list, tuple or dict): refused whole before a running request is interrupted.
        running = asyncio.create_task(client.generate("running", [4], SamplingParams(max_tokens=1 << 40)))
        assert await wait_for(lambda: len(sup.table) == 1, 10)
        for bad, what in cases:
            with pytest.raises(ValueError, match=re.escape(what)):
                await client.update_weights(bad, version=3)
        await client.abort("running")  # (or it reached the echo engine's context first)
        assert (await running).num_preemptions == 0
        # A generator's items are met as they are sent: they fail the update.
        for bad, what in cases:
            with pytest.raises(WeightUpdateError, match=re.escape(what)):
                await client.update_weights(iter(named_pairs(bad)), version=3)
        assert sup.weight_version == 2


async def assert_back_on_version_1(sup, client):
    """Both workers on version 1 again (its weights: offset 0), neither restarted."""
    assert sup.weight_version == 1
    workers = (await sup.stats())["workers"]
    assert [(w["weight_version"], w["restarts"]) for w in workers] == [(1, 0), (1, 0)]
    for i in range(4):
        r = await client.generate(f"r{i}", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5) and r.weight_versions == [1]


async def test_a_partly_applied_failed_update_is_rolled_back_to_the_last_good_version():
    async with fleet(2, tokens_per_s=0) as sup:
        client = sup.client()
        # Version 1 holds both names the next update sends (an empty "fail" loads).
        await client.update_weights(offset(0) + [("fail", torch.zeros(0))], version=1)
        # Bucket 0 holds the new offset (applied at once), bucket 1 the tensor that fails.
        bad = [("offset", torch.tensor([9])), ("fail", torch.zeros(32))]
        with pytest.raises(WeightUpdateError):
            await client.update_weights(bad, version=2, bucket_bytes=64)
        # The workers briefly held offset 9 under version 1; the fleet put version 1 back
        # from its kept copy, without restarting them.
        await assert_back_on_version_1(sup, client)


async def test_a_cancelled_update_is_rolled_back_like_a_failed_one():
    # A caller that gives up on an update (a timeout, a cancelled task) left the workers with the
    # part of it they had loaded, served under the old version.
    async with fleet(2, tokens_per_s=0) as sup:
        client = sup.client()
        await client.update_weights(offset(0), version=1)

        def new_offsets():
            for i in range(8):  # one bucket each
                if i == 6:  # buckets 0 to 2 are loaded by now: each buffer is refilled once loaded
                    update.cancel()
                yield "offset", torch.tensor([9])

        update = asyncio.create_task(client.update_weights(new_offsets(), version=2, bucket_bytes=64))
        with pytest.raises(asyncio.CancelledError):
            await update
        await assert_back_on_version_1(sup, client)


async def test_a_failed_update_that_reached_a_tensor_no_update_sent_before_restarts_the_worker():
    async with fleet(1, tokens_per_s=0) as sup:
        client = sup.client()
        await client.update_weights(offset(2), version=1)
        await client.update_weights([("fail", torch.zeros(0))], version=2)  # a partial update: offset stays 2
        r = await client.generate("v2", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=2) and r.weight_versions == [2]
        # Applied before the failure: a new "offset" and a tensor no update sent. The kept
        # copy (every name sent so far, as last sent) puts "offset" back to 2, not to its
        # initial 0 as the last update's tensors alone would.
        bad = [("offset", torch.tensor([9])), ("fail", torch.zeros(32))]
        with pytest.raises(WeightUpdateError):
            await client.update_weights(bad, version=3, bucket_bytes=64)
        r = await client.generate("after", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=2) and r.weight_versions == [2]
        assert [(w["weight_version"], w["restarts"]) for w in (await sup.stats())["workers"]] == [(2, 0)]
        # A failed update that reached a name nothing kept holds: it cannot be put back, so
        # the worker is restarted (initial weights, then every kept tensor: version 2 again).
        await client.update_weights([("fail", torch.zeros(0))], version=4)
        with pytest.raises(WeightUpdateError):
            await client.update_weights([("scale", torch.ones(1)), ("fail", torch.zeros(32))], version=5,
                                        bucket_bytes=64)
        r = await client.generate("restarted", [4], SamplingParams(max_tokens=5))
        assert r.token_ids == expected_tokens([4], 5, offset=2) and r.weight_versions == [4]
        [worker] = (await sup.stats())["workers"]
        assert (worker["weight_version"], worker["restarts"]) == (4, 1)
        assert "partly applied" in worker["last_error"]


async def test_requests_queued_in_a_full_engine_resume_too_when_weights_change():
    # One worker that runs 2 requests at once (echo's max_running): at the update, 2 run and 4
    # wait inside the engine. All 6 are interrupted; the running ones keep their partial output,
    # the waiting ones have none and start under the new version.
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, report_interval_s=0.02, engine_options={
            "tokens_per_s": 200, "max_running": 2, "step_tokens": 4})) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=100)  # 0.5 s each: three waves of two
        tasks = [asyncio.create_task(client.generate(f"q{i}", [i + 1], params)) for i in range(6)]
        assert await wait_for(lambda: len(sup.table) == 6 and any(e.token_ids for e in sup.table), 10.0)  # first wave
        assert (await client.update_weights(offset(0), version=1)).ok
        results = [await t for t in tasks]
        for i, r in enumerate(results):
            assert r.token_ids == expected_tokens([i + 1], 100) and r.finish_reason == "length"
            assert r.weight_versions in ([0, 1], [1]) and r.num_preemptions == 1, (i, r)
        started = [r for r in results if r.weight_versions == [0, 1]]
        assert 1 <= len(started) <= 2 and any(r.weight_versions == [1] for r in results)
        assert len(sup.table) == 0
        engine = (await sup.stats())["workers"][0]["engine_stats"]
        assert engine["num_running"] == 0 and engine["num_waiting"] == 0
        assert engine["free_slots"] == 2  # no slot kept by an aborted request
