"""The sglang adapter against a stand-in for sglang.Engine (tests/engines/sglang_standin.py).

SGLang cannot run on CPU machines; the stand-in mirrors the API the adapter calls, so these
tests check the adapter's side: request mapping, streaming, abort by rid, capability discovery.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from rollfleet.engines import create_engine
from rollfleet.engines.sglang_engine import SglangEngine, finish_reason, load_factory
from rollfleet.errors import Unsupported
from rollfleet.transport.messages import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from sglang_standin import MinimalStandinEngine, StandinEngine  # noqa: E402

FULL = "sglang_standin:StandinEngine"
MINIMAL = "sglang_standin:MinimalStandinEngine"


def expected(prompt: list[int], n: int, offset: int = 0) -> list[int]:
    ref = StandinEngine("x")
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
    assert engine.engine.model_path == "/models/x" and engine.engine.skip_tokenizer_init
    assert engine.engine.kwargs == {"tp_size": 1}
    assert engine.engine.random_seed == 3  # the seed option, with no per-worker seed given


async def test_a_fleets_per_worker_sampling_seed_is_sglangs_random_seed():
    eng = create_engine("sglang", {"model": "/m", "engine_factory": FULL, "seed": 3, "sampling_seed": 41})
    await eng.start()
    try:
        assert eng.engine.random_seed == 41
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
    assert "abort_request" in engine.engine.calls
    assert not engine.engine.running


async def test_pause_holds_and_continue_finishes(engine):
    got, first = [], asyncio.Event()

    async def run():
        async for out in engine.generate("p", [7], SamplingParams(max_tokens=300)):
            got.extend(out.token_ids)
            first.set()
        return out.finish_reason

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 5)
    await engine.pause()
    await asyncio.sleep(0.05)  # a step already under way may still deliver its token
    held = len(got)
    await asyncio.sleep(0.1)
    assert len(got) == held < 300
    await engine.resume()
    assert await asyncio.wait_for(task, 5) == "length"
    assert got == expected([7], 300)


async def test_weights_go_through_update_weights_from_tensor(engine):
    torch = pytest.importorskip("torch")
    await engine.load_weights([("offset", torch.tensor([5]))])
    assert engine.engine.num_flushes == 1
    tokens, *_ = await collect(engine, "w", [1, 2], SamplingParams(max_tokens=8))
    assert tokens == expected([1, 2], 8, offset=5)


async def test_release_resume_memory_flush_and_profile(engine, tmp_path):
    await engine.sleep()
    assert engine.engine.memory_released
    await engine.wake_up()
    assert not engine.engine.memory_released
    await engine.clear_kv_cache()
    assert engine.engine.num_flushes == 1
    await engine.start_profile(str(tmp_path))
    assert engine.engine.profile_dir == str(tmp_path)
    await engine.stop_profile()
    assert engine.engine.profile_dir is None


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