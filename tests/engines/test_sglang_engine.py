"""The sglang adapter against a stand-in for sglang.Engine (tests/engines/sglang_standin.py).

SGLang cannot run on CPU machines; the stand-in is shaped like SGLang's Engine and its
TokenizerManager (control coroutines on the manager, taking SGLang's request objects; the
Engine's sync methods driving the Engine's own loop), so these tests check the adapter's side:
request mapping, streaming, abort by rid, pause and sleep, weight updates, capability discovery.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from rollfleet.engines import create_engine
from rollfleet.engines.sglang_engine import SglangEngine, finish_reason, load_factory
from rollfleet.errors import EngineFailed, InvalidRequest, Unsupported
from rollfleet.transport.messages import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from sglang_standin import MinimalStandinEngine, ServerArgs, StandinEngine, TokenizerManager  # noqa: E402

FULL = "sglang_standin:StandinEngine"
MINIMAL = "sglang_standin:MinimalStandinEngine"


def expected(prompt: list[int], n: int, offset: int = 0) -> list[int]:
    ref = TokenizerManager(ServerArgs("x"))
    ref.offset = offset
    last, length, out = prompt[-1], len(prompt), []
    for _ in range(n):
        last, length = ref.next_token(last, length), length + 1
        out.append(last)
    return out


async def collect(engine, rid, prompt, params):
    tokens, lps, reason, chunks = [], [], None, 0
    async for out in engine.generate(rid, prompt, params):
        tokens += out.token_ids
        lps += out.logprobs or []
        reason = out.finish_reason
        chunks += 1
    return tokens, lps, reason, chunks


@pytest.fixture
async def engine():
    eng = create_engine("sglang", {"model": "/models/x", "engine_factory": FULL, "seed": 3, "extra": {"tp_size": 1}})
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_start_passes_model_and_token_in_token_out(engine):
    assert isinstance(engine, SglangEngine) and isinstance(engine.engine, StandinEngine)
    args = engine.engine.server_args
    assert args.model_path == "/models/x" and args.skip_tokenizer_init and args.tp_size == 1
    assert args.random_seed == 3  # the seed option, with no per-worker seed given
    assert args.enable_memory_saver  # sleep frees memory only with it
    # Built on the worker's loop: the loop the Engine's own sync methods would drive.
    assert engine.engine.loop is asyncio.get_running_loop()


async def test_a_fleets_per_worker_sampling_seed_is_sglangs_random_seed():
    eng = create_engine("sglang", {"model": "/m", "engine_factory": FULL, "seed": 3, "sampling_seed": 41})
    await eng.start()
    try:
        assert eng.engine.server_args.random_seed == 41
    finally:
        await eng.shutdown()


async def test_generate_streams_only_new_tokens(engine):
    tokens, lps, reason, chunks = await collect(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=20, logprobs=True))
    assert tokens == expected([1, 2, 3], 20)
    assert chunks == 20 and reason == "length"
    assert lps == pytest.approx([-1.0 - 0.001 * (i + 1) for i in range(20)])


async def test_stop_token_ends_with_stop(engine):
    ref = expected([5], 30)
    tokens, _, reason, _ = await collect(engine, "s", [5], SamplingParams(max_tokens=30, stop_token_ids=[ref[4]]))
    assert tokens == ref[: ref.index(ref[4]) + 1] and reason == "stop"


async def test_abort_stops_that_request_by_rid(engine):
    first = asyncio.Event()

    async def victim():
        async for out in engine.generate("victim", [1], SamplingParams(max_tokens=100000)):
            first.set()
            reason = out.finish_reason
        return reason

    task = asyncio.create_task(victim())
    other = asyncio.create_task(collect(engine, "other", [2], SamplingParams(max_tokens=50)))
    await asyncio.wait_for(first.wait(), 5)
    await engine.abort("victim")
    assert await asyncio.wait_for(task, 5) == "abort"
    assert (await asyncio.wait_for(other, 5))[2] == "length"
    await engine.abort("unknown")  # ignored
    assert engine.stats()["num_running"] == 0


async def test_cancelling_the_consumer_aborts_the_request(engine):
    gen = engine.generate("c", [1], SamplingParams(max_tokens=100000))
    await gen.__anext__()
    await gen.aclose()
    assert "abort_request" in engine.engine.tokenizer_manager.calls
    assert not engine.engine.tokenizer_manager.rid_to_state


async def test_pause_keeps_requests_and_resume_finishes_them(engine):
    got, first = [], asyncio.Event()

    async def run():
        async for out in engine.generate("p", [7], SamplingParams(max_tokens=300)):
            got.extend(out.token_ids)
            first.set()
        return out.finish_reason

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 5)
    await engine.pause()
    assert engine.engine.tokenizer_manager.pause_mode == "retract"  # the mode that keeps requests
    await asyncio.sleep(0.05)  # a step already under way may still deliver its token
    held = len(got)
    await asyncio.sleep(0.1)
    assert len(got) == held < 300 and not task.done()
    assert engine.stats()["paused"]
    await engine.resume()
    assert await asyncio.wait_for(task, 5) == "length"
    assert got == expected([7], 300)
    assert not engine.stats()["paused"]


async def test_a_request_sent_while_paused_waits_for_resume(engine):
    await engine.pause()
    task = asyncio.create_task(collect(engine, "late", [4], SamplingParams(max_tokens=5)))
    await asyncio.sleep(0.05)
    assert not task.done()
    await engine.resume()
    tokens, _, reason, _ = await asyncio.wait_for(task, 5)
    assert tokens == expected([4], 5) and reason == "length"


async def test_weights_go_through_update_weights_from_tensor(engine):
    torch = pytest.importorskip("torch")
    manager = engine.engine.tokenizer_manager
    await engine.load_weights([("offset", torch.tensor([5]))])
    assert manager.num_flushes == 1
    tokens, *_ = await collect(engine, "w", [1, 2], SamplingParams(max_tokens=8))
    assert tokens == expected([1, 2], 8, offset=5)


async def test_a_weight_update_paused_mid_request_applies_and_the_request_resumes(engine):
    torch = pytest.importorskip("torch")
    first = asyncio.Event()

    async def run():
        tokens = []
        async for out in engine.generate("m", [3], SamplingParams(max_tokens=400)):
            tokens += out.token_ids
            first.set()
        return tokens, out.finish_reason

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 5)
    await engine.pause()
    await engine.load_weights([("offset", torch.tensor([2]))])
    assert engine.engine.tokenizer_manager.num_flushes == 1  # retracted requests let the cache go
    await engine.resume()
    tokens, reason = await asyncio.wait_for(task, 5)
    assert reason == "length" and len(tokens) == 400


async def test_a_weight_update_the_engine_refuses_raises(engine):
    torch = pytest.importorskip("torch")
    with pytest.raises(EngineFailed, match="no parameter lm_head.weight"):
        await engine.load_weights([("offset", torch.tensor([5])), ("lm_head.weight", torch.zeros(2))])
    tokens, *_ = await collect(engine, "w", [1, 2], SamplingParams(max_tokens=8))
    assert tokens == expected([1, 2], 8)  # nothing of it was applied


async def test_weights_reach_every_tp_rank():
    torch = pytest.importorskip("torch")
    eng = create_engine("sglang", {"model": "/m", "engine_factory": FULL, "extra": {"tp_size": 2}})
    await eng.start()
    try:
        await eng.load_weights([("offset", torch.tensor([1]))])
        tokens, *_ = await collect(eng, "t", [9], SamplingParams(max_tokens=4))
        assert tokens == expected([9], 4, offset=1)
    finally:
        await eng.shutdown()


async def test_sleep_and_wake_release_and_resume_memory(engine):
    manager = engine.engine.tokenizer_manager
    await engine.sleep()
    assert manager.memory_released
    await engine.wake_up()
    assert not manager.memory_released
    assert manager.calls[-2:] == ["release_memory_occupation", "resume_memory_occupation"]


async def test_without_the_memory_saver_there_is_no_sleep():
    eng = create_engine("sglang", {"model": "/m", "engine_factory": FULL, "extra": {"enable_memory_saver": False}})
    await eng.start()
    try:
        assert "sleep" not in eng.capabilities() and "pause" in eng.capabilities()
        with pytest.raises(Unsupported, match="enable_memory_saver"):
            await eng.sleep()
        assert "release_memory_occupation" not in eng.engine.tokenizer_manager.calls
    finally:
        await eng.shutdown()


async def test_flush_and_profile(engine, tmp_path):
    manager = engine.engine.tokenizer_manager
    await engine.clear_kv_cache()
    assert manager.num_flushes == 1
    await engine.start_profile(str(tmp_path))
    assert manager.profile_dir == str(tmp_path)
    await engine.stop_profile()
    assert manager.profile_dir is None


async def test_a_refused_flush_is_logged(engine, caplog):
    engine.engine.tokenizer_manager.refuse_flush = True
    with caplog.at_level("WARNING", logger="rollfleet.engines.sglang_engine"):
        await engine.clear_kv_cache()
    assert engine.engine.tokenizer_manager.num_flushes == 0
    assert "refused to flush" in caplog.text


@pytest.mark.parametrize("prompt", [[], [1, 512], [-1], [1] * 4096])
async def test_a_prompt_the_model_cannot_take_is_bad_field(engine, prompt):
    with pytest.raises(InvalidRequest) as info:
        async for _ in engine.generate("bad", prompt, SamplingParams(max_tokens=3)):
            pass
    assert info.value.code == "bad_field"
    assert engine.stats()["num_requests"] == 0 and not engine.engine.tokenizer_manager.rid_to_state


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
async def test_the_engines_own_sync_methods_cannot_run_on_the_workers_loop(engine):
    # Why the adapter awaits the manager's coroutines: SGLang's sync methods drive the loop
    # the Engine was built on, here the one already running.
    with pytest.raises(RuntimeError):
        engine.engine.flush_cache()


async def test_capabilities_reflect_the_installed_engine():
    full = SglangEngine({"model": "m", "engine_factory": FULL})
    old = SglangEngine({"model": "m", "engine_factory": MINIMAL})
    assert full.capabilities() == set()  # not started
    await full.start()
    await old.start()
    try:
        assert full.capabilities() == {"logprobs", "pause", "sleep", "load_weights", "clear_kv_cache", "profile"}
        assert isinstance(old.engine, MinimalStandinEngine)
        assert old.capabilities() == {"logprobs"}
        assert not hasattr(old.engine, "pause_generation") and not hasattr(old.engine, "abort_request")
        for call in (old.pause(), old.resume(), old.sleep(), old.wake_up(), old.clear_kv_cache(),
                     old.load_weights([]), old.start_profile("/tmp"), old.load_lora("a", [], {})):
            with pytest.raises(Unsupported):
                await call
        tokens, _, reason, _ = await collect(old, "g", [3], SamplingParams(max_tokens=5))
        assert tokens == expected([3], 5) and reason == "length"
    finally:
        await full.shutdown()
        await old.shutdown()
        await old.shutdown()  # idempotent
    assert old.engine is None


def test_bad_options_and_helpers():
    with pytest.raises(ValueError):
        SglangEngine({})
    with pytest.raises(ValueError):
        load_factory("no_colon")
    assert finish_reason({"finish_reason": {"type": "length"}}) == "length"
    assert finish_reason({"finish_reason": {"type": "abort"}}) == "abort"
    assert finish_reason({"finish_reason": None}) is None


def test_sglang_import_is_lazy_and_missing_sglang_fails_at_start(tmp_path):
    # An sglang package that fails to import, ahead of any real one: building the adapter must
    # not touch it (a fleet of other engines never imports sglang), and start() must fail with
    # the ImportError.
    shadow = tmp_path / "nosglang" / "sglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('sglang left out by the test')\n")
    code = (
        "import asyncio, sys\n"
        "from rollfleet.engines import create_engine\n"
        "eng = create_engine('sglang', {'model': 'm'})\n"
        "assert 'sglang' not in sys.modules, 'building the adapter imported sglang'\n"
        "try:\n"
        "    asyncio.run(eng.start())\n"
        "except ImportError as exc:\n"
        "    print('start:', exc)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "start: sglang left out by the test", out.stdout + out.stderr