"""The torch engine, in-process, on the tiny random Llama; checked against transformers itself."""

from __future__ import annotations

import asyncio
import copy
import json
import random

import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollfleet.engines.tiny import build_tiny_llama, tiny_llama_model  # noqa: E402
from rollfleet.engines.torch_batch import sample  # noqa: E402
from rollfleet.engines.base import EngineDead, WeightsRefused  # noqa: E402
from rollfleet.engines.torch_engine import TorchEngine  # noqa: E402
from rollfleet.errors import DuplicateRequest, FleetClosed, InvalidRequest, Unsupported  # noqa: E402
from rollfleet.transport.messages import SamplingParams  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 40))] for _ in range(n)]


def hf_greedy(model, prompt: list[int], n: int, ignore_eos: bool = True) -> list[int]:
    """transformers' own generate(do_sample=False); without EOS stopping when ignore_eos."""
    extra = {"eos_token_id": None} if ignore_eos else {}
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
    tokens = out[0, len(prompt):].tolist()
    if ignore_eos:
        assert len(tokens) == n
    return tokens


async def collect(engine, rid, prompt, params):
    """(tokens, logprobs, finish_reason, chunks) of one whole stream."""
    tokens, logprobs, reason, chunks = [], [], None, []
    async for out in engine.generate(rid, prompt, params):
        chunks.append(out)
        tokens += out.token_ids
        logprobs += out.logprobs or []
        reason = out.finish_reason
    return tokens, logprobs, reason, chunks


async def collect_rest(stream):
    """What is left of a stream already started."""
    return [out async for out in stream]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir):
    eng = TorchEngine({"model": tiny_model_dir, "max_batch_size": 8})
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def fresh():
    """An engine of its own (the tiny model built in memory), for tests that change it."""
    eng = TorchEngine({"seed": 0})
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_greedy_matches_transformers_generate(engine, hf):
    for i, prompt in enumerate(prompts(6)):
        params = SamplingParams(max_tokens=32, temperature=0.0)  # EOS on, as generate's default
        tokens, _, reason, _ = await collect(engine, f"greedy-{i}", prompt, params)
        assert tokens == hf_greedy(hf, prompt, 32, ignore_eos=False)
        assert reason == ("stop" if tokens[-1] == 2 else "length")


async def test_batched_requests_give_the_same_tokens_as_alone(engine, hf):
    ps = prompts(12, seed=2)
    alone = [(await collect(engine, f"alone-{i}", p, GREEDY))[0] for i, p in enumerate(ps)]

    async def late(i, p):  # staggered arrivals make rows join and leave a running batch
        await asyncio.sleep(0.003 * i)
        return (await collect(engine, f"batch-{i}", p, GREEDY))[0]

    batched = await asyncio.gather(*(late(i, p) for i, p in enumerate(ps)))
    assert batched == alone
    assert alone[0] == hf_greedy(hf, ps[0], 32)


async def test_concurrent_requests_share_decode_steps(engine):
    before = engine.stats()["num_steps"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, f"share-{i}", p, params) for i, p in enumerate(prompts(4))))
    assert all(len(r[0]) == 16 for r in results)
    steps = engine.stats()["num_steps"] - before
    assert steps <= 32, f"4 requests x 16 tokens took {steps} decode steps: not batched"


async def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    prompt = prompts(1)[0]

    def params(seed):
        return SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, top_k=100, seed=seed, ignore_eos=True)

    first = (await collect(engine, "seed-a", prompt, params(7)))[0]
    again = (await collect(engine, "seed-b", prompt, params(7)))[0]
    other = (await collect(engine, "seed-c", prompt, params(8)))[0]
    assert first == again
    assert first != other
    # The same seed inside a busy batch draws the same tokens.
    crowd = [collect(engine, f"crowd-{i}", p, GREEDY) for i, p in enumerate(prompts(5, seed=3))]
    batched = await asyncio.gather(collect(engine, "seed-d", prompt, params(7)), *crowd)
    assert batched[0][0] == first


async def test_unseeded_draws_follow_the_sampling_seed_option():
    # Two engines with the same model: equal sampling_seed draws alike, another one differs.
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    prompt = prompts(1, seed=12)[0]
    draws = []
    for sampling_seed in (5, 5, 6):
        eng = TorchEngine({"seed": 0, "sampling_seed": sampling_seed})
        await eng.start()
        try:
            draws.append((await collect(eng, "unseeded", prompt, params))[0])
        finally:
            await eng.shutdown()
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


async def test_top_k_one_sampling_equals_greedy(engine):
    prompt = prompts(1, seed=4)[0]
    greedy = (await collect(engine, "tk-greedy", prompt, GREEDY))[0]
    params = SamplingParams(max_tokens=32, temperature=1.3, top_k=1, seed=3, ignore_eos=True)
    assert (await collect(engine, "tk-one", prompt, params))[0] == greedy


async def test_sampler_follows_temperature_top_k_and_top_p():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    logits = probs.log().repeat(n, 1)

    def freqs(**kw):
        params = [SamplingParams(**kw)] * n
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        return (torch.bincount(sample(logits, params, gens), minlength=5).float() / n).tolist()

    assert freqs(temperature=1.0) == pytest.approx(probs.tolist(), abs=0.015)
    assert freqs(temperature=1.0, top_k=2) == pytest.approx([5 / 7, 2 / 7, 0, 0, 0], abs=0.015)
    # top_p 0.8: 0.5 + 0.2 < 0.8, so the third token is still in, the fourth is not.
    assert freqs(temperature=1.0, top_p=0.8) == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], abs=0.015)
    sharp = (probs**2 / (probs**2).sum()).tolist()
    assert freqs(temperature=0.5) == pytest.approx(sharp, abs=0.015)


async def test_sampler_keeps_the_most_likely_token_under_any_top_p():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for top_p in (1e-300, 5e-324, 1e-8):  # float32 makes the first two 0
        params = [SamplingParams(temperature=1.0, top_p=top_p)] * 4
        assert torch.equal(sample(logits, params, gens), logits.argmax(dim=-1)), top_p
    params = [SamplingParams(temperature=1.0, top_p=1e-300, top_k=k) for k in (-1, 0, 1, 512)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(dim=-1))


@pytest.mark.parametrize("sampling", [
    {"top_p": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-40}, {"temperature": 5e-324},
    {"temperature": 9e-6, "top_k": 5}, {"temperature": 1e-30, "top_p": 1e-300, "top_k": 1},
])
async def test_edge_sampling_values_sample_the_most_likely_token(engine, sampling):
    # A top_p below float32's reach keeps the most likely token; a temperature below 1e-5 is
    # greedy (vLLM's rule), not a division that overflows to NaN.
    prompt = prompts(1, seed=5)[0]
    greedy = (await collect(engine, "edge-greedy", prompt, GREEDY))[0]
    params = SamplingParams(max_tokens=32, ignore_eos=True, seed=7, **sampling)
    assert (await collect(engine, "edge", prompt, params))[0] == greedy


async def test_extreme_but_valid_sampling_values_keep_the_engine_serving(engine):
    prompt = prompts(1, seed=6)[0]
    for i, sampling in enumerate([{"temperature": 1e18}, {"temperature": 9.2e18, "top_k": 512},
                                  {"top_k": 10**18}, {"top_k": -1, "top_p": 1.0}, {"seed": -(2**63)},
                                  {"seed": 2**63 - 1, "top_p": 0.999999999999}]):
        tokens, _, reason, _ = await collect(engine, f"extreme-{i}", prompt, SamplingParams(max_tokens=8, **sampling))
        assert len(tokens) <= 8 and reason in ("length", "stop") and all(0 <= t < 512 for t in tokens), sampling
    assert len((await collect(engine, "extreme-after", prompt, GREEDY))[0]) == 32


async def test_stop_tokens_and_max_tokens_end_the_stream(engine):
    prompt = prompts(1, seed=5)[0]
    full = (await collect(engine, "stop-full", prompt, GREEDY))[0]
    stop_at = next(i for i in range(3, 32) if full[i] not in full[:i])
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop_token_ids=[full[stop_at]])
    tokens, _, reason, _ = await collect(engine, "stop-token", prompt, params)
    assert (tokens, reason) == (full[: stop_at + 1], "stop")
    tokens, _, reason, _ = await collect(engine, "stop-len", prompt, GREEDY.replace(max_tokens=5))
    assert (tokens, reason) == (full[:5], "length")
    zero = GREEDY.replace(max_tokens=0, logprobs=True)
    tokens, logprobs, reason, _ = await collect(engine, "stop-zero", prompt, zero)
    assert (tokens, logprobs, reason) == ([], [], "length")


async def test_eos_from_the_model_config_stops_unless_ignored(tmp_path):
    path = build_tiny_llama(str(tmp_path), seed=0)
    prompt = prompts(1, seed=6)[0]
    eng = TorchEngine({"model": path})
    await eng.start()
    try:
        full = (await collect(eng, "eos-full", prompt, GREEDY))[0]
    finally:
        await eng.shutdown()
    eos_at = next(i for i in range(2, 32) if full[i] not in full[:i])
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = full[eos_at]
    (tmp_path / "config.json").write_text(json.dumps(config))
    eng = TorchEngine({"model": path})
    await eng.start()
    try:
        tokens, _, reason, _ = await collect(eng, "eos-on", prompt, GREEDY.replace(ignore_eos=False))
        assert (tokens, reason) == (full[: eos_at + 1], "stop")
        assert (await collect(eng, "eos-off", prompt, GREEDY))[0] == full
    finally:
        await eng.shutdown()


async def test_eos_listed_only_in_the_generation_config_stops_as_in_transformers_and_vllm(tmp_path):
    # Chat models list the end of a turn in generation_config.json only (Llama 3 Instruct:
    # config.json says 128001, generation_config.json [128001, 128009]); transformers' generate
    # and vLLM stop there, the torch engine went on to max_tokens.
    path = build_tiny_llama(str(tmp_path), seed=0)
    prompt = prompts(1, seed=6)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    full = hf_greedy(hf, prompt, 32)
    eos_at = next(i for i in range(2, 32) if full[i] not in full[:i] and full[i] != 2)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, full[eos_at]]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompt, 32, ignore_eos=False)
    assert want == full[: eos_at + 1]
    eng = TorchEngine({"model": path})
    await eng.start()
    try:
        tokens, _, reason, _ = await collect(eng, "gen-eos-on", prompt, GREEDY.replace(ignore_eos=False))
        assert (tokens, reason) == (want, "stop")
        assert (await collect(eng, "gen-eos-off", prompt, GREEDY))[0] == full
    finally:
        await eng.shutdown()


async def test_logprobs_are_log_softmax_of_the_model_logits(engine, hf):
    prompt = prompts(1, seed=7)[0]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, logprobs=True, ignore_eos=True)
    tokens, logprobs, _, chunks = await collect(engine, "lp", prompt, params)
    assert len(logprobs) == len(tokens) == 12
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert all(lp <= 0 for lp in logprobs)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    no_lp = await collect(engine, "no-lp", prompt, params.replace(logprobs=False))
    assert no_lp[0] == tokens and all(c.logprobs is None for c in no_lp[3])


async def test_abort_ends_one_stream_and_spares_the_other(engine, hf):
    victim_prompt, other_prompt = prompts(2, seed=8)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    other = asyncio.ensure_future(collect(engine, "spared", other_prompt, GREEDY.replace(max_tokens=48)))
    stream = engine.generate("victim", victim_prompt, long)
    first = await anext(stream)
    await engine.abort("victim")
    rest = [out async for out in stream]
    tokens = first.token_ids + [t for out in rest for t in out.token_ids]
    # The last output ends the stream with "abort"; it may carry the tokens of steps made
    # before the abort landed (outputs waiting for a slow reader are merged into one).
    assert rest[-1].finish_reason == "abort" and all(out.finish_reason is None for out in rest[:-1])
    assert len(tokens) < 400
    spared = await other
    assert spared[2] == "length" and spared[0] == hf_greedy(hf, other_prompt, 48)
    await engine.abort("victim")  # unknown now: ignored
    assert engine.stats()["num_running"] == 0


async def test_closing_the_stream_early_frees_the_request(engine):
    stream = engine.generate("walk-away", prompts(1)[0], GREEDY.replace(max_tokens=400))
    await anext(stream)
    await stream.aclose()
    for _ in range(100):
        if engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats()["num_running"] == 0


async def test_pause_holds_requests_and_resume_finishes_them(engine, hf):
    prompt = prompts(1, seed=9)[0]
    stream = engine.generate("paused", prompt, GREEDY.replace(max_tokens=200))
    tokens = (await anext(stream)).token_ids
    await engine.pause()
    try:
        steps = engine.stats()["num_steps"]
        late = asyncio.ensure_future(collect(engine, "paused-late", prompt, GREEDY))
        await asyncio.sleep(0.2)
        stats = engine.stats()
        assert stats["paused"] and stats["num_steps"] == steps
        assert not late.done()
    finally:
        await engine.resume()
    async for out in stream:
        tokens += out.token_ids
    assert tokens == hf_greedy(hf, prompt, 200)
    assert (await late)[0] == tokens[:32]


async def test_abort_while_paused_ends_the_stream_at_once(engine):
    stream = engine.generate("paused-abort", prompts(1, seed=13)[0], GREEDY.replace(max_tokens=300))
    await anext(stream)
    await engine.pause()
    try:
        await engine.abort("paused-abort")
        rest = [out async for out in stream]  # would hang if the abort waited for resume
        assert rest[-1].finish_reason == "abort"
        assert engine.stats()["num_running"] == 0
    finally:
        await engine.resume()


async def test_clear_kv_cache_and_sleep_keep_running_requests_correct(engine, hf):
    prompt = prompts(1, seed=10)[0]
    expected = hf_greedy(hf, prompt, 300)
    prefills = engine.stats()["num_prefills"]
    stream = engine.generate("cleared", prompt, GREEDY.replace(max_tokens=300))
    tokens = (await anext(stream)).token_ids
    await engine.clear_kv_cache()
    tokens += (await anext(stream)).token_ids
    await engine.sleep()
    stats = engine.stats()
    assert stats["sleeping"] and stats["num_running"] == 0 and stats["num_waiting"] == 1
    await engine.wake_up()
    assert not engine.stats()["sleeping"]
    async for out in stream:
        tokens += out.token_ids
    assert tokens == expected
    # One prefill to start, one to rebuild after the clear, one after waking.
    assert engine.stats()["num_prefills"] - prefills == 3


async def test_load_weights_gives_exactly_the_new_models_output(fresh):
    prompt = prompts(1, seed=11)[0]
    old_model, new_model = tiny_llama_model(seed=0), tiny_llama_model(seed=1)
    before = (await collect(fresh, "w-before", prompt, GREEDY))[0]
    assert before == hf_greedy(old_model, prompt, 32)
    await fresh.load_weights(iter(new_model.state_dict().items()))
    after = (await collect(fresh, "w-after", prompt, GREEDY))[0]
    assert after == hf_greedy(new_model, prompt, 32) != before
    assert fresh.stats()["num_weight_loads"] == 1


async def test_load_weights_rejects_bad_names_shapes_and_dtypes(fresh):
    with pytest.raises(ValueError, match="model.no_such.weight"):
        await fresh.load_weights([("model.no_such.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        await fresh.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="int64"):  # not a float: no cast
        await fresh.load_weights([("lm_head.weight", torch.zeros(512, 128, dtype=torch.int64))])
    # A float of another width is cast, as vLLM's loaders do (fp32 master weights, bf16 engine).
    head = torch.randn(512, 128).bfloat16()
    await fresh.load_weights([("lm_head.weight", head)])
    assert torch.equal(fresh.model.lm_head.weight, head.float())
    # The engine still serves afterwards.
    assert len((await collect(fresh, "w-ok", [1, 5], GREEDY))[0]) == 32


async def test_a_model_directory_that_does_not_exist_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    eng = TorchEngine({"model": missing})
    with pytest.raises(FileNotFoundError, match=f"model directory '{missing}' does not exist"):
        await eng.start()
    await eng.shutdown()


async def test_load_weights_copies_nothing_when_any_tensor_is_bad(fresh):
    before = {n: t.clone() for n, t in fresh.model.state_dict().items()}
    new = tiny_llama_model(seed=3).state_dict()
    loads = fresh.stats()["num_weight_loads"]
    pairs = [*new.items(), ("model.norm.weight", torch.zeros(7)), ("model.no_such.weight", torch.zeros(2))]
    with pytest.raises(WeightsRefused, match="nothing was loaded") as info:
        await fresh.load_weights(pairs)
    assert "model.no_such.weight" in str(info.value) and "model.norm.weight: got (7,)" in str(info.value)
    assert "module." not in str(info.value)
    assert all(torch.equal(t, before[n]) for n, t in fresh.model.state_dict().items())
    assert fresh.stats()["num_weight_loads"] == loads


async def test_load_weights_says_when_the_names_are_a_ddp_wrappers(fresh):
    wrapped = [(f"module.{n}", t) for n, t in tiny_llama_model(seed=3).named_parameters()]
    with pytest.raises(WeightsRefused) as info:
        await fresh.load_weights(wrapped)
    text = str(info.value)
    assert "names start with 'module.' (a DDP wrapper?): pass model.module.named_parameters()" in text
    assert text.count("module.model.") == 10 and f"and {len(wrapped) - 10} more" in text  # not hundreds of names
    # A name that would not match without the prefix either: no such hint.
    with pytest.raises(WeightsRefused) as info:
        await fresh.load_weights([wrapped[0], ("module.no_such.weight", torch.zeros(2))])
    assert "DDP" not in str(info.value)


def _wrap_layers(name: str, part: str) -> str:
    """``name`` as a wrapper of each decoder layer writes it: model.layers.0.<part>self_attn..."""
    head, sep, tail = name.partition("layers.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}layers.{index}.{part}{rest}"


@pytest.mark.parametrize("prefix, hint", [
    # torch.compile(model).named_parameters() names every parameter "_orig_mod.<name>";
    ("_orig_mod.", "names hold '_orig_mod.' (a torch.compile wrapper): pass the compiled module's own names"),
    # FSDP(model, use_orig_params=True).named_parameters() "_fsdp_wrapped_module.<name>".
    ("_fsdp_wrapped_module.", "names hold '_fsdp_wrapped_module.' (an FSDP wrapper): pass the full state dict"),
])
@pytest.mark.parametrize("where", ["root", "root and each layer", "each layer"])
async def test_load_weights_says_when_the_names_are_another_wrappers(fresh, prefix, hint, where):
    # FSDP's auto-wrap policy wraps each layer as well as the root (or the layers alone): the
    # wrapper's part then stands inside the names too, and in some names only.
    names = [n for n, _ in tiny_llama_model(seed=3).named_parameters()]
    if where != "root":
        names = [_wrap_layers(n, prefix) for n in names]
    if where != "each layer":
        names = [prefix + n for n in names]
    tensors = dict(tiny_llama_model(seed=3).named_parameters())
    wrapped = list(zip(names, tensors.values()))
    with pytest.raises(WeightsRefused) as info:
        await fresh.load_weights(wrapped)
    text = str(info.value)
    assert hint in text and "DDP" not in text
    assert "nothing was loaded" in text


async def test_load_weights_while_requests_run(fresh):
    old = copy.deepcopy(fresh.model)
    prompt = [1, 7, 9]
    stream = fresh.generate("w-live", prompt, GREEDY.replace(max_tokens=300))
    tokens = list((await anext(stream)).token_ids)
    before = len(tokens)
    await fresh.load_weights(tiny_llama_model(seed=2).state_dict().items())
    async for out in stream:
        tokens += out.token_ids
    assert len(tokens) == 300
    old_greedy = hf_greedy(old, prompt, 300)
    assert tokens[:before] == old_greedy[:before]  # made by the old weights
    assert tokens != old_greedy  # and the new ones took over mid-stream


async def test_profile_writes_a_chrome_trace(fresh, tmp_path):
    await fresh.start_profile(str(tmp_path))
    await collect(fresh, "prof", [1, 4, 8], GREEDY.replace(max_tokens=8))
    await fresh.stop_profile()
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and str(files[0]) == fresh.trace_path
    events = json.loads(files[0].read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    with pytest.raises(InvalidRequest):
        await fresh.stop_profile()


async def test_bad_requests_and_unsupported_operations(engine):
    with pytest.raises(InvalidRequest):
        await collect(engine, "bad-vocab", [1, 512], GREEDY)
    with pytest.raises(InvalidRequest):
        await collect(engine, "bad-empty", [], GREEDY)
    with pytest.raises(InvalidRequest):
        await collect(engine, "bad-long", [1] * 512, GREEDY)
    stream = engine.generate("dup", [1, 2], GREEDY.replace(max_tokens=100))
    await anext(stream)
    with pytest.raises(DuplicateRequest):
        await collect(engine, "dup", [1, 2], GREEDY)
    await stream.aclose()
    with pytest.raises(Unsupported):
        await engine.load_lora("adapter", [], {})
    assert engine.capabilities() == {"pause", "sleep", "load_weights", "clear_kv_cache", "profile", "logprobs"}
    assert engine.stats()["device"] == "cpu"


async def test_generation_stops_at_the_models_max_length(engine):
    tokens, _, reason, _ = await collect(engine, "max-len", [1] * 500, GREEDY.replace(max_tokens=100))
    assert (len(tokens), reason) == (12, "length")


async def test_shutdown_ends_open_streams_and_is_idempotent():
    eng = TorchEngine({})
    await eng.start()
    stream = eng.generate("open", [1, 3], GREEDY.replace(max_tokens=400))
    await anext(stream)
    await eng.shutdown()
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    await eng.shutdown()
    with pytest.raises(FleetClosed):
        await collect(eng, "after", [1, 3], GREEDY)
    with pytest.raises(FleetClosed):
        await eng.pause()


class InjectedFault(BaseException):
    """Raised by the model or by a caller's weights: not an Exception, so the engine thread,
    which turns an Exception into that request's or that call's error, dies of it."""


async def test_a_dead_engine_thread_ends_every_open_stream_with_engine_dead():
    eng = TorchEngine({})
    await eng.start()
    try:
        running = eng.generate("running", [1, 3], GREEDY.replace(max_tokens=400))
        await anext(running)

        def fault(module, args, kwargs):  # the model itself fails, on the killer's prefill
            ids = kwargs.get("input_ids")
            if ids is not None and ids.tolist() == [[1, 4]]:
                raise InjectedFault("injected fault")

        eng.model.register_forward_pre_hook(fault, with_kwargs=True)
        # The thread dies in the killer's prefill: the killer is then neither waiting nor in the
        # batch, and must be told all the same.
        with pytest.raises(EngineDead, match="injected fault"):
            await asyncio.wait_for(collect(eng, "killer", [1, 4], GREEDY), 10)
        with pytest.raises(EngineDead, match="torch engine thread died"):
            await asyncio.wait_for(collect_rest(running), 10)
        assert eng.dead
        await eng.abort("running")  # nothing left to stop: no error
        with pytest.raises(EngineDead):
            await collect(eng, "after", [1, 3], GREEDY)
        with pytest.raises(EngineDead):
            await eng.pause()
        with pytest.raises(EngineDead):
            await eng.load_weights([])
    finally:
        await eng.shutdown()


async def test_a_weight_load_the_engine_thread_dies_in_fails_with_engine_dead():
    def weights():  # consumed on the engine thread, inside load_weights
        raise InjectedFault("injected fault")
        yield  # a generator

    eng = TorchEngine({})
    await eng.start()
    try:
        with pytest.raises(EngineDead, match="injected fault"):
            await asyncio.wait_for(eng.load_weights(weights()), 10)
        assert eng.dead
        with pytest.raises(EngineDead):
            await eng.pause()
    finally:
        await eng.shutdown()


@pytest.mark.gpu
async def test_cuda_greedy_matches_transformers_and_sleep_frees_the_gpu(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    eng = TorchEngine({"model": tiny_model_dir, "device": "cuda"})
    await eng.start()
    try:
        ps = prompts(4, seed=12)
        results = await asyncio.gather(*(collect(eng, f"cuda-{i}", p, GREEDY) for i, p in enumerate(ps)))
        assert [r[0] for r in results] == [hf_greedy(model, p, 32) for p in ps]
        sampled = await collect(eng, "cuda-s", ps[0], GREEDY.replace(temperature=1.0, seed=5, logprobs=True))
        assert len(sampled[0]) == 32 and all(lp <= 0 for lp in sampled[1])
        stream = eng.generate("cuda-sleep", ps[1], GREEDY.replace(max_tokens=300))
        tokens = (await anext(stream)).token_ids
        await eng.sleep()
        assert eng.model.lm_head.weight.device.type == "cpu"
        await eng.wake_up()
        assert eng.model.lm_head.weight.device.type == "cuda"
        async for out in stream:
            tokens += out.token_ids
        assert tokens == hf_greedy(model, ps[1], 300)
    finally:
        await eng.shutdown()
