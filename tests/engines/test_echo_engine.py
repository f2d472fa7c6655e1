"""The echo engine's capacity options: ``max_running`` (a batch limit, later requests wait their
turn, an abort ends a waiting one at once) and ``step_tokens`` (paced tokens made K at a time)."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.engines import check_engine_options
from rollfleet.engines.echo import DEFAULT_MAX_MODEL_LEN, EchoEngine, echo_tokens
from rollfleet.errors import InvalidRequest
from rollfleet.transport.messages import SamplingParams

from ..helpers import wait_for


async def collect(engine: EchoEngine, request_id: str, prompt: list[int], max_tokens: int,
                  started: list[str] | None = None) -> tuple[list[int], str]:
    tokens: list[int] = []
    finish = ""
    async for out in engine.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens)):
        if started is not None and not tokens and out.token_ids:
            started.append(request_id)
        tokens += out.token_ids
        finish = out.finish_reason or finish
    return tokens, finish


async def test_max_running_bounds_concurrency_and_serves_in_arrival_order():
    engine = EchoEngine({"max_running": 2, "tokens_per_s": 400})
    await engine.start()
    peak = 0
    started: list[str] = []
    tasks = [asyncio.create_task(collect(engine, f"r{i}", [i + 1], 8, started)) for i in range(6)]
    while not all(t.done() for t in tasks):
        stats = engine.stats()
        peak = max(peak, stats["num_running"])
        assert stats["num_running"] + stats["num_waiting"] <= 6
        await asyncio.sleep(0.001)
    assert peak == 2
    assert started == [f"r{i}" for i in range(6)]
    for i, task in enumerate(tasks):
        assert task.result() == (echo_tokens([i + 1], 8), "length")
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0


async def test_abort_ends_a_waiting_request_at_once_and_leaves_the_others_whole():
    engine = EchoEngine({"max_running": 1, "tokens_per_s": 100})
    await engine.start()
    first = asyncio.create_task(collect(engine, "a", [5], 2000))  # 20 s at 100/s: holds the only slot
    assert await wait_for(lambda: engine.stats()["num_running"] == 1)
    waiting = asyncio.create_task(collect(engine, "b", [6], 20))
    third = asyncio.create_task(collect(engine, "c", [7], 3))
    assert await wait_for(lambda: engine.stats()["num_waiting"] == 2)
    await engine.abort("b")
    # Ends while "a" still holds the only slot, without waiting for it.
    assert await asyncio.wait_for(waiting, 5) == ([], "abort")
    assert not first.done() and not third.done()
    await engine.abort("a")
    tokens, reason = await asyncio.wait_for(first, 5)
    assert reason == "abort" and 0 < len(tokens) < 2000 and tokens == echo_tokens([5], 2000)[:len(tokens)]
    assert await asyncio.wait_for(third, 5) == (echo_tokens([7], 3), "length")


async def test_a_cancelled_waiter_gives_back_any_slot_it_was_granted():
    engine = EchoEngine({"max_running": 1, "tokens_per_s": 1000})
    await engine.start()
    holder = asyncio.create_task(collect(engine, "a", [1], 200))  # 0.2 s: still running while b waits
    assert await wait_for(lambda: engine.stats()["num_running"] == 1)
    gone = asyncio.create_task(collect(engine, "b", [2], 5))
    assert await wait_for(lambda: engine.stats()["num_waiting"] == 1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await holder
    # The slot came back: two more requests run one after the other, none hangs.
    results = await asyncio.wait_for(asyncio.gather(collect(engine, "c", [3], 4), collect(engine, "d", [4], 4)), 5)
    assert results == [(echo_tokens([3], 4), "length"), (echo_tokens([4], 4), "length")]
    assert engine.stats()["free_slots"] == 1 and engine.stats()["num_waiting"] == 0


@pytest.mark.parametrize("step", [1, 3, 8])
async def test_step_tokens_changes_pacing_not_tokens(step):
    engine = EchoEngine({"tokens_per_s": 2000, "step_tokens": step})
    await engine.start()
    turns = 0

    async def ticker() -> None:  # counts the loop's turns: it runs whenever the engine waits
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    seen: list[int] = []  # the turn each token came in
    tokens: list[int] = []
    sizes: list[int] = []
    try:
        async for out in engine.generate("s", [9, 4], SamplingParams(max_tokens=17, logprobs=True)):
            assert len(out.logprobs) == len(out.token_ids)
            sizes.append(len(out.token_ids))
            tokens += out.token_ids
            seen += [turns] * len(out.token_ids)
    finally:
        tick.cancel()
    assert tokens == echo_tokens([9, 4], 17)
    assert sizes == [step] * (17 // step) + ([17 % step] if 17 % step else [])  # one output a step
    # One wait per step: tokens of a step come without the loop turning in between.
    assert len(set(seen)) == -(-17 // step)
    assert all(seen[i] == seen[i - i % step] for i in range(17))


async def test_an_abort_between_steps_ends_with_the_tokens_made_so_far():
    engine = EchoEngine({"tokens_per_s": 200, "step_tokens": 4})
    await engine.start()
    outputs = []
    async for out in engine.generate("x", [3], SamplingParams(max_tokens=40)):
        outputs.append(out)
        if len(outputs) == 2:
            await engine.abort("x")
    tokens = [t for out in outputs for t in out.token_ids]
    assert [len(o.token_ids) for o in outputs] == [4, 4, 0]
    assert outputs[-1].finish_reason == "abort" and all(o.finish_reason is None for o in outputs[:-1])
    assert tokens == echo_tokens([3], 8)


async def test_an_abort_while_paused_ends_the_request_at_once_the_others_wait_for_resume():
    # as vLLM does (pause_generation keeps requests, abort still ends them): checked against the
    # real vLLM engine in test_vllm_engine.py
    engine = EchoEngine({"tokens_per_s": 200})
    await engine.start()
    held = asyncio.create_task(collect(engine, "held", [5], 30))
    aborted = asyncio.create_task(collect(engine, "gone", [6], 30))
    assert await wait_for(lambda: engine.num_tokens >= 4)
    await engine.pause()
    made = engine.num_tokens
    await asyncio.sleep(0.05)  # 10 tokens' time: nothing is made while paused
    assert engine.num_tokens == made
    await engine.abort("gone")
    tokens, finish = await asyncio.wait_for(aborted, 2)
    assert finish == "abort" and 0 < len(tokens) < 30 and tokens == echo_tokens([6], len(tokens))
    assert not held.done() and engine.num_tokens == made
    await engine.resume()
    tokens, finish = await asyncio.wait_for(held, 5)
    assert finish == "length" and tokens == echo_tokens([5], 30)


@pytest.mark.parametrize("step", [1, 4])
async def test_max_model_len_ends_a_request_at_the_context_whatever_its_max_tokens(step):
    engine = EchoEngine({"max_model_len": 10, "step_tokens": step})
    await engine.start()
    # 2**62 tokens asked: the context (10) ends it, as a model's would, with finish reason length.
    assert await collect(engine, "long", [5, 6, 7], 1 << 62) == (echo_tokens([5, 6, 7], 7), "length")
    # A resumed request (prompt + its partial output) ends at the same place.
    first = echo_tokens([5, 6, 7], 3)
    assert await collect(engine, "resumed", [5, 6, 7, *first], 1 << 62) == (echo_tokens([5, 6, 7], 7)[3:], "length")
    # max_tokens below the room left still rules.
    assert await collect(engine, "short", [5, 6, 7], 2) == (echo_tokens([5, 6, 7], 2), "length")
    with pytest.raises(InvalidRequest, match="fewer than 10") as err:
        await collect(engine, "full", list(range(1, 11)), 1)
    assert err.value.code == "bad_field"
    assert DEFAULT_MAX_MODEL_LEN == EchoEngine().max_model_len == 1 << 20


def test_max_model_len_is_checked_before_a_worker_starts():
    check_engine_options("echo", {"max_model_len": 4096})
    for bad in (1, 0, -5, 2.5, "4096", True):
        with pytest.raises(ValueError, match="max_model_len"):
            check_engine_options("echo", {"max_model_len": bad})
