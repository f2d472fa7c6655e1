"""The vllm engine against real vLLM on the CPU, cross-checked with transformers.

One engine for the whole module (vLLM starts in ~25 s); tests run in file order and the
last one breaks the engine on purpose, then shuts it down and checks what it left behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import stat
import tempfile
import types

import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from rollfleet.engines.vllm_engine import EngineDead, VllmEngine, write_segment  # noqa: E402
from rollfleet.transport.messages import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

PROMPT = [1, 2, 3]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def sockets_in(root: str) -> set[str]:
    found = set()
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
            except FileNotFoundError:
                pass
    return found


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("rollfleet-")}


def perturbed(state: dict, seed: int = 1) -> dict:
    """A copy with noise on every weight and a sharper lm_head, so greedy choices change
    and stay well separated."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t + 0.05 * torch.randn(t.shape, generator=gen)
        out[name] = t * 4 if name == "lm_head.weight" else t
    return out


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(n: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


async def collect(engine, rid: str, prompt: list[int], params: SamplingParams):
    tokens, logprobs, reason = [], [], None
    async for out in engine.generate(rid, prompt, params):
        tokens += out.token_ids
        logprobs += out.logprobs or []
        reason = out.finish_reason
    return tokens, logprobs, reason


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def private_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("private"))


@pytest.fixture(scope="module")
def tmp_sockets_before():
    return sockets_in(tempfile.gettempdir())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, private_dir, tmp_sockets_before):
    eng = VllmEngine({"model": model_dir, "dtype": "float32", "seed": 0, "private_dir": private_dir})
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_greedy_tokens_match_transformers(engine, hf):
    tokens, _, reason = await collect(engine, "greedy", PROMPT, greedy())
    assert tokens == hf_greedy(hf, PROMPT)
    assert reason == "length"
    assert {"logprobs", "load_weights", "pause", "clear_kv_cache"} <= engine.capabilities()


async def test_concurrent_requests_each_match_transformers(engine, hf):
    prompts = [[1, 5, 9], [1, 7], [1, 100, 200, 300], [1, 2, 3]]
    results = await asyncio.gather(*(collect(engine, f"c{i}", p, greedy(24)) for i, p in enumerate(prompts)))
    for p, (tokens, _, reason) in zip(prompts, results):
        assert tokens == hf_greedy(hf, p, 24)
        assert reason == "length"


async def test_abort_ends_one_stream_and_the_other_completes(engine):
    started = asyncio.Event()
    seen = []

    async def victim():
        reason = None
        async for out in engine.generate("victim", PROMPT, greedy(400)):
            seen.extend(out.token_ids)
            started.set()
            reason = out.finish_reason
        return reason

    task = asyncio.create_task(victim())
    other = asyncio.create_task(collect(engine, "survivor", [1, 4, 4], greedy(48)))
    await asyncio.wait_for(started.wait(), 30)
    await engine.abort("victim")
    assert await asyncio.wait_for(task, 30) == "abort"
    assert len(seen) < 400
    tokens, _, reason = await asyncio.wait_for(other, 60)
    assert len(tokens) == 48 and reason == "length"
    assert engine.stats()["num_running"] == 0


async def test_stop_token_ids_and_max_tokens(engine, hf):
    ref = hf_greedy(hf, PROMPT)
    stop = ref[5]
    first = ref.index(stop)
    tokens, _, reason = await collect(engine, "stop", PROMPT, greedy(stop_token_ids=[stop]))
    assert tokens == ref[: first + 1] and reason == "stop"
    tokens, _, reason = await collect(engine, "short", PROMPT, greedy(7))
    assert tokens == ref[:7] and reason == "length"


async def test_logprobs_are_the_chosen_tokens_logprobs(engine, hf):
    tokens, logprobs, _ = await collect(engine, "lp", PROMPT, greedy(12, logprobs=True))
    assert len(logprobs) == len(tokens) == 12
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)
    expected = [logits[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert logprobs == pytest.approx(expected, abs=1e-3)


async def test_sampled_tokens_logprobs_are_the_raw_models_as_the_torch_engines(engine, hf):
    # Both engines give the log-softmax of the model's own logits, before temperature and top-p
    # (vLLM's default logprobs_mode), so one correction serves rollouts of either.
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, logprobs=True, ignore_eos=True)
    tokens, logprobs, _ = await collect(engine, "lp-t", PROMPT, params)
    assert len(logprobs) == len(tokens) == 12
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)
    expected = [logits[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert logprobs == pytest.approx(expected, abs=1e-3)


async def test_load_weights_changes_output_and_originals_restore_it(engine, hf):
    original = hf.state_dict()
    new = perturbed(original)
    hf2 = transformers.LlamaForCausalLM.from_pretrained(engine.options["model"], dtype=torch.float32).eval()
    hf2.load_state_dict(new)
    want = hf_greedy(hf2, PROMPT)
    base = hf_greedy(hf, PROMPT)
    assert want != base
    shm = shm_names()
    await engine.load_weights(new.items())
    assert (await collect(engine, "w1", PROMPT, greedy()))[0] == want
    await engine.load_weights(original.items())
    assert (await collect(engine, "w2", PROMPT, greedy()))[0] == base
    assert shm_names() == shm  # the adapter unlinked its segments


async def test_load_from_descriptor_leaves_the_callers_segment(engine, hf):
    original = hf.state_dict()
    new = perturbed(original, seed=2)
    hf2 = transformers.LlamaForCausalLM.from_pretrained(engine.options["model"], dtype=torch.float32).eval()
    hf2.load_state_dict(new)
    want = hf_greedy(hf2, PROMPT)
    # Two buckets that split layer 0's q/k/v and gate/up between them: staged, then committed.
    names = list(new)
    first = [n for n in names if "q_proj" in n or "gate_proj" in n or "embed" in n]
    second = [n for n in names if n not in first]
    segs = []
    try:
        for part in (first, second):
            seg, entries = write_segment((n, new[n]) for n in part)
            segs.append(seg)
            # Entries as lists, the other accepted form.
            desc = {"name": seg, "tensors": [[e["name"], e["dtype"], e["shape"], e["offset"], e["nbytes"]] for e in entries]}
            assert await engine.load_weights_from_descriptor(desc, commit=False) == len(part)
        assert await engine.commit_weights() == len(names)
        assert (await collect(engine, "d1", PROMPT, greedy()))[0] == want
        for seg in segs:
            assert os.path.exists(os.path.join("/dev/shm", seg))
        # Whole layers per bucket may be applied one bucket at a time.
        seg, entries = write_segment(original.items())
        segs.append(seg)
        assert await engine.load_weights_from_descriptor({"name": seg, "tensors": entries}) == len(names)
        assert os.path.exists(os.path.join("/dev/shm", seg))
        assert (await collect(engine, "d2", PROMPT, greedy()))[0] == hf_greedy(hf, PROMPT)
    finally:
        for seg in segs:
            os.unlink(os.path.join("/dev/shm", seg))


async def test_a_prompt_seen_before_an_update_gets_the_new_weights_not_its_cached_kv(engine, hf):
    # vLLM's prefix cache kept the KV blocks of prompts run before an update (computed with the
    # old weights) and reused them for a prompt starting alike: neither model's tokens came out.
    # The prompt spans full cache blocks (128 tokens on the CPU, 16 on a GPU).
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(300)]
    original = hf.state_dict()
    new = perturbed(original, seed=4)
    hf2 = transformers.LlamaForCausalLM.from_pretrained(engine.options["model"], dtype=torch.float32).eval()
    hf2.load_state_dict(new)
    base, want = hf_greedy(hf, prompt, 16), hf_greedy(hf2, prompt, 16)
    assert base != want
    assert (await collect(engine, "pc0", prompt, greedy(16)))[0] == base
    await engine.load_weights(new.items())
    assert (await collect(engine, "pc1", prompt, greedy(16)))[0] == want
    # The fleet's way: buckets staged, then one commit.
    seg, entries = write_segment(original.items())
    try:
        await engine.load_weights_from_descriptor({"name": seg, "tensors": entries}, commit=False)
        await engine.commit_weights()
    finally:
        os.unlink(os.path.join("/dev/shm", seg))
    assert (await collect(engine, "pc2", prompt, greedy(16)))[0] == base


def zmq_bucket(tensors: dict) -> tuple[list[dict], bytes]:
    """A zmq-transport bucket: its tensor entries and its one frame."""
    entries, frame = [], bytearray()
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": len(frame), "nbytes": len(raw)})
        frame += raw + bytes(-len(raw) % 64)
    return entries, bytes(frame)


async def test_buckets_staged_by_an_abandoned_update_are_not_applied_with_the_next(engine, hf):
    # The receiver stages vLLM's buckets until the update's end; an update abandoned half-way
    # (its sender died) left them staged, and the next update's commit applied them too.
    from rollfleet.transport.messages import WeightsBegin, WeightsBucket, WeightsEnd
    from rollfleet.weights.receiver import WeightReceiver

    original = hf.state_dict()
    base = hf_greedy(hf, PROMPT)
    receiver = WeightReceiver(engine)
    new = perturbed(original, seed=5)
    entries, frame = zmq_bucket({"lm_head.weight": new["lm_head.weight"]})
    await receiver.handle(WeightsBegin(id="u1.begin", version=7, transport="zmq", bucket_bytes=len(frame),
                                       buffers=[{"size": len(frame)}]))
    await receiver.handle(WeightsBucket(id="u1.0", index=0, buffer=0, tensors=entries), [frame])
    # u1 never ends; u2 sends one unrelated tensor and commits.
    entries, frame = zmq_bucket({"model.norm.weight": original["model.norm.weight"]})
    await receiver.handle(WeightsBegin(id="u2.begin", version=8, transport="zmq", bucket_bytes=len(frame),
                                       buffers=[{"size": len(frame)}]))
    await receiver.handle(WeightsBucket(id="u2.0", index=0, buffer=0, tensors=entries), [frame])
    await receiver.handle(WeightsEnd(id="u2.end", version=8))
    assert receiver.version == 8
    assert (await collect(engine, "abandoned", PROMPT, greedy()))[0] == base
    receiver.close()


async def started_stream(engine, request_id: str, max_tokens: int):
    """A greedy generation run in a task (it returns the finish reason) and the list its tokens
    go into, once its first token has come."""
    got: list[int] = []
    first = asyncio.Event()

    async def run():
        async for out in engine.generate(request_id, PROMPT, greedy(max_tokens)):
            got.extend(out.token_ids)
            first.set()
        return out.finish_reason

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 30)
    return task, got


async def test_pause_holds_a_running_stream_and_resume_finishes_it(engine, hf):
    ref = hf_greedy(hf, PROMPT, 64)
    task, got = await started_stream(engine, "paused", 64)
    await engine.pause()
    await asyncio.sleep(0.05)  # a step already under way may still deliver its token
    assert engine.stats()["paused"]
    held = len(got)
    await asyncio.sleep(0.5)
    assert len(got) == held < 64
    await engine.resume()
    assert await asyncio.wait_for(task, 60) == "length"
    assert got == ref


async def test_an_abort_while_paused_ends_the_request_at_once(engine, hf):
    # what the echo engine mirrors (test_echo_engine.py): pause keeps requests, abort ends them
    ref = hf_greedy(hf, PROMPT, 64)
    task, got = await started_stream(engine, "paused-abort", 64)
    await engine.pause()
    try:
        await asyncio.sleep(0.05)
        await engine.abort("paused-abort")
        assert await asyncio.wait_for(task, 5) == "abort"
        assert 0 < len(got) < 64 and got == ref[:len(got)]
    finally:
        await engine.resume()

async def test_clear_kv_cache_and_unsupported_lora_and_profile(engine, hf):
    assert (await collect(engine, "pre-clear", PROMPT, greedy()))[0] == hf_greedy(hf, PROMPT)  # now cached
    await engine.clear_kv_cache()
    # It serves on after the clear, and the prompt whose cache it dropped comes out alike.
    assert (await collect(engine, "post-clear", PROMPT, greedy()))[0] == hf_greedy(hf, PROMPT)
    from rollfleet.errors import Unsupported

    with pytest.raises(Unsupported):
        await engine.load_lora("a", [], {})
    with pytest.raises(Unsupported):
        await engine.start_profile("/nonexistent")


async def test_a_fused_layer_sent_in_part_is_refused_whole_and_whole_layers_load_alone(engine, hf):
    # vLLM fuses q/k/v and gate/up: a reload of only some parts rebuilt the layer with the rest
    # uninitialised (on the CPU every token then came out 0) and said nothing.
    from rollfleet.engines.base import WeightsRefused

    original = hf.state_dict()
    base = hf_greedy(hf, PROMPT)
    new = perturbed(original, seed=3)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightsRefused, match=r"k_proj.weight.*v_proj.weight|missing"):
        await engine.load_weights([(q, new[q])])
    assert not engine.dead
    assert (await collect(engine, "part1", PROMPT, greedy()))[0] == base
    # Staged in buckets and committed: the commit refuses it, drops what was staged, loads nothing.
    up = "model.layers.1.mlp.up_proj.weight"
    seg, entries = write_segment([(up, new[up]), ("lm_head.weight", new["lm_head.weight"])])
    try:
        assert await engine.load_weights_from_descriptor({"name": seg, "tensors": entries}, commit=False) == 2
        with pytest.raises(WeightsRefused, match="gate_proj"):
            await engine.commit_weights()
    finally:
        os.unlink(os.path.join("/dev/shm", seg))
    assert await engine.commit_weights() == 0  # nothing was left staged
    assert not engine.dead
    assert (await collect(engine, "part2", PROMPT, greedy()))[0] == base
    # Whole fused layers (and unfused tensors) load alone: the rest of the model stays as it was.
    sent = {n: new[n] for n in new if ".layers.0.self_attn." in n and n.endswith(("q_proj.weight", "k_proj.weight",
                                                                                   "v_proj.weight"))}
    sent["lm_head.weight"] = new["lm_head.weight"]
    assert len(sent) == 4
    await engine.load_weights(sent.items())
    hf2 = transformers.LlamaForCausalLM.from_pretrained(engine.options["model"], dtype=torch.float32).eval()
    hf2.load_state_dict({**original, **sent})
    want = hf_greedy(hf2, PROMPT)
    assert want != base
    assert (await collect(engine, "part3", PROMPT, greedy()))[0] == want
    await engine.load_weights(original.items())
    assert (await collect(engine, "part4", PROMPT, greedy()))[0] == base


async def test_an_integer_tensor_for_a_float_model_is_refused_whole_not_cast(engine, hf):
    # vLLM's loader copied an int32 tensor into the float norm weight (a cast) and said nothing.
    from rollfleet.engines.base import WeightsRefused

    original = hf.state_dict()
    base = hf_greedy(hf, PROMPT)
    new = perturbed(original, seed=4)
    norm = "model.norm.weight"
    ints = (norm, torch.full_like(original[norm], 2, dtype=torch.int32))
    with pytest.raises(WeightsRefused, match=r"integer or bool tensors .*model.norm.weight \(torch.int32\)"):
        await engine.load_weights([("lm_head.weight", new["lm_head.weight"]), ints])
    assert not engine.dead
    assert (await collect(engine, "int1", PROMPT, greedy()))[0] == base  # the lm_head beside it was not loaded
    # Staged in buckets, then committed: refused at the commit, as a fused layer in part is.
    seg, entries = write_segment([ints])
    try:
        assert await engine.load_weights_from_descriptor({"name": seg, "tensors": entries}, commit=False) == 1
        with pytest.raises(WeightsRefused, match="integer"):
            await engine.commit_weights()
    finally:
        os.unlink(os.path.join("/dev/shm", seg))
    assert not engine.dead
    assert (await collect(engine, "int2", PROMPT, greedy()))[0] == base


async def test_failed_reload_is_fatal_and_shutdown_leaves_nothing(engine, private_dir, tmp_sockets_before):
    import psutil

    children = list(engine._children)
    assert children and all(p.is_running() for p in children)
    with pytest.raises(EngineDead):
        await engine.load_weights([("model.no_such_layer.weight", torch.zeros(4))])
    assert engine.dead
    with pytest.raises(EngineDead):
        await collect(engine, "after", PROMPT, greedy())
    shared = set(engine._shm_names)
    assert shared  # vLLM's processes talk through multiprocessing shared memory
    await engine.shutdown()
    await engine.shutdown()  # idempotent
    # Its processes were killed, not shut down: what they shared is unlinked all the same.
    assert not [n for n in shared if os.path.exists(f"/dev/shm/{n}")]
    assert not sockets_in(private_dir)
    # vLLM names its sockets by uuid4; other programs may add sockets of their own meanwhile.
    # Those in another fleet's private directory (a fleet run meanwhile) are that fleet's.
    root = tempfile.gettempdir()
    leaked = {p for p in sockets_in(root) - tmp_sockets_before if UUID.fullmatch(os.path.basename(p))
              and not os.path.relpath(p, root).startswith("rollfleet-")}
    assert not leaked
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)


async def test_a_fleets_per_worker_sampling_seed_is_vllms_seed():  # async: the module marks every test asyncio
    # vLLM draws unseeded requests from a generator seeded with its `seed`: each worker gets its own.
    args = VllmEngine({"model": "/m", "seed": 3, "sampling_seed": 41})._engine_args(cuda=False)
    assert args["seed"] == 41
    assert VllmEngine({"model": "/m", "seed": 3})._engine_args(cuda=False)["seed"] == 3


class AsyncLLMWithSleepStandIn:
    """Stand-in for vLLM's AsyncLLM on a platform with sleep mode (CUDA), which this machine
    lacks: the real signatures of sleep, wake_up and collective_rpc; it tracks which GPU memory
    is mapped, and a weight load into unmapped weights fails as it would on the GPU."""

    def __init__(self, enable_sleep_mode: bool = True) -> None:
        self.calls: list[tuple] = []
        self.mapped = {"weights", "kv_cache"}
        self.model_config = types.SimpleNamespace(enable_sleep_mode=enable_sleep_mode)  # AsyncLLM.model_config

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self.mapped = set()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        self.mapped |= set(tags or ("weights", "kv_cache"))
        return self.mapped == {"weights", "kv_cache"}

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if "weights" not in self.mapped:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.calls.append((method,))
        return [len(kwargs["descriptor"]["tensors"])] if "descriptor" in (kwargs or {}) else [0]


async def test_a_weight_update_while_asleep_maps_the_weights_back_first_and_leaves_the_cache_asleep(
        monkeypatch, tmp_path):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
    engine = VllmEngine({"model": str(tmp_path)})
    engine.llm = llm = AsyncLLMWithSleepStandIn()
    descriptor = {"name": "rf-segment", "tensors": []}
    await engine.sleep(1)
    assert await engine.load_weights_from_descriptor(descriptor) == 0
    await engine.load_weights_from_descriptor(descriptor)  # already mapped: no second wake-up
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("rollfleet_load_shm",), ("rollfleet_load_shm",)]
    assert llm.mapped == {"weights"} and not engine.dead  # the KV cache sleeps on
    await engine.wake_up()
    assert llm.calls[-1] == ("wake_up", None) and llm.mapped == {"weights", "kv_cache"}
    await engine.load_weights_from_descriptor(descriptor)  # awake: nothing to map
    assert llm.calls[-2:] == [("wake_up", None), ("rollfleet_load_shm",)]


async def test_an_engine_whose_vllm_engine_process_died_is_dead(model_dir):
    # A real engine whose EngineCore process is killed (an OOM kill, say): vLLM's AsyncLLM
    # sees it gone and says so (``errored``); the adapter is then dead, its calls fail with
    # EngineDead, and its shutdown still leaves nothing running.
    import psutil

    from ..helpers import wait_for

    short = tempfile.mkdtemp(prefix="rfv-")  # vLLM's socket paths must fit in 107 characters
    eng = VllmEngine({"model": model_dir, "dtype": "float32", "seed": 0, "private_dir": short})
    await eng.start()
    try:
        assert (await collect(eng, "before", PROMPT, greedy(4)))[2] == "length"
        assert not eng.dead
        children = list(eng._children)
        me = psutil.Process()
        (core,) = [p for p in children if p.ppid() == me.pid and "resource_tracker" not in " ".join(p.cmdline())]
        core.kill()
        assert await wait_for(lambda: eng.dead, 60), "the adapter did not see its engine process die"
        assert eng.stats()["dead"]
        with pytest.raises(EngineDead, match="engine process died"):
            await eng.clear_kv_cache()
    finally:
        await eng.shutdown()
        left = sockets_in(short)
        shutil.rmtree(short, ignore_errors=True)  # (a fleet's private directory: its supervisor removes it)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
    assert not left


async def test_tied_embeddings_update_from_named_parameters_reaches_the_lm_head(tmp_path):
    # Qwen2.5 0.5B-3B, Llama 3.2 1B/3B tie lm_head to the embeddings: their named_parameters()
    # (what a trainer sends) hold model.embed_tokens.weight and no lm_head.weight. vLLM rebuilt
    # lm_head from nothing and, on the CPU, kept computing logits with the old embeddings.
    from rollfleet.engines.tiny import TINY_LLAMA

    config = transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": True}, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    base = hf_greedy(model, PROMPT)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    sent = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    assert "model.embed_tokens.weight" in dict(sent) and "lm_head.weight" not in dict(sent)
    want = hf_greedy(model, PROMPT)
    assert want != base
    engine = VllmEngine({"model": str(tmp_path), "dtype": "float32", "seed": 0})
    await engine.start()
    try:
        assert (await collect(engine, "tied0", PROMPT, greedy()))[0] == base
        await engine.load_weights(sent)
        assert (await collect(engine, "tied1", PROMPT, greedy()))[0] == want
    finally:
        await engine.shutdown()


async def test_a_killed_process_s_own_engine_directory_is_removed_by_the_next_fleet_s_sweep(model_dir):
    # An engine given no private_dir makes its own under the temp dir; a process killed with it
    # (a bench, a notebook) left it behind for good, vLLM's sockets and shm list inside.
    import shutil
    import signal
    import subprocess
    import sys

    import psutil

    from rollfleet.actors.process import is_resource_tracker, kill_tree, sweep_private_dirs

    script = (
        "import asyncio, sys\n"
        "from rollfleet.engines.vllm_engine import VllmEngine\n"
        "async def main():\n"
        f"    engine = VllmEngine({{'model': {model_dir!r}, 'dtype': 'float32'}})\n"
        "    await engine.start()\n"
        "    print('run dir', engine._run_dir, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    root = tempfile.mkdtemp(prefix="rf-")  # short: vLLM's socket paths inside must fit in 107 bytes
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": root}, start_new_session=True)
    try:
        def run_dir() -> str:  # vLLM logs on stdout too
            for line in proc.stdout:
                if line.startswith("run dir "):
                    return line.removeprefix("run dir ").strip()
            return ""

        own = os.path.dirname(await asyncio.wait_for(asyncio.to_thread(run_dir), 180))
        assert os.path.basename(own).startswith("rollfleet-vllm-") and os.path.dirname(own) == root
        assert sweep_private_dirs(root) == [] and os.path.isdir(own)  # its owner lives: left alone
        children = psutil.Process(proc.pid).children(recursive=True)  # vLLM's, and Python's resource tracker
    finally:
        # The process and vLLM's, as a job manager kills a tree; Python's resource tracker is
        # spared, as a fleet spares it: once the others are gone it unlinks their semaphores.
        kill_tree(proc.pid, signal.SIGKILL, spare=is_resource_tracker)
        proc.wait(30)
        proc.stdout.close()
    try:
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
        assert os.path.isdir(own)
        assert sweep_private_dirs(root) == [own]
        assert not os.path.exists(own)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_sleep_mode_is_asked_of_vllm_where_it_has_one_and_without_it_sleep_is_not_offered(monkeypatch, tmp_path):
    # vLLM's enable_sleep_mode is off by default, and its sleep then frees no memory (weights and
    # KV cache are not in the pool it releases), only aborting what runs.
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
    assert VllmEngine({"model": "/m"})._engine_args(cuda=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in VllmEngine({"model": "/m", "enable_sleep_mode": False})._engine_args(cuda=True)
    assert "enable_sleep_mode" not in VllmEngine({"model": "/m"})._engine_args(cuda=False)
    from rollfleet.errors import Unsupported

    engine = VllmEngine({"model": str(tmp_path)})
    engine.llm = AsyncLLMWithSleepStandIn(enable_sleep_mode=False)
    assert "sleep" not in engine.capabilities()
    with pytest.raises(Unsupported, match="enable_sleep_mode"):
        await engine.sleep(1)
    assert engine.llm.calls == []
    engine.llm = AsyncLLMWithSleepStandIn()
    assert "sleep" in engine.capabilities()
