"""Deployment modes: hybrid (sleep around training), standalone (collective weights),
colocated (no weight sync), and a policy fleet beside a reward fleet in one group."""

import asyncio
import time

import pytest
import torch

from rollfleet.actors import FleetConfig, FleetGroup, Supervisor, SyncClient
from rollfleet.errors import FleetClosed, Unsupported, WeightUpdateError
from rollfleet.transport.messages import SamplingParams

from ..helpers import wait_for
from .test_fleet_echo import expected_tokens

pytestmark = pytest.mark.usefixtures("no_leaks")


async def test_hybrid_training_context_sleeps_and_wakes_the_engines():
    async with Supervisor(FleetConfig(engine="echo", mode="hybrid", num_workers=2)) as sup:
        async with sup.training(level=2):
            stats = await sup.stats()
            assert all(w["engine_stats"]["sleeping"] for w in stats["workers"])
            assert stats["sleep_level"] == 2  # the fleet's own stats say so, not only each engine's
        stats = await sup.stats()
        assert not any(w["engine_stats"]["sleeping"] for w in stats["workers"])
        assert stats["sleep_level"] == 0 and stats["engines_paused"] is False
        report = await sup.update_weights([("offset", torch.tensor([1]))], version=1)
        assert {w.transport for w in report.workers.values()} == {"shm"}


async def test_nested_and_overlapping_training_blocks_keep_the_engines_asleep_until_the_last_ends():
    async with Supervisor(FleetConfig(engine="echo", mode="hybrid", num_workers=2)) as sup:
        async def sleeping():
            return [w["engine_stats"]["sleeping"] for w in (await sup.stats())["workers"]]

        async with sup.training():
            async with sup.training():  # a helper that wraps its own part of the step
                assert await sleeping() == [True, True]
            assert await sleeping() == [True, True]
        assert await sleeping() == [False, False]

        seen = []

        async def step(seconds):
            async with sup.training():
                await asyncio.sleep(seconds)
                seen.append(await sleeping())

        await asyncio.gather(step(0.1), step(0.5))  # the short step's end must not wake the long one
        assert seen == [[True, True], [True, True]]
        assert await sleeping() == [False, False]
        with pytest.raises(RuntimeError):
            async with sup.training():
                raise RuntimeError("the step failed")
        assert await sleeping() == [False, False]


def test_sync_training_blocks_nest_and_a_shutdown_inside_one_is_not_an_error():
    with SyncClient(FleetConfig(engine="echo", mode="hybrid", num_workers=1)) as fleet:
        with fleet.training():
            with fleet.training():
                pass
            assert fleet.stats()["workers"][0]["engine_stats"]["sleeping"]
        assert not fleet.stats()["workers"][0]["engine_stats"]["sleeping"]
        with fleet.training():
            fleet.shutdown()
    with pytest.raises(FleetClosed):
        fleet.stats()


async def test_standalone_fleet_moves_weights_over_the_collective():
    async with Supervisor(FleetConfig(engine="echo", mode="standalone", num_workers=2)) as sup:
        report = await sup.update_weights([("offset", torch.tensor([2]))], version=1)
        assert {w.transport for w in report.workers.values()} == {"collective"}
        r = await sup.client().generate("r", [3], SamplingParams(max_tokens=4))
        assert r.token_ids == expected_tokens([3], 4, offset=2) and r.weight_versions == [1]


async def test_a_collective_update_refused_early_fails_at_once_and_never_holds_the_loop():
    # Bucket 0 refused by the engine while the sender has buckets 1 and 2 broadcast already
    # (three buffers): the worker refused those without joining their broadcasts, and the
    # supervisor's group, let go of on its loop, waited for them until the group's timeout (30 s
    # here; 120 s by default), the whole event loop held: no request, stats or abort meanwhile.
    config = FleetConfig(engine="echo", num_workers=1,
                         weights={"transport": "collective", "bucket_bytes": 1 << 20, "timeout_s": 30.0})
    big = [(f"t{i}", torch.full((1 << 18,), float(i))) for i in range(20)]  # 1 MiB each: a bucket each
    async with Supervisor(config) as sup:
        await sup.update_weights(big + [("offset", torch.tensor([1]))], version=1)
        worst, ticking = [0.0], True

        async def tick() -> None:
            last = time.monotonic()
            while ticking:
                await asyncio.sleep(0.05)
                worst[0], last = max(worst[0], time.monotonic() - last), time.monotonic()

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateError, match="fail"):
            await sup.update_weights([("fail", torch.ones(4))] + big, version=2)
        took = time.monotonic() - t0
        await asyncio.sleep(0.5)
        ticking = False
        await ticker
        assert took < 15 and worst[0] < 5, (took, worst[0])
        report = await sup.update_weights(big + [("offset", torch.tensor([3]))], version=3)
        assert {w.transport for w in report.workers.values()} == {"collective"}
        r = await sup.client().generate("r", [3], SamplingParams(max_tokens=4))
        assert r.token_ids == expected_tokens([3], 4, offset=3) and r.weight_versions == [3]


async def test_colocated_policy_and_reward_fleets_in_one_group():
    configs = {
        "policy": FleetConfig(engine="echo", mode="hybrid", num_workers=1),
        "reward": FleetConfig(engine="echo", mode="colocated", num_workers=1, frontend_addr=None),
    }
    async with FleetGroup(configs) as group:
        await group["policy"].update_weights([("offset", torch.tensor([4]))], version=7)
        with pytest.raises(Unsupported):
            await group["reward"].update_weights([("offset", torch.tensor([4]))], version=7)
        policy = await group["policy"].client().generate("p", [5], SamplingParams(max_tokens=3))
        reward = await group["reward"].client().generate("p", [5], SamplingParams(max_tokens=3))
        assert policy.weight_versions == [7] and reward.weight_versions == [0]
        assert reward.token_ids == expected_tokens([5], 3)
        stats = await group.stats()
        assert stats["policy"]["mode"] == "hybrid" and stats["reward"]["mode"] == "colocated"


def test_bad_mode_is_refused():
    with pytest.raises(ValueError):
        FleetConfig(mode="cluster")


async def test_zmq_transport_carries_bucket_bytes_as_frames_into_a_real_engine():
    from rollfleet.engines.tiny import tiny_llama_model

    model = tiny_llama_model(0)
    gen = torch.Generator().manual_seed(5)
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    async with Supervisor(FleetConfig(engine="torch", num_workers=1, engine_options={"seed": 0},
                                      weights={"transport": "zmq"})) as sup:
        report = await sup.update_weights(list(new.items()), version=1, bucket_bytes=256 << 10)
        assert {w.transport for w in report.workers.values()} == {"zmq"} and report.num_buckets > 2
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        result = await sup.client().generate("z", [1, 9, 33], params)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])
        ids = model.generate(torch.tensor([[1, 9, 33]]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    assert result.token_ids == ids[0, 3:].tolist() and result.weight_versions == [1]


async def test_a_worker_restarted_while_the_fleet_sleeps_and_is_paused_comes_back_asleep_and_paused():
    import os
    import signal

    from ..helpers import wait_for

    async with Supervisor(FleetConfig(engine="echo", mode="hybrid", num_workers=2,
                                      engine_options={"tokens_per_s": 100})) as sup:
        client = sup.client()
        await client.sleep(2)
        await client.control("pause")
        victim = sup.slots[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 15)
        stats = await sup.stats()
        assert [(w["engine_stats"]["sleeping"], w["engine_stats"]["paused"]) for w in stats["workers"]] == \
            [(True, True), (True, True)]
        # paused: a request waits on every worker, the restarted one too, until resume
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=3)))
                 for i in range(4)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in tasks)
        await client.control("resume")
        await client.wake_up()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [r.token_ids for r in results] == [expected_tokens([i + 1], 3) for i in range(4)]
        assert {r.worker for r in results} <= {w["worker_id"] for w in stats["workers"]}


@pytest.mark.parametrize("when", ["opens", "wakes"])
async def test_a_worker_that_dies_as_the_training_block_opens_or_wakes_leaves_the_fleet_awake(when):
    import os
    import signal

    from rollfleet.errors import WorkerLost

    from ..helpers import wait_for

    # opens: the sleep failed on the dead worker only, so the block did not open and nothing woke
    # the others. wakes: the wake_up failed on the dead worker only, yet the fleet kept counting
    # itself asleep: the restarted worker was put to sleep (a torch engine then holds its
    # requests for good).
    async with Supervisor(FleetConfig(engine="echo", mode="hybrid", num_workers=2)) as sup:
        victim = sup.slots[1]
        with pytest.raises(WorkerLost):
            if when == "opens":
                os.kill(victim.pid, signal.SIGKILL)  # dead before it can answer the sleep
            async with sup.training():
                if when == "wakes":
                    os.kill(victim.pid, signal.SIGKILL)  # dead before it can answer the wake_up
        assert (await sup.stats())["sleep_level"] == 0
        assert await wait_for(lambda: sup.slots[1] is not victim and sup.slots[1].state.value == "ready", 15)
        stats = await sup.stats()
        assert stats["sleep_level"] == 0
        assert [w["engine_stats"]["sleeping"] for w in stats["workers"]] == [False, False]


async def test_a_control_op_given_up_on_at_once_still_reaches_every_engine():
    # Cancelled before its calls went out, a sleep left the fleet saying sleep_level 1 while no
    # engine slept; a worker restarted then was put to sleep.
    async with Supervisor(FleetConfig(engine="echo", mode="hybrid", num_workers=2)) as sup:
        for op, args, flag in (("sleep", {"level": 1}, True), ("wake_up", {}, False)):
            call = asyncio.ensure_future(sup.control(op, args))
            await asyncio.sleep(0)  # under way, its calls not sent yet
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

            async def engines():
                return [w["engine_stats"]["sleeping"] for w in (await sup.stats())["workers"]]

            deadline = asyncio.get_running_loop().time() + 10
            while await engines() != [flag, flag] and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert await engines() == [flag, flag]
            assert (await sup.stats())["sleep_level"] == (1 if flag else 0)


@pytest.mark.parametrize("op", ["pause", "training"])
async def test_a_control_op_a_stopped_worker_times_out_on_stays_in_force_so_its_opposite_frees_every_engine(op):
    import psutil

    from rollfleet.errors import RequestTimeout

    # A worker stopped past call_timeout_s took the op all the same once it ran again (its
    # call was queued), as the other did at once; the fleet put back its state ("not paused"),
    # so every request then hung on paused engines, and resume was the only way out but said
    # nothing of it. Now the fleet says "paused" and the error says what to do.
    async with Supervisor(FleetConfig(engine="echo", num_workers=2, call_timeout_s=1.0,
                                      heartbeat_timeout_s=120.0)) as sup:
        client = sup.client()
        stopped = psutil.Process(sup.slots[0].pid)
        stopped.suspend()
        try:
            if op == "pause":
                with pytest.raises(RequestTimeout, match="in force all the same.*call pause again, or resume"):
                    await client.control("pause")
                assert (await sup.stats(engines=False))["engines_paused"] is True
            else:  # the block does not open, and wakes the engine that went to sleep
                with pytest.raises(RequestTimeout):
                    async with sup.training():
                        pytest.fail("the block opened")
                assert (await sup.stats(engines=False))["sleep_level"] == 0
        finally:
            stopped.resume()
        if op == "pause":
            await client.control("resume")
        seen: list = []

        async def every_engine_free() -> bool:
            seen[:] = [(w["engine_stats"]["sleeping"], w["engine_stats"]["paused"])
                       for w in (await sup.stats())["workers"]]
            return seen == [(False, False), (False, False)]

        # The worker that ran again answers stats as it reads them, while the ops queued before
        # (the ones the fleet timed out on) run in tasks of their own: it gets there a moment later.
        assert await wait_for(every_engine_free, 10), f"(sleeping, paused) per engine: {seen}"
        results = await asyncio.wait_for(asyncio.gather(
            *(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=3)) for i in range(4))), 10)
        assert [r.token_ids for r in results] == [expected_tokens([i + 1], 3) for i in range(4)]


@pytest.mark.parametrize("hold, undo", [("pause", "resume"), ("sleep", "wake_up")])
async def test_a_worker_restarted_during_a_resume_or_wake_up_is_not_left_paused_or_asleep(hold, undo):
    # The restarted worker is being paused (or put to sleep) before it serves when the opposite
    # op begins, which reaches only the workers ready by then: it must come up as that op leaves
    # the others, not as they were. Every control op takes 1.5 s in the engines, so the two overlap.
    import os
    import signal

    from rollfleet.actors import RestartPolicy
    from rollfleet.actors.handle import WorkerState

    from ..helpers import wait_for

    config = FleetConfig(engine="echo", num_workers=2, frontend_addr=None, restart=RestartPolicy(backoff_s=0.0),
                         engine_options={"tokens_per_s": 1000, "control_delay_s": 1.5})
    async with Supervisor(config) as sup:
        client = sup.client()
        await client.control(hold)
        victim = sup.slots[1]
        os.kill(victim.pid, signal.SIGKILL)
        # registered and being held: the hold's call is under way (1.5 s) when the opposite op starts
        assert await wait_for(lambda: sup.slots[1] is not victim and sup.slots[1].state is WorkerState.STARTING
                              and sup.slots[1].engine, 30)
        assert set(await client.control(undo)) == {sup.slots[0].worker_id}  # the one ready when it began
        assert await wait_for(lambda: sup.slots[1].state is WorkerState.READY, 15)
        stats = await sup.stats()
        key = "paused" if hold == "pause" else "sleeping"
        assert [w["engine_stats"][key] for w in stats["workers"]] == [False, False]
        assert (stats["engines_paused"], stats["sleep_level"]) == (False, 0)
        # nothing waits on a paused engine: every request ends, on either worker
        results = await asyncio.wait_for(asyncio.gather(
            *(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=3)) for i in range(8))), 20)
        assert [r.token_ids for r in results] == [expected_tokens([i + 1], 3) for i in range(8)]


async def test_a_pause_whose_worker_dies_during_the_call_says_it_is_in_force_and_the_replacement_comes_up_paused():
    import os
    import signal

    from rollfleet.actors import RestartPolicy
    from rollfleet.actors.handle import WorkerState
    from rollfleet.errors import WorkerLost

    from ..helpers import wait_for

    config = FleetConfig(engine="echo", num_workers=2, frontend_addr=None, restart=RestartPolicy(backoff_s=0.0),
                         engine_options={"tokens_per_s": 1000, "control_delay_s": 3})
    async with Supervisor(config) as sup:
        client = sup.client()
        victim = sup.slots[0]
        pausing = asyncio.ensure_future(client.control("pause"))
        await asyncio.sleep(0.5)  # sent to both; each engine takes 3 s to answer
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerLost) as lost:
            await asyncio.wait_for(pausing, 30)
        message = str(lost.value)
        assert "pause is in force all the same" in message and "replacement comes up so" in message
        assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state is WorkerState.READY, 30)
        stats = await sup.stats()
        assert stats["engines_paused"] is True
        assert [w["engine_stats"]["paused"] for w in stats["workers"]] == [True, True]
        await client.control("resume")
        result = await asyncio.wait_for(client.generate("r", [3], SamplingParams(max_tokens=2)), 20)
        assert result.token_ids == expected_tokens([3], 2)


async def test_a_weight_update_while_a_restarted_worker_is_being_paused_reaches_it_before_it_serves():
    # Neither ready nor gone while it is being paused, it is not among the update's workers; it
    # must be brought to the update's version before it serves, not come up with the one before.
    import os
    import signal

    from rollfleet.actors import RestartPolicy
    from rollfleet.actors.handle import WorkerState
    from rollfleet.engines.echo import echo_tokens

    from ..helpers import wait_for

    config = FleetConfig(engine="echo", num_workers=2, frontend_addr=None, restart=RestartPolicy(backoff_s=0.0),
                         deterministic_routing=True, engine_options={"tokens_per_s": 1000, "control_delay_s": 1.5})
    async with Supervisor(config) as sup:
        client = sup.client()
        await client.update_weights([("offset", torch.tensor([5]))], version=1)
        await client.control("pause")
        victim = sup.slots[1]
        os.kill(victim.pid, signal.SIGKILL)
        # caught up to version 1, and now being paused (1.5 s)
        assert await wait_for(lambda: sup.slots[1] is not victim and sup.slots[1].state is WorkerState.STARTING
                              and sup.slots[1].weight_version == 1, 30)
        held = sup.slots[1]
        await client.update_weights([("offset", torch.tensor([9]))], version=2)
        assert await wait_for(lambda: held.state is WorkerState.READY, 15)
        assert held.weight_version == 2
        await client.control("resume")
        stats = await sup.stats()
        assert [(w["weight_version"], w["engine_stats"]["offset"]) for w in stats["workers"]] == [(2, 9), (2, 9)]
        results = await asyncio.gather(*(client.generate(f"r{i}", [7], SamplingParams(max_tokens=4),
                                                         session_id=f"s{i}") for i in range(8)))
        assert {r.worker for r in results} == {w["worker_id"] for w in stats["workers"]}  # both served
        assert {(tuple(r.token_ids), tuple(r.weight_versions)) for r in results} == {
            (tuple(echo_tokens([7], 4, offset=9)), (2,))}


async def test_a_group_whose_start_is_cancelled_stops_the_fleets_already_up():
    group = FleetGroup({"fast": FleetConfig(engine="echo", num_workers=1),
                        "slow": FleetConfig(engine="echo", num_workers=1, engine_options={"start_delay_s": 30})})
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(group.start(), 8)  # the fast one is up by then, the slow one is not
    assert group["fast"].closed and group["slow"].closed  # the fast one was left serving


async def test_a_control_op_waiting_when_the_fleet_shuts_down_ends_with_fleet_closed():
    sup = Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"control_delay_s": 3}))
    await sup.start()
    sleeping = asyncio.ensure_future(sup.client().sleep())
    await asyncio.sleep(0.5)  # sent; the engine takes 3 s to answer
    await sup.shutdown()
    with pytest.raises(FleetClosed):  # was WorkerLost, as if a worker had died
        await sleeping
