"""Fault injection on real worker processes: every request completes, resumes or fails
with a typed error; no orphan process, socket file or shared-memory segment remains."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from rollfleet.actors import FleetConfig, RestartPolicy, Supervisor
from rollfleet.errors import EngineFailed, FleetError, RolloutError, WeightUpdateError, WorkerStartError
from rollfleet.transport.messages import SamplingParams

from ..helpers import wait_until, worker_children
from .helpers import (alive, assert_clean, expected_tokens, fleet, kill_sentinel, segments_of, sentinel_of, wait_for,
                      worker_pids)

pytestmark = pytest.mark.usefixtures("no_leaks")

FAST_HB = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}


def start_requests(client, n, max_tokens, prompt_len=1, stream=False):
    async def streamed(rid, prompt):
        chunks, final = [], None
        async for item in client.stream(rid, prompt, SamplingParams(max_tokens=max_tokens)):
            if hasattr(item, "finish_reason"):
                final = item
            else:
                chunks.extend(item.token_ids)
        assert chunks == final.token_ids, "streamed tokens differ from the result"
        return final

    prompts = {f"r{i}": [i + 1] * prompt_len for i in range(n)}
    if stream:
        tasks = {rid: asyncio.create_task(streamed(rid, p)) for rid, p in prompts.items()}
    else:
        tasks = {rid: asyncio.create_task(client.generate(rid, p, SamplingParams(max_tokens=max_tokens)))
                 for rid, p in prompts.items()}
    return prompts, tasks


async def assert_all_exact(prompts, tasks, max_tokens):
    for rid, task in tasks.items():
        result = await asyncio.wait_for(task, 30)
        assert result.token_ids == expected_tokens(prompts[rid], max_tokens), rid
        assert result.finish_reason == "length"


def big_weights(n, nbytes, on_item=None):
    """An update of ``n`` tensors (the echo engine ignores their values); ``on_item(i)`` runs
    as the sender pulls the i-th tensor, i.e. in the middle of the transfer."""
    for i in range(n):
        if on_item is not None:
            on_item(i)
        yield f"layer{i}.weight", torch.zeros(nbytes // 4, dtype=torch.float32)
    yield "offset", torch.tensor([0])


async def test_worker_sigkill_mid_stream_resumes_every_request():
    sup = fleet(2, engine_options={"tokens_per_s": 200}, deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        prompts, tasks = start_requests(sup.client(), 8, 60, stream=True)
        await asyncio.sleep(0.1)
        victim = sup.slots[0]
        moved = {e.request_id for e in sup.table.on_worker(victim.worker_id)}
        assert moved
        os.kill(victim.pid, signal.SIGKILL)
        await assert_all_exact(prompts, tasks, 60)
        assert sup.counters["resumed"] >= len(moved) and sup.counters["failed"] == 0
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10)
        pids |= worker_pids(sup)
        assert len(sup.table) == 0
    assert_clean(sup.private_dir, pids)


async def test_worker_sigstop_mid_stream_is_killed_and_its_requests_resume():
    sup = fleet(2, engine_options={"tokens_per_s": 100}, deterministic_routing=True, **FAST_HB)
    async with sup:
        pids = worker_pids(sup)
        prompts, tasks = start_requests(sup.client(), 6, 80)
        await asyncio.sleep(0.1)
        victim = sup.slots[1]
        os.kill(victim.pid, signal.SIGSTOP)
        await assert_all_exact(prompts, tasks, 80)
        assert "heartbeat" in victim.last_error
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10)
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_worker_killed_or_stopped_mid_weight_update(sig):
    sup = fleet(2, engine_options={"tokens_per_s": 200}, deterministic_routing=True,
                weights={"transport": "shm", "bucket_bytes": 1 << 20}, **FAST_HB)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        prompts, tasks = start_requests(client, 6, 80)
        await asyncio.sleep(0.1)
        victim = sup.slots[0]

        def hit(i):
            if i == 3:
                os.kill(victim.pid, sig)

        # 13 buckets are still to go when the victim stops acking them: the update cannot
        # finish without it, so it fails, typed, naming the worker and why it was lost.
        with pytest.raises(WeightUpdateError) as info:
            await asyncio.wait_for(client.update_weights(big_weights(16, 1 << 20, hit), version=1), 30)
        assert victim.worker_id in str(info.value)
        assert ("code -9" if sig == signal.SIGKILL else "heartbeat") in str(info.value)
        assert sup.weight_version == 0  # the fleet serves on with the weights it had
        await assert_all_exact(prompts, tasks, 80)
        # The slot comes back, at the fleet's version, and serves.
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 15)
        assert sup.slots[0].weight_version == sup.weight_version
        after = await client.generate("after", [3], SamplingParams(max_tokens=5))
        assert after.token_ids == expected_tokens([3], 5)
        pids |= worker_pids(sup)
        assert not segments_of({os.getpid()}), "segments outlived the update"
    assert_clean(sup.private_dir, pids)


async def test_worker_killed_during_startup_of_its_restart_is_restarted_again():
    sup = fleet(2, engine_options={"tokens_per_s": 200, "start_delay_s": 0.5}, deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        prompts, tasks = start_requests(sup.client(), 6, 100)
        await asyncio.sleep(0.1)
        first = sup.slots[0]
        os.kill(first.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not first, 5)
        second = sup.slots[0]
        pids.add(second.pid)
        assert second.state.value == "starting"
        os.kill(second.pid, signal.SIGKILL)  # still inside its engine's start-up delay
        await assert_all_exact(prompts, tasks, 100)
        assert await wait_for(lambda: sup.slots[0] not in (first, second) and sup.slots[0].state.value == "ready", 15)
        shown = sup.slots[0].describe(0, 0)["last_error"]  # the worker before it: this one is fine
        assert sup.slots[0].last_error == "" and ("died during start-up" in shown or "code -9" in shown)
        # The slot keeps its last two workers' logs, not one per restart.
        logs = sorted(f for f in os.listdir(sup.private_dir) if f.startswith("w0-") and f.endswith(".log"))
        assert logs == ["w0-1.log", "w0-2.log"]
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


@pytest.mark.parametrize("restarts", ["tried-again", "given-up"])
async def test_a_restart_whose_process_cannot_be_started_is_tried_again_or_its_requests_fail(restarts):
    # The private directory moved away, the restart cannot open its worker's log file there: the
    # spawn itself raises. That is a failed start like any other, not a restart task that dies
    # with the slot left dead and the request waiting for ever.
    policy = RestartPolicy(backoff_s=0.5, max_restarts=5 if restarts == "tried-again" else 1)
    sup = fleet(1, engine_options={"tokens_per_s": 200}, restart=policy)
    async with sup:
        pids = worker_pids(sup)
        task = asyncio.create_task(sup.client().generate("r", [3], SamplingParams(max_tokens=200)))
        assert await wait_for(lambda: len(sup.table) == 1 and next(iter(sup.table)).worker_id, 10)
        away = sup.private_dir + ".away"
        os.rename(sup.private_dir, away)
        try:
            first = sup.slots[0]
            os.kill(first.pid, signal.SIGKILL)
            assert await wait_for(lambda: "its restart failed" in sup.slots[0].last_error, 10)
            assert sup.slots[0] is first and "FileNotFoundError" in sup.slots[0].describe(0, 0)["last_error"]
            if restarts == "given-up":
                with pytest.raises(FleetError, match="its restart failed"):
                    await asyncio.wait_for(task, 10)
        finally:
            os.rename(away, sup.private_dir)
        if restarts == "tried-again":
            result = await asyncio.wait_for(task, 30)
            assert result.token_ids == expected_tokens([3], 200) and result.num_preemptions == 1
            assert sup.slots[0] is not first and sup.slots[0].state.value == "ready"
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


async def test_a_worker_that_registers_during_a_weight_update_serves_after_it():
    # One step of 100 tokens at 1 token/s: the request on w0 takes its abort only after 100 s,
    # so the update's drain lasts until w0 is killed, while w1's restart registers.
    sup = fleet(2, engine_options={"tokens_per_s": 1, "step_tokens": 100}, deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        first = sup.slots[1]
        os.kill(first.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[1] is not first, 10)
        held = asyncio.create_task(client.generate("held", [1], SamplingParams(max_tokens=100), resume=False))
        assert await wait_for(lambda: sup.slots[0].worker_id in {e.worker_id for e in sup.table}, 10)
        update = asyncio.create_task(client.update_weights([("offset", torch.tensor([0]))], version=1))
        assert await wait_for(lambda: sup.slots[1].state.value == "ready", 20)
        assert not update.done()  # it registered while the update held dispatching
        pids |= worker_pids(sup)
        os.kill(sup.slots[0].pid, signal.SIGKILL)  # ends the drain
        assert (await asyncio.wait_for(update, 30)).ok
        assert (await held).finish_reason == "abort"  # interrupted, not to be resumed
        late = asyncio.create_task(client.generate("late", [2], SamplingParams(max_tokens=100)))
        # The restarted w1 takes it (w0's own restart may not even be up yet).
        assert await wait_for(lambda: sup.slots[1].worker_id in {e.worker_id for e in sup.table}, 10)
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


@pytest.mark.parametrize("when", ["draining", "sending"])
async def test_a_fleet_shut_down_during_a_weight_update_ends_it_with_fleet_closed(when):
    from rollfleet.errors import FleetClosed

    # draining: a request that takes its abort only after 100 s holds the update in its drain;
    # sending: the trainer's tensors start the shutdown once the first bucket is on its way.
    sup = fleet(1, engine_options={"tokens_per_s": 1, "step_tokens": 100})
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        loop = asyncio.get_running_loop()
        closing = []

        def tensors():
            for i in range(8):
                if when == "sending" and i == 2:
                    closing.append(loop.create_task(sup.shutdown()))
                yield f"t{i}", torch.zeros(1 << 16)

        if when == "draining":
            held = asyncio.create_task(client.generate("held", [1], SamplingParams(max_tokens=100)))
            assert await wait_for(lambda: sup.table.num_inner == 1, 10)
        update = asyncio.create_task(client.update_weights(tensors(), version=1, bucket_bytes=1 << 18))
        if when == "draining":
            assert await wait_for(lambda: sup._paused, 10)
            closing.append(asyncio.create_task(sup.shutdown()))
            with pytest.raises(FleetClosed):
                await asyncio.wait_for(held, 30)
        with pytest.raises(FleetClosed, match="weight version 1"):
            await asyncio.wait_for(update, 30)
        await asyncio.wait_for(closing[0], 30)
    assert_clean(sup.private_dir, pids)


async def test_with_no_worker_left_to_restart_waiting_requests_fail_and_new_ones_are_refused():
    from rollfleet.actors import RemoteClient

    async with fleet(1, engine_options={"tokens_per_s": 100}, restart=None) as sup:
        client = sup.client()
        running = asyncio.create_task(client.generate("r", [3], SamplingParams(max_tokens=500)))
        assert await wait_for(lambda: len(getattr(sup.table.get("local", "r"), "token_ids", [])) >= 3)
        pids = worker_pids(sup)
        os.kill(sup.slots[0].pid, signal.SIGKILL)
        with pytest.raises(FleetError, match="no worker is left") as info:
            await asyncio.wait_for(running, 10)  # it would wait to resume forever
        assert "code -9" in str(info.value) and info.value.request_id == "r"
        assert len(sup.table) == 0
        # queued to go on when its worker died, it counts as resumed (PROTOCOL.md 6.5), and failed
        assert sup.counters["resumed"] == 1 and sup.counters["failed"] == 1
        with pytest.raises(FleetError):
            await asyncio.wait_for(client.generate("s", [3], SamplingParams(max_tokens=2)), 10)
        async with RemoteClient(sup.frontend_address, call_timeout_s=10) as remote:  # the same over the wire
            with pytest.raises(FleetError):
                await remote.generate("t", [3], SamplingParams(max_tokens=2), timeout=10)
            assert (await remote.stats())["num_workers"] == 0
    assert_clean(sup.private_dir, pids)


async def test_when_the_restart_policy_gives_up_on_the_last_slot_its_requests_fail():
    # the worker's restart is killed during its start-up, and one restart is all the policy allows
    sup = fleet(1, engine_options={"tokens_per_s": 100, "start_delay_s": 0.5},
                restart=RestartPolicy(max_restarts=1, backoff_s=0.1))
    async with sup:
        client = sup.client()
        running = asyncio.create_task(client.generate("r", [3], SamplingParams(max_tokens=500)))
        assert await wait_for(lambda: len(getattr(sup.table.get("local", "r"), "token_ids", [])) >= 3)
        first = sup.slots[0]
        pids = worker_pids(sup)
        os.kill(first.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not first, 5)
        pids.add(sup.slots[0].pid)
        os.kill(sup.slots[0].pid, signal.SIGKILL)  # still inside its engine's start-up delay
        with pytest.raises(FleetError, match="no worker is left"):
            await asyncio.wait_for(running, 10)
        assert not sup.restarting() and not sup.workers
    assert_clean(sup.private_dir, pids)


IOMP = os.path.join(sys.prefix, "lib", "libiomp5.so")  # Intel's OpenMP, installed with vLLM for CPUs


async def test_workers_killed_or_shut_down_leave_no_openmp_registration():
    if not os.path.exists(IOMP):
        pytest.skip(f"needs Intel's OpenMP at {IOMP}")

    def registered(pid):
        return os.path.exists(f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}")

    sup = Supervisor(FleetConfig(engine="torch", num_workers=1, worker_env={"LD_PRELOAD": IOMP}))
    async with sup:
        await sup.client().generate("a", [1, 2], SamplingParams(max_tokens=2))  # the model ran: OpenMP is up
        first = sup.slots[0]
        assert registered(first.pid)
        os.kill(first.pid, signal.SIGKILL)  # a killed process never unregisters
        assert await wait_for(lambda: sup.slots[0] is not first and sup.slots[0].state.value == "ready", 30)
        assert not registered(first.pid)
        second = sup.slots[0].pid
        await sup.client().generate("b", [1, 2], SamplingParams(max_tokens=2))
    assert not registered(second)


async def test_worker_stopped_during_fleet_startup_times_out_with_a_typed_error_and_is_killed():
    sup = fleet(2, engine_options={"start_delay_s": 1.0}, restart=None, start_timeout_s=3.0)
    starting = asyncio.create_task(sup.start())
    assert await wait_for(lambda: len(sup.slots) == 2, 10)
    pids = worker_pids(sup)
    os.kill(sup.slots[1].pid, signal.SIGSTOP)  # frozen inside its engine's start-up
    with pytest.raises(WorkerStartError, match="did not register"):
        await starting
    assert sup.closed
    assert_clean(sup.private_dir, pids)


async def test_restarted_worker_stopped_during_startup_is_replaced():
    # start_timeout_s leaves room for a start on a busy machine (interpreter, imports, the 0.5 s
    # delay), and is what the frozen restart below waits out before it is replaced.
    sup = fleet(2, engine_options={"start_delay_s": 0.5}, start_timeout_s=5.0, deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        first = sup.slots[0]
        os.kill(first.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not first, 10)
        second = sup.slots[0]
        pids.add(second.pid)
        os.kill(second.pid, signal.SIGSTOP)  # the restart freezes before it registers
        assert await wait_for(lambda: sup.slots[0] not in (first, second) and sup.slots[0].state.value == "ready", 45)
        pids |= worker_pids(sup)
        result = await sup.client().generate("after", [3], SamplingParams(max_tokens=4))
        assert result.token_ids == expected_tokens([3], 4)
    assert_clean(sup.private_dir, pids)


async def test_worker_killed_during_fleet_startup_fails_start_with_a_typed_error():
    sup = fleet(2, engine_options={"start_delay_s": 1.0}, restart=None)
    starting = asyncio.create_task(sup.start())
    assert await wait_for(lambda: len(sup.slots) == 2, 10)
    pids = worker_pids(sup)
    os.kill(sup.slots[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerStartError):
        await starting
    assert sup.closed
    assert_clean(sup.private_dir, pids)


async def test_engine_exception_fails_only_that_request_with_a_typed_error():
    sup = fleet(2, engine_options={"tokens_per_s": 300, "fail_generate_after": 5}, deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        # Prompts of 6 tokens are past the fault; those of 1 token reach it at length 5.
        good, good_tasks = start_requests(client, 6, 30, prompt_len=6)
        bad = [asyncio.create_task(client.generate(f"bad{i}", [9], SamplingParams(max_tokens=30))) for i in range(3)]
        for task in bad:
            with pytest.raises(EngineFailed, match="fail_generate_after"):
                await task
        await assert_all_exact(good, good_tasks, 30)
        assert worker_pids(sup) == pids, "a request-level engine error must not cost the worker"
        assert sup.counters["failed"] == 3 and len(sup.table) == 0
    assert_clean(sup.private_dir, pids)


async def test_fatal_engine_exception_restarts_the_worker_and_resumes_its_other_requests():
    sup = fleet(2, engine_options={"tokens_per_s": 200, "fail_generate_after": 5, "fail_fatal": True},
                deterministic_routing=True)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        good, good_tasks = start_requests(client, 6, 60, prompt_len=6)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineFailed, match="EngineDead"):
            await client.generate("fatal", [9], SamplingParams(max_tokens=30))
        await assert_all_exact(good, good_tasks, 60)
        assert await wait_for(lambda: len(sup.ready_workers()) == 2 and worker_pids(sup) != pids, 10)
        stats = await sup.stats()
        assert sum(w["restarts"] for w in stats["workers"]) == 1
        assert any("EngineDead" in w["last_error"] for w in stats["workers"])
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


async def test_stalled_engine_is_detected_restarted_and_its_requests_resume():
    sup = fleet(2, engine_options={"tokens_per_s": 200, "stall_after": 6}, deterministic_routing=True,
                stall_timeout_s=1.0, heartbeat_interval_s=0.2, report_interval_s=0.05)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        good, good_tasks = start_requests(client, 6, 100, prompt_len=6)
        stuck = asyncio.create_task(client.generate("stuck", [9], SamplingParams(max_tokens=40)))
        await assert_all_exact(good, good_tasks, 100)
        result = await asyncio.wait_for(stuck, 20)
        assert result.token_ids == expected_tokens([9], 40) and result.num_preemptions == 1
        stats = await sup.stats()
        assert any("stalled" in w["last_error"] for w in stats["workers"])
        assert sum(w["restarts"] for w in stats["workers"]) == 1
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10)
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)


async def test_stall_timeout_spares_paused_engines():
    sup = fleet(1, engine_options={"tokens_per_s": 200}, stall_timeout_s=0.5, heartbeat_interval_s=0.1,
                report_interval_s=0.05)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [2], SamplingParams(max_tokens=60)))
        await asyncio.sleep(0.05)
        await client.control("pause")
        assert (await sup.stats(engines=False))["engines_paused"] is True
        await asyncio.sleep(1.5)  # three stall timeouts without a token
        await client.control("sleep")
        await client.control("resume")  # undoes the pause, not the sleep
        stats = await sup.stats(engines=False)
        assert stats["engines_paused"] is False and stats["sleep_level"] == 1
        await client.control("wake_up")
        assert (await sup.stats(engines=False))["sleep_level"] == 0
        result = await asyncio.wait_for(task, 10)
        assert result.token_ids == expected_tokens([2], 60) and result.num_preemptions == 0
        assert worker_pids(sup) == pids
    assert_clean(sup.private_dir, pids)


SUPERVISOR_SCRIPT = textwrap.dedent("""
    import asyncio, sys, torch
    from rollfleet.actors import Supervisor, FleetConfig
    from rollfleet.transport.messages import SamplingParams

    async def main():
        sup = Supervisor(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 200},
                                     weights={"transport": "shm", "bucket_bytes": 1 << 20}))
        await sup.start()
        client = sup.client()
        print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
        if "--hold" in sys.argv:  # no requests; the first update waits for a line
            await asyncio.to_thread(sys.stdin.readline)
        else:
            tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=100000)))
                     for i in range(8)]
        version = 0
        while True:
            version += 1
            tensors = [(f"t{i}", torch.zeros(1 << 18)) for i in range(16)] + [("offset", torch.tensor([0]))]
            await client.update_weights(tensors, version=version)
            if version == 2:
                print("updating", flush=True)
    asyncio.run(main())
""")


def test_supervisor_sigkill_mid_stream_and_mid_update_leaves_nothing_behind():
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        private_dir, pids = line[0], [int(p) for p in line[1:]]
        assert len(pids) == 2 and len(alive(pids)) == 2
        assert proc.stdout.readline().strip() == "updating"  # updates now run back to back
        time.sleep(0.05)
        proc.kill()
        proc.wait()
        assert_clean(private_dir, pids, creators=[proc.pid], within=10.0)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("how", ["sigkill", "sigterm-to-group", "sigkill-to-group"])
def test_supervisor_gone_in_its_first_update_with_a_worker_stopped_leaves_nothing_behind(how):
    # The first update offers its shm segments by name until every worker has mapped them;
    # a stopped worker holds it there. The supervisor then dies: by SIGKILL, or with its
    # whole process group by SIGTERM (what `timeout` and service managers send), which
    # reaches the workers too. The stopped worker is woken (the kernel's parent-death
    # signal), and the workers unlink the dead supervisor's segments and remove its
    # private directory (socket file, logs). With the whole group SIGKILLed no worker is left
    # to: the supervisor's sentinel, a process of another session, does.
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, "--hold"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline().split()
        private_dir, pids = line[0], [int(p) for p in line[1:]]
        os.kill(pids[0], signal.SIGSTOP)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 20.0
        while not segments_of([proc.pid]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert segments_of([proc.pid]), "the first update offered no segment"
        sentinel = sentinel_of(proc.pid)
        assert sentinel is not None
        if how == "sigkill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL if how == "sigkill-to-group" else signal.SIGTERM)
        proc.wait()
        assert_clean(private_dir, pids + [sentinel], creators=[proc.pid], within=10.0)
    finally:
        proc.kill()
        proc.wait()
        for pid in alive(pids if "pids" in locals() else []):
            os.kill(pid, signal.SIGKILL)


SHUTDOWN_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import torch  # a trainer's: its threads make this process's end take a moment
    from rollfleet.actors import FleetConfig, Supervisor

    async def main():
        config = FleetConfig(engine="echo", num_workers=2, private_dir_root=sys.argv[1],
                             worker_env={"PYTHONPATH": sys.argv[2]})
        async with Supervisor(config) as sup:
            print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            print("shutting down", flush=True)
    asyncio.run(main())
""")


def test_supervisor_killed_while_its_workers_exit_at_its_shutdown_leaves_nothing_behind(tmp_path):
    # The workers were told to stop and have let go of their engines; Python's teardown of
    # their modules remains (seconds with torch loaded; here a finalizer that sleeps). The
    # supervisor, waiting for them to end, is killed then (a job manager's SIGTERM to a
    # trainer): its workers must still remove its private directory (logs, owner file).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import time
        class SlowTeardown:
            def __del__(self):
                time.sleep(5)
        held = SlowTeardown()
    """))
    root = tmp_path / "root"
    root.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-c", SHUTDOWN_SCRIPT, str(root), path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        private_dir, pids = line[0], [int(p) for p in line[1:]]
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "shutting down"
        time.sleep(1.0)  # the workers' engines are shut down by now
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert_clean(private_dir, pids, creators=[proc.pid], within=15.0)
    finally:
        proc.kill()
        proc.wait(10)


def test_supervisor_killed_in_its_shutdown_with_a_worker_stopped_leaves_nothing_behind(tmp_path):
    # A worker is stopped when the fleet shuts down: its shutdown message waits for it. The
    # supervisor is killed then; its death wakes the worker, which finds that message and
    # exits while the supervisor's process is still ending (its death pipe not closed yet). It
    # must still clean up after it.
    proc = subprocess.Popen([sys.executable, "-c", SHUTDOWN_SCRIPT, str(tmp_path), os.environ.get("PYTHONPATH", "")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        private_dir, pids = line[0], [int(p) for p in line[1:]]
        os.kill(pids[0], signal.SIGSTOP)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "shutting down"
        assert wait_until(lambda: not alive(pids[1:]), 10.0)  # the other worker has ended
        proc.kill()
        proc.wait(10)
        assert_clean(private_dir, pids, creators=[proc.pid], within=10.0)
    finally:
        proc.kill()
        proc.wait(10)
        for pid in alive(pids if "pids" in locals() else []):
            os.kill(pid, signal.SIGKILL)


NO_WORKER_ALIVE_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from rollfleet.actors import FleetConfig, RestartPolicy, Supervisor

    async def main():
        config = FleetConfig(engine="echo", num_workers=1, private_dir_root=sys.argv[1],
                             frontend_addr=sys.argv[2] if len(sys.argv) > 2 else None,
                             restart=RestartPolicy(backoff_s=60, max_backoff_s=60))
        async with Supervisor(config) as sup:
            print(sup.private_dir, sup.slots[0].pid, flush=True)
            await asyncio.sleep(3600)
    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["sigkill", "sigkill-to-group"])
async def test_a_supervisor_killed_with_no_worker_alive_is_cleaned_up_after_by_its_sentinel(tmp_path, how):
    # The supervisor dies while its only worker is dead and waiting to be restarted: no worker
    # is left to remove its directory (socket files, logs) and the socket file its clients
    # used. Its sentinel, a process of its own session, does at once: also when the kill is for
    # the whole process group.
    front = tmp_path / "front.sock"
    proc = subprocess.Popen([sys.executable, "-c", NO_WORKER_ALIVE_SCRIPT, str(tmp_path), f"ipc://{front}"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        private_dir, pid = proc.stdout.readline().split()
        sentinel = sentinel_of(proc.pid)
        assert sentinel is not None and os.getpgid(sentinel) != os.getpgid(proc.pid)
        os.kill(int(pid), signal.SIGKILL)
        assert await wait_for(lambda: not alive([int(pid)]), 10.0)
        await asyncio.sleep(0.5)  # the supervisor has seen it die; its restart is a minute away
        assert os.path.exists(os.path.join(private_dir, "workers.sock")) and front.exists()
        if how == "sigkill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert await wait_for(lambda: not os.path.exists(private_dir) and not front.exists(), 10.0), \
            f"left behind: {os.listdir(tmp_path)}"
        assert await wait_for(lambda: not alive([sentinel]), 10.0), "the sentinel outlived its cleanup"
        assert os.listdir(tmp_path) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("how", ["sentinel-stopped", "stderr-unread"])
async def test_a_sentinel_cleans_up_when_it_was_stopped_or_its_stderr_has_no_reader(tmp_path, how):
    # Its supervisor dies (no worker alive) while the sentinel is stopped, in a session where
    # nothing else would wake it (the kernel's parent-death signal does); or with its stderr a
    # pipe whose reader is gone too (the sentinel's line about it must not cost the rest): the
    # private directory and the supervisor's weight-update segments still go.
    proc = subprocess.Popen([sys.executable, "-c", NO_WORKER_ALIVE_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    segment = f"/dev/shm/rf-{proc.pid}-{os.urandom(8).hex()}-0"  # as its first update would name one
    try:
        private_dir, pid = proc.stdout.readline().split()
        sentinel = sentinel_of(proc.pid)
        assert sentinel is not None
        with open(segment, "wb"):
            pass
        os.kill(int(pid), signal.SIGKILL)
        assert await wait_for(lambda: not alive([int(pid)]), 10.0)
        await asyncio.sleep(0.5)  # the supervisor has seen it die; its restart is a minute away
        if how == "sentinel-stopped":
            os.kill(sentinel, signal.SIGSTOP)
        else:
            proc.stderr.close()
        proc.kill()
        proc.wait(10)
        assert await wait_for(lambda: not os.path.exists(private_dir) and not os.path.exists(segment), 10.0), \
            f"left behind: {os.listdir(tmp_path)}, segment there: {os.path.exists(segment)}"
        assert await wait_for(lambda: not alive([sentinel]), 10.0), "the sentinel outlived its cleanup"
    finally:
        proc.kill()
        proc.wait(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment)
        if "sentinel" in locals() and sentinel is not None and alive([sentinel]):
            os.kill(sentinel, signal.SIGKILL)


async def test_a_private_dir_left_by_a_supervisor_killed_with_no_worker_alive_goes_at_the_next_start(tmp_path):
    # The supervisor dies while its only worker is dead and waiting to be restarted, and its
    # sentinel is killed first (as when every process of the job is, a container stopped): no
    # process of the fleet is left to remove its directory (socket file, logs). The next
    # supervisor that starts in the same place does.
    proc = subprocess.Popen([sys.executable, "-c", NO_WORKER_ALIVE_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        private_dir, pid = proc.stdout.readline().split()
        os.kill(int(pid), signal.SIGKILL)
        assert await wait_for(lambda: not alive([int(pid)]), 10.0)
        await asyncio.sleep(0.5)  # the supervisor has seen it die; its restart is a minute away
        kill_sentinel(proc.pid)
        proc.kill()
        proc.wait(10)
        assert os.path.exists(os.path.join(private_dir, "workers.sock"))
        other = tmp_path / "rollfleet-not-a-fleet"  # no owner file: never touched
        other.mkdir()
        async with fleet(1, private_dir_root=str(tmp_path)) as sup:
            assert not os.path.exists(private_dir)
            assert other.exists() and os.path.exists(sup.private_dir)
        assert sorted(os.listdir(tmp_path)) == ["rollfleet-not-a-fleet"]
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def vllm_job(tmp_path, *, served: bool, own_group: bool = False):
    """Yields (process, the workers' extra environment, its TMPDIR): a job in a process of its
    own, TMPDIR a fresh short directory (vLLM's socket paths must fit in 107 bytes), in a
    process group of its own with ``own_group``. On the way out the process (or its whole
    group) is killed and the directory removed."""
    short = tempfile.mkdtemp(prefix="rft-", dir="/tmp")
    proc, env = start_vllm_job(tmp_path, short, served=served, start_new_session=own_group)
    try:
        yield proc, env, short
    finally:
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()
        shutil.rmtree(short, ignore_errors=True)


def start_vllm_job(tmp_path, tmpdir: str, *, served: bool, **popen) -> tuple[subprocess.Popen, dict]:
    """A job in a process of its own (TMPDIR ``tmpdir``): a one-worker vLLM fleet on the tiny
    Llama, with Intel's OpenMP preloaded where it is installed (as vLLM's CPU guide advises: it
    registers every process in /dev/shm too, and only a normal exit unregisters it). Once up, and
    with ``served`` once it has served a request, it prints its private directory and waits.
    Returns the process and the workers' extra environment."""
    env = {"LD_PRELOAD": IOMP} if os.path.exists(IOMP) else {}
    # float32: the tiny model's first request fails in vLLM's default dtype on these CPUs
    options = {"dtype": "float32"} if served else {}
    script = tmp_path / "fleet.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio
        from rollfleet.actors import FleetConfig, Supervisor
        from rollfleet.engines.tiny import build_tiny_llama
        from rollfleet.transport.messages import SamplingParams

        async def main():
            path = build_tiny_llama({str(tmp_path / "model")!r})
            config = FleetConfig(engine="vllm", num_workers=1, start_timeout_s=240, worker_env={env!r},
                                 engine_options={{"model": path, **{options!r}}})
            async with Supervisor(config) as sup:
                if {served!r}:
                    await sup.client().generate("a", [1, 2, 3], SamplingParams(max_tokens=4))
                print(sup.private_dir, flush=True)
                await asyncio.sleep(600)

        asyncio.run(main())
    """))
    (tmp_path / "model").mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=tmpdir), **popen)
    return proc, env


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_vllm_fleets_supervisor_killed_by_sigterm_leaves_no_shared_memory(tmp_path):
    # vLLM's own processes share memory (message queues, semaphores) that only a clean engine
    # shutdown unlinks; with the supervisor gone, the worker sweeps what its engine listed and
    # spares the resource tracker that unlinks the rest (both were left in /dev/shm).
    pytest.importorskip("vllm")
    from rollfleet.actors.process import shm_names_now

    before = shm_names_now()
    with vllm_job(tmp_path, served=False) as (proc, env, short):
        assert proc.stdout.readline().strip().startswith(short)  # up
        assert shm_names_now() - before  # the engine shares memory while it runs
        assert not env or any(n.startswith("__KMP_REGISTERED_LIB_") for n in shm_names_now() - before)
        proc.send_signal(signal.SIGTERM)  # the supervisor's process alone, not its group
        proc.wait(30)

        def left() -> list[str]:  # what the worker removes once it sees its supervisor gone
            return [p for p in os.listdir(short) if p.startswith("rollfleet-")]

        deadline = time.monotonic() + 20
        while (shm_names_now() - before or left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not shm_names_now() - before
        assert not left()


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("who", ["sentinel", "next-fleet"])
def test_a_vllm_fleet_killed_with_its_whole_process_group_leaves_no_shared_memory(tmp_path, who):
    # A SIGKILL to the job's process group takes the supervisor, the worker, vLLM's processes and
    # their resource tracker at once: none of them is left to unlink what they shared. The
    # fleet's sentinel, in a session of its own, unlinks what the dead fleet's worker listed,
    # which must hold the semaphore vLLM's model worker makes (its creator maps it under another
    # name) and the worker's own OpenMP registration. With the sentinel killed too (every process
    # of the job: a container stopped), the next fleet started in the same place does.
    pytest.importorskip("vllm")
    import psutil

    from rollfleet.actors.process import kmp_names, shm_names_mapped, shm_names_now

    before = shm_names_now()
    with vllm_job(tmp_path, served=True, own_group=True) as (proc, _, short):
        private_dir = proc.stdout.readline().strip()
        assert private_dir.startswith(short)
        group = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        # What the job's processes had mapped or registered, not what others made meanwhile
        shared = (shm_names_mapped(group) | kmp_names(group)) & (shm_names_now() - before)
        assert any(n.startswith("sem.mp-") for n in shared)
        if who == "sentinel":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert wait_until(lambda: not alive(group), timeout=10)
            assert wait_until(lambda: not shm_names_now() & shared and not os.path.exists(private_dir), 10), \
                f"left in /dev/shm: {sorted(shm_names_now() & shared)}"
            return
        kill_sentinel(proc.pid)  # every process of the job: nobody is left to clean up
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not alive(group), timeout=10)
        assert shm_names_now() & shared and os.path.exists(private_dir)  # nobody was left to clean up

        async def next_fleet():
            async with fleet(1, private_dir_root=short):
                pass

        asyncio.run(next_fleet())
        assert not shm_names_now() & shared, "left in /dev/shm"
        assert not [p for p in os.listdir(short) if p.startswith("rollfleet-")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("who", ["sentinel", "next-fleet"])
def test_a_torch_fleet_killed_with_its_whole_process_group_leaves_no_openmp_registration(tmp_path, who):
    # Each worker unlinks its OpenMP registration when it exits, and its supervisor does when it
    # sees one killed; a SIGKILL to the job's whole process group leaves neither. The fleet's
    # sentinel, in a session of its own, removes what the dead fleet's workers listed, their own
    # pids' names among it; with the sentinel killed too (every process of the job: a container
    # stopped), the next fleet started in the same place does.
    if not os.path.exists(IOMP):
        pytest.skip(f"needs Intel's OpenMP at {IOMP}")
    import psutil

    script = tmp_path / "fleet.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio
        from rollfleet.actors import FleetConfig, Supervisor
        from rollfleet.transport.messages import SamplingParams

        async def main():
            config = FleetConfig(engine="torch", num_workers=1, worker_env={{"LD_PRELOAD": {IOMP!r}}})
            async with Supervisor(config) as sup:
                await sup.client().generate("a", [1, 2], SamplingParams(max_tokens=2))  # OpenMP is up
                print(sup.private_dir, sup.slots[0].pid, flush=True)
                await asyncio.sleep(600)

        asyncio.run(main())
    """))
    root = tmp_path / "jobs"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(root)), start_new_session=True)
    try:
        private_dir, pid = proc.stdout.readline().split()
        registration = f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"
        group = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert os.path.exists(registration)
        if who == "sentinel":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert wait_until(lambda: not alive(group), timeout=10)
            assert not os.path.exists(registration), "left in /dev/shm"
            assert not os.path.exists(private_dir)
            assert not [n for n in os.listdir(root) if n.startswith("rollfleet-")]  # (torch keeps a cache there)
            return
        kill_sentinel(proc.pid)  # every process of the job: nobody is left to clean up
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not alive(group), timeout=10)
        assert os.path.exists(registration) and os.path.exists(private_dir)  # nobody was left to clean up

        async def next_fleet():
            async with fleet(1, private_dir_root=str(root)):
                pass

        asyncio.run(next_fleet())
        assert not os.path.exists(registration), "left in /dev/shm"
        assert not os.path.exists(private_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_a_worker_that_says_it_exits_is_replaced_at_once_not_when_its_process_is_done(tmp_path):
    # Its engine died (worker_exit, fatal): it answers nothing more. Its process may take long
    # to end (a real engine's shutdown; here an exit hook that sleeps): its restart begins at
    # once, the slow exit cut short, and the next request does not wait for that exit.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, time
        def slow_exit():
            time.sleep(30)
            open({str(tmp_path / "exited")!r}, "w").close()
        atexit.register(slow_exit)
    """))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    sup = fleet(1, engine_options={"tokens_per_s": 200, "fail_generate_after": 5, "fail_fatal": True}, worker_env=env)
    async with sup:
        first = sup.slots[0]
        client = sup.client()
        with pytest.raises(EngineFailed, match="EngineDead"):  # the request that set it off is not resumed
            await client.generate("r", [1], SamplingParams(max_tokens=20))
        prompt = [1, 2, 3, 4, 5, 6]  # past the failing length: served
        r = await asyncio.wait_for(client.generate("s", prompt, SamplingParams(max_tokens=3)), 60)
        assert r.token_ids == expected_tokens(prompt, 3) and r.worker != first.worker_id
        assert sup.slots[0] is not first and "EngineDead" in first.last_error
        assert not alive([first.pid]) and not (tmp_path / "exited").exists()


CTRL_C_SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whoever started this
    from rollfleet.actors import FleetConfig, Supervisor, SyncClient
    from rollfleet.transport.messages import SamplingParams

    if sys.argv[1] == "sync-starting":  # Ctrl-C while SyncClient still waits for its workers
        config = FleetConfig(engine="echo", num_workers=2, engine_options={"start_delay_s": 60})
        print("starting", flush=True)
        SyncClient(config)
    else:  # a script (a notebook cell) that started a fleet and never shuts it down
        async def main():
            sup = Supervisor(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 20}))
            await sup.start()
            print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
            await sup.client().generate("long", [1, 2], SamplingParams(max_tokens=10_000))
        asyncio.run(main())
""")


@pytest.mark.parametrize("case", ["no-shutdown", "sync-starting"])
def test_ctrl_c_to_the_process_group_leaves_nothing_behind(case, tmp_path):
    # A terminal's Ctrl-C sends SIGINT to the whole foreground group: the script and its workers.
    # The workers leave the decision to the supervisor's process; its end, however it comes
    # (a KeyboardInterrupt out of asyncio.run, a SyncClient given up while it starts), must still
    # take the workers and the private directory with it.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, case], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        line = proc.stdout.readline().split()
        if case == "sync-starting":
            assert line == ["starting"]
            deadline = time.monotonic() + 30
            while len(worker_children(proc.pid)) < 2:
                assert time.monotonic() < deadline, "the workers did not start"
                time.sleep(0.05)
            time.sleep(1.0)  # into their engines' start
            pids = [p.pid for p in worker_children(proc.pid)]
            (private_dir,) = [str(p) for p in tmp_path.iterdir() if p.name.startswith("rollfleet-")]
        else:
            private_dir, pids = line[0], [int(p) for p in line[1:]]
            time.sleep(0.5)  # the request runs
        assert len(alive(pids)) == 2
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert_clean(private_dir, pids, creators=[proc.pid], within=10.0)
        assert "Event loop is closed" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_supervisor_stopped_longer_than_the_heartbeat_timeout_keeps_its_healthy_workers(tmp_path):
    # Stopped (SIGSTOP, a suspended job), the supervisor read no heartbeat meanwhile; once
    # continued, it took its healthy workers for hung and killed them all. Silence now counts
    # only while it could listen.
    script = tmp_path / "stopped.py"
    script.write_text(textwrap.dedent("""
        import asyncio, os, subprocess
        from rollfleet.actors import FleetConfig, Supervisor
        from rollfleet.engines.echo import echo_tokens
        from rollfleet.transport.messages import SamplingParams

        async def main():
            config = FleetConfig(engine="echo", num_workers=2, heartbeat_timeout_s=5.0,
                                 engine_options={"tokens_per_s": 200})
            async with Supervisor(config) as sup:
                pids = [h.pid for h in sup.slots.values()]
                prompts = [[9, 9, i + 1] for i in range(4)]
                batch = asyncio.ensure_future(sup.client().generate_batch(prompts, SamplingParams(max_tokens=2000)))
                await asyncio.sleep(1.0)
                me = os.getpid()
                subprocess.Popen(["sh", "-c", f"kill -STOP {me}; sleep 8; kill -CONT {me}"])
                results = await batch  # stopped meanwhile for 8 s
                assert [r.token_ids for r in results] == [echo_tokens(p, 2000) for p in prompts]
                assert [h.pid for h in sup.slots.values()] == pids, "workers were restarted"
                assert sum(r.num_preemptions for r in results) == 0
                print("kept", flush=True)

        asyncio.run(main())
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "kept", out.stderr[-3000:]


IPC_FRONTEND_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from rollfleet.actors import FleetConfig, Supervisor

    async def main():
        config = FleetConfig(engine="echo", num_workers=1, private_dir_root=sys.argv[1],
                             frontend_addr="ipc://" + sys.argv[2])
        async with Supervisor(config) as sup:
            print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
            await asyncio.sleep(3600)
    asyncio.run(main())
""")


async def test_an_ipc_frontend_file_of_a_fleet_killed_with_its_workers_goes_with_its_private_dir(tmp_path):
    # A SIGKILL of every process of the job (the fleet's sentinel too: a container stopped)
    # leaves no process to remove the socket file a fleet bound for its clients outside its
    # private directory: the next fleet's sweep of that directory does (only if no fleet has
    # bound that path since).
    front = tmp_path / "front.sock"
    proc = subprocess.Popen([sys.executable, "-c", IPC_FRONTEND_SCRIPT, str(tmp_path), str(front)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        private_dir, *pids = proc.stdout.readline().split()
        kill_sentinel(proc.pid)  # with every process of the job
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert await wait_for(lambda: not alive([int(p) for p in pids]), 10.0)
        assert front.exists() and os.path.exists(private_dir)  # nobody was left to remove them
        async with fleet(1, private_dir_root=str(tmp_path)):
            assert not front.exists() and not os.path.exists(private_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_model_serve_writes_for_vllm_goes_with_the_next_fleet_if_serve_is_killed_while_it_starts(tmp_path):
    # `rollfleet serve --engine vllm` without --engine-option model writes a tiny model to a
    # directory of its own before the fleet starts; killed outright (with its workers) before the
    # fleet was up, it used to leave that directory for good.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "rollfleet", "serve", "--engine", "vllm", "--workers", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def model_written():
            return [d for d in tmp_path.glob("rollfleet-serve-model-*") if (d / "config.json").exists()]
        assert wait_until(lambda: bool(model_written()), timeout=120)
        time.sleep(0.5)  # its weights are written; the fleet is starting
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        (model,) = model_written()
        time.sleep(1.0)  # the group's processes are gone (the workers' reaping aside)

        async def next_fleet():
            async with fleet(1, private_dir_root=str(tmp_path)):
                pass

        asyncio.run(next_fleet())
        assert not model.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
