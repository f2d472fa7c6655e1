"""The real engines through the whole fleet: torch and vLLM, cross-checked with transformers.

One torch fleet (2 workers) and one vLLM fleet (1 worker: vLLM starts in ~30 s on 2 cores)
serve the whole module; tests run in file order and share them. The destructive tests
(a failed weight update, SIGKILL of a worker, a failed vLLM reload) come last.

The weights used from the weight-update test on are a perturbed copy with a sharper lm_head
(see ``perturbed``): greedy choices then stay well apart, so a resumed request, whose cache
is rebuilt by a prefill over prompt + partial output instead of step by step, cannot flip
a near tie.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import time

import psutil
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollfleet.actors import FleetConfig, Supervisor  # noqa: E402
from rollfleet.engines.tiny import build_tiny_llama, tiny_llama_model  # noqa: E402
from rollfleet.errors import InvalidRequest, Unsupported, WeightUpdateError  # noqa: E402
from rollfleet.transport.messages import SamplingParams  # noqa: E402

from ..helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

# Several prompts, two of them longer than a KV-cache block (16 tokens), so a cache that
# outlived a weight update would show.
PROMPTS = [
    [1, 2, 3],
    [1, 5, 9],
    [1, 7],
    [1, 100, 200, 300],
    [1] + list(range(40, 80)),
    [1] + [(17 * i) % 509 + 3 for i in range(30)],
]
LONG = 300  # tokens of the requests that get interrupted; prompt + LONG < max_model_len (512)
V1 = 1  # version of the perturbed weights; the resume tests reload them as V1 + 1, ...


def greedy(n: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    """transformers' own generate(do_sample=False), never stopping at EOS."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == n
    return tokens


def perturbed(state: dict, seed: int = 1) -> dict:
    """A copy with noise on every weight and a 4x lm_head, so greedy choices change and
    stay well separated."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t + 0.05 * torch.randn(t.shape, generator=gen)
        out[name] = (t * 4 if name == "lm_head.weight" else t).contiguous()
    return out


async def wait_tokens(sup: Supervisor, request_id: str, n: int, timeout: float = 60.0) -> None:
    """Until the fleet holds at least ``n`` tokens of the request (it is still running)."""
    await asyncio.sleep(0)  # let a just-created generate task submit its request

    def enough() -> bool:
        entry = sup.table.get("local", request_id)
        assert entry is not None, f"{request_id} finished before {n} tokens"
        return len(entry.token_ids) >= n

    assert await wait_for(enough, timeout, 0.002), f"{request_id} did not reach {n} tokens in {timeout}s"


async def all_greedy(sup: Supervisor, tag: str, prompts: list[list[int]], n: int = 32):
    client = sup.client()
    return await asyncio.gather(*(client.generate(f"{tag}{i}", p, greedy(n)) for i, p in enumerate(prompts)))


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def gone(procs: list[psutil.Process]) -> bool:
    out = True
    for p in procs:
        try:
            out &= not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    return out


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def no_leaks_module():
    """Fleets are torn down before this: it asserts they left no child process behind, and
    none of the shared memory their engines' processes made (vLLM's queues and semaphores,
    also after a worker was SIGKILLed)."""
    from rollfleet.actors.process import shm_names_now

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    shm_before = shm_names_now()
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    time.sleep(0.5)
    assert gone(left), f"processes left behind: {[p.pid for p in left if p.is_running()]}"
    assert shm_names_now() - shm_before == set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_state(hf) -> dict:
    return perturbed(hf.state_dict())


@pytest.fixture(scope="module")
def hf_new(model_dir, new_state):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(new_state)
    return model


@pytest.fixture(scope="module")
def long_ref(hf_new) -> list[int]:
    """What the new weights give for PROMPTS[0] over LONG tokens, uninterrupted."""
    return hf_greedy(hf_new, PROMPTS[0], LONG)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def torch_fleet(model_dir, no_leaks_module):
    # report_interval_s: the tests that interrupt a request wait until the fleet holds some of its
    # tokens; reports every 50 ms let them see those before a short request ends
    cfg = FleetConfig(engine="torch", num_workers=2, engine_options={"model": model_dir},
                      deterministic_routing=True, report_interval_s=0.05)
    async with Supervisor(cfg) as sup:
        yield sup


@pytest.fixture(scope="module")
def vllm_profile_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vllm-profile"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_fleet(model_dir, vllm_profile_dir, no_leaks_module):
    pytest.importorskip("vllm")
    cfg = FleetConfig(engine="vllm", num_workers=1, start_timeout_s=240, report_interval_s=0.05,  # as torch_fleet
                      engine_options={"model": model_dir, "max_model_len": 512, "dtype": "float32", "seed": 0,
                                      "profile_dir": vllm_profile_dir})
    async with Supervisor(cfg) as sup:
        yield sup


# ---------------------------------------------------------------------------- cross-checks


async def test_torch_fleet_greedy_matches_transformers(torch_fleet, hf):
    results = await all_greedy(torch_fleet, "t", PROMPTS)
    assert {r.worker for r in results} == {"w0-0", "w1-0"}  # both workers served
    for prompt, r in zip(PROMPTS, results):
        assert r.token_ids == hf_greedy(hf, prompt)
        assert r.finish_reason == "length" and r.weight_versions == [0]


async def test_torch_fleet_unseeded_samples_differ_between_workers(torch_fleet):
    # Each worker draws unseeded requests from a source of its own: with one source for all,
    # a group of samples of one prompt spread over the workers repeated itself worker by worker.
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    client = torch_fleet.client()
    results = await asyncio.gather(*(client.generate(f"draw{i}", PROMPTS[0], params) for i in range(4)))
    assert {r.worker for r in results} == {"w0-0", "w1-0"}
    assert len({tuple(r.token_ids) for r in results}) == 4


@pytest.mark.vllm
async def test_vllm_fleet_greedy_equals_torch_fleet_and_transformers(vllm_fleet, torch_fleet, hf):
    from_vllm = await all_greedy(vllm_fleet, "v", PROMPTS)
    from_torch = await all_greedy(torch_fleet, "t", PROMPTS)
    for prompt, v, t in zip(PROMPTS, from_vllm, from_torch):
        assert v.token_ids == t.token_ids == hf_greedy(hf, prompt)
        assert v.finish_reason == "length" and v.weight_versions == [0]


async def refuses_bad_prompts_and_serves_on(sup: Supervisor, hf, max_len: int, tag: str) -> None:
    """A prompt the model cannot take is the client's error (InvalidRequest, code bad_field,
    the reason in the message), not the engine's, and the next request is served."""
    vocab = hf.config.vocab_size
    client = sup.client()
    for i, (prompt, why) in enumerate((([], "empty"), ([1, vocab], f"[0, {vocab})"), ([1, -5], f"[0, {vocab})"),
                                       ([1] * max_len, "takes fewer than"))):
        with pytest.raises(InvalidRequest, match=re.escape(why)) as info:
            await client.generate(f"{tag}-bad{i}", prompt, greedy(4))
        assert info.value.code == "bad_field"
    r = await client.generate(f"{tag}-good", PROMPTS[0], greedy())
    assert r.token_ids == hf_greedy(hf, PROMPTS[0])
    assert all(w["restarts"] == 0 for w in (await sup.stats())["workers"])


async def test_fleets_given_different_sampling_seeds_draw_apart_and_equal_ones_alike():
    # seed picks the tiny model (the same weights on every rank); sampling_seed, e.g. one per
    # rank, is the base of each worker's own draws: it is not overwritten by the fleet.
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    draws = []
    for base in (7, 7, 8):
        cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"seed": 0, "sampling_seed": base},
                          frontend_addr=None)
        async with Supervisor(cfg) as sup:
            draws.append((await sup.client().generate("d", PROMPTS[0], params)).token_ids)
    assert draws[0] == draws[1] != draws[2]


async def test_an_update_in_another_float_width_is_cast_like_vllms_loaders_do():
    # bf16 tensors into the fp32 torch engine, over shm (read in place, then cast).
    new = tiny_llama_model(seed=1)
    cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"seed": 0}, frontend_addr=None)
    async with Supervisor(cfg) as sup:
        report = await sup.client().update_weights(((n, p.detach().bfloat16()) for n, p in new.named_parameters()),
                                                   version=1)
        assert report.version == 1
        r = await sup.client().generate("cast", PROMPTS[0], greedy())
    for p in new.parameters():
        p.data = p.data.bfloat16().float()
    assert r.token_ids == hf_greedy(new, PROMPTS[0]) and r.weight_versions == [1]


async def test_a_restarted_worker_gets_every_update_so_far_not_only_the_last(model_dir, hf, new_state,
                                                                           no_leaks_module):
    # Version 1 replaces every tensor, version 2 only those of one layer (a partial update),
    # version 3 none (an empty update stamps the version). After each, a worker killed and
    # restarted must serve what the fleet served: its initial weights plus every tensor sent
    # since, each as last sent, not its initial weights plus the last update's tensors.
    layer = {n: t for n, t in tiny_llama_model(seed=2).state_dict().items() if ".layers.1." in n}
    assert layer and len(layer) < len(new_state)
    current = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    current.load_state_dict({**new_state, **layer})
    base_and_layer = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_and_layer.load_state_dict(layer, strict=False)
    want = hf_greedy(current, PROMPTS[3])
    assert want != hf_greedy(base_and_layer, PROMPTS[3]) and want != hf_greedy(hf, PROMPTS[3])
    cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"model": model_dir}, frontend_addr=None)
    async with Supervisor(cfg) as sup:
        client = sup.client()
        await client.update_weights(list(new_state.items()), version=1)
        for version, tensors in ((2, layer), (3, {})):
            await client.update_weights(list(tensors.items()), version=version)
            r = await client.generate(f"before-{version}", PROMPTS[3], greedy())
            assert r.token_ids == want and r.weight_versions == [version]
            victim = sup.slots[0]
            os.kill(victim.pid, signal.SIGKILL)
            assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 60)
            r = await client.generate(f"after-{version}", PROMPTS[3], greedy())
            assert r.token_ids == want and r.weight_versions == [version]


async def test_torch_fleet_refuses_prompts_the_model_cannot_take(torch_fleet, hf):
    await refuses_bad_prompts_and_serves_on(torch_fleet, hf, hf.config.max_position_embeddings, "t")


@pytest.mark.vllm
async def test_vllm_fleet_refuses_prompts_the_model_cannot_take(vllm_fleet, hf):
    await refuses_bad_prompts_and_serves_on(vllm_fleet, hf, 512, "v")  # the fleet's max_model_len


@pytest.mark.vllm
async def test_vllm_fleet_refuses_sampling_vllm_refuses_as_bad_field_and_serves_on(vllm_fleet, hf):
    # vLLM checks its own ranges when the request's sampling is built (a temperature above 2):
    # that error left the adapter raw, so the client got engine_error, and the request stayed
    # counted as running in the engine's stats.
    client = vllm_fleet.client()
    with pytest.raises(InvalidRequest, match="temperature") as info:
        await client.generate("v-bad-sampling", PROMPTS[0], SamplingParams(max_tokens=4, temperature=3.0))
    assert info.value.code == "bad_field"
    r = await client.generate("v-good-sampling", PROMPTS[0], greedy())
    assert r.token_ids == hf_greedy(hf, PROMPTS[0])
    [worker] = (await vllm_fleet.stats())["workers"]
    assert worker["engine_stats"]["num_running"] == 0 and worker["restarts"] == 0


async def update_and_check(sup: Supervisor, new_state: dict, want: list[list[int]], tag: str) -> list:
    report = await sup.client().update_weights(list(new_state.items()), version=V1)
    assert report.ok and report.version == V1 and set(report.workers) == set(sup.workers)
    assert report.num_tensors == len(new_state)
    results = await all_greedy(sup, tag, PROMPTS)
    for w, r in zip(want, results):
        assert r.token_ids == w and r.weight_versions == [V1]
    stats = await sup.stats()
    assert stats["weight_version"] == V1
    assert [w["weight_version"] for w in stats["workers"]] == [V1] * len(stats["workers"])
    assert all(w["engine_stats"] for w in stats["workers"])
    return results


async def test_torch_fleet_gives_the_new_weights_tokens_after_an_update(torch_fleet, hf, hf_new, new_state):
    want = [hf_greedy(hf_new, p) for p in PROMPTS]
    assert want != [hf_greedy(hf, p) for p in PROMPTS]  # the update changes the output
    await update_and_check(torch_fleet, new_state, want, "t-new")


@pytest.mark.vllm
async def test_vllm_fleet_loads_the_same_new_weights_and_agrees_with_torch(vllm_fleet, torch_fleet, hf_new, new_state):
    want = [hf_greedy(hf_new, p) for p in PROMPTS]
    from_vllm = await update_and_check(vllm_fleet, new_state, want, "v-new")
    if torch_fleet.weight_version != V1:  # the torch test before was deselected
        await torch_fleet.client().update_weights(list(new_state.items()), version=V1)
    from_torch = await all_greedy(torch_fleet, "t-new2", PROMPTS)
    assert [r.token_ids for r in from_vllm] == [r.token_ids for r in from_torch]


@pytest.mark.vllm
async def test_vllm_fleet_takes_updates_whose_small_buckets_split_fused_layers_over_zmq(vllm_fleet, hf, hf_new,
                                                                                        new_state):
    # Over zmq (and a collective, standalone mode's transport) each bucket reached vLLM as a
    # reload of its own: a bucket holding q_proj without k_proj and v_proj left that layer
    # part-uninitialised (or, refused, failed the update). Staged like shm's buckets, they are
    # applied together at the end.
    client = vllm_fleet.client()
    original = {n: t.contiguous() for n, t in hf.state_dict().items()}
    small = original["model.layers.0.self_attn.q_proj.weight"].nbytes + 64  # about one projection a bucket
    report = await client.update_weights(list(original.items()), version=V1 + 100, transport="zmq",
                                         bucket_bytes=small)
    assert report.ok and report.num_buckets > 10
    results = await all_greedy(vllm_fleet, "v-zmq-old", PROMPTS)
    assert [r.token_ids for r in results] == [hf_greedy(hf, p) for p in PROMPTS]
    report = await client.update_weights(list(new_state.items()), version=V1, transport="zmq", bucket_bytes=small)
    assert report.ok
    results = await all_greedy(vllm_fleet, "v-zmq-new", PROMPTS)
    assert [r.token_ids for r in results] == [hf_greedy(hf_new, p) for p in PROMPTS]
    assert all(r.weight_versions == [V1] for r in results)


# ---------------------------------------------------------------------------- control ops


async def test_torch_controls_profile_sleep_clear_cache_and_stats(torch_fleet, hf_new, long_ref, tmp_path):
    client = torch_fleet.client()
    trace_dir = str(tmp_path / "torch-traces")
    replies = await client.start_profile(trace_dir)
    assert set(replies) == {"w0-0", "w1-0"}
    await all_greedy(torch_fleet, "p", PROMPTS[:2], 8)
    await client.stop_profile()
    traces = sorted(os.listdir(trace_dir))
    assert len(traces) == 2 and all(t.startswith("torch-engine-") and t.endswith(".json") for t in traces)
    for name in traces:
        with open(os.path.join(trace_dir, name)) as f:
            events = json.load(f)["traceEvents"]
        assert any("aten::" in str(e.get("name", "")) for e in events)  # the model's ops were recorded

    # Asleep, a worker holds its requests; after wake_up they finish with the right tokens.
    await client.sleep()
    stats = await torch_fleet.stats()
    assert all(w["engine_stats"]["sleeping"] for w in stats["workers"])
    task = asyncio.create_task(client.generate("asleep", PROMPTS[0], greedy()))
    await asyncio.sleep(0.3)
    assert not task.done()
    entry = torch_fleet.table.get("local", "asleep")
    assert entry is not None and entry.token_ids == []
    await client.wake_up()
    r = await asyncio.wait_for(task, 60)
    assert r.token_ids == long_ref[:32]

    # Dropping the KV cache mid-request: the request rebuilds it and carries on exactly.
    task = asyncio.create_task(client.generate("cleared", PROMPTS[0], greedy(LONG)))
    await wait_tokens(torch_fleet, "cleared", 20)
    await client.clear_kv_cache()
    r = await asyncio.wait_for(task, 120)
    assert r.token_ids == long_ref and r.num_preemptions == 0

    stats = await client.stats()
    engine = stats["workers"][0]["engine_stats"]
    assert engine["num_tokens"] > 0 and engine["num_weight_loads"] >= 1 and engine["sleeping"] is False
    assert stats["num_inflight"] == 0 and stats["num_completed"] > 0


@pytest.mark.vllm
async def test_vllm_controls_profile_clear_cache_stats_and_unsupported_sleep(vllm_fleet, hf_new, tmp_path):
    client = vllm_fleet.client()
    trace_dir = str(tmp_path / "vllm-traces")
    await client.start_profile(trace_dir)
    await all_greedy(vllm_fleet, "p", PROMPTS[:2], 8)
    await client.stop_profile()
    traces = [t for t in os.listdir(trace_dir) if t.endswith(".pt.trace.json.gz")]
    assert traces, os.listdir(trace_dir)
    with gzip.open(os.path.join(trace_dir, traces[0])) as f:
        assert json.load(f)["traceEvents"]

    await client.clear_kv_cache()
    r = await client.generate("after-clear", PROMPTS[4], greedy())
    assert r.token_ids == hf_greedy(hf_new, PROMPTS[4])

    # vLLM has no sleep mode on the CPU: it would free nothing, so the fleet says so.
    for op in (client.sleep, client.wake_up):
        with pytest.raises(Unsupported, match="(?i)sleep.*vllm|vllm.*sleep"):
            await op()
    r = await client.generate("after-sleep", PROMPTS[0], greedy())  # refusing changed nothing
    assert r.token_ids == hf_greedy(hf_new, PROMPTS[0])

    stats = await client.stats()
    assert stats["sleep_level"] == 0  # the refused sleep is not reported as in force
    (worker,) = stats["workers"]
    assert worker["engine"] == "vllm" and "sleep" not in worker["capabilities"]
    assert {"profile", "clear_kv_cache", "load_weights"} <= set(worker["capabilities"])
    engine = worker["engine_stats"]
    assert engine["num_tokens"] > 0 and engine["num_requests"] > 0 and engine["dead"] is False


# ---------------------------------------------------------------------------- resume


async def interrupted_by_updates(sup: Supervisor, new_state: dict, request_id: str, times: int) -> tuple:
    """Run one LONG request and reload the same weights ``times`` times while it runs."""
    client = sup.client()
    first = sup.weight_version
    async def run():
        # Streamed, so the fleet sees every step's tokens at once (non-streamed requests report
        # their partial output in batches) and each update lands after real progress.
        async for item in client.stream(request_id, PROMPTS[0], greedy(LONG)):
            if hasattr(item, "finish_reason"):
                return item

    task = asyncio.create_task(run())
    seen = 0
    for k in range(times):
        # 20 tokens more than when the last update returned: made under that update's version
        # (counting from before the update instead, a busy machine could let the next update
        # land before the resumed request made a token, and that segment would have no entry).
        await wait_tokens(sup, request_id, seen + 20)
        await client.update_weights(list(new_state.items()), version=first + k + 1)
        entry = sup.table.get("local", request_id)
        assert entry is not None, f"{request_id} finished during update {k + 1}"
        seen = len(entry.token_ids)
    return await asyncio.wait_for(task, 120), first


async def test_torch_request_interrupted_by_same_weight_updates_returns_uninterrupted_tokens(
        torch_fleet, new_state, long_ref):
    r, first = await interrupted_by_updates(torch_fleet, new_state, "resumed-t", 3)
    assert r.token_ids == long_ref and r.finish_reason == "length"
    assert r.num_preemptions == 3 and r.weight_versions == [first, first + 1, first + 2, first + 3]


@pytest.mark.vllm
async def test_vllm_request_interrupted_by_same_weight_updates_returns_uninterrupted_tokens(
        vllm_fleet, new_state, long_ref):
    r, first = await interrupted_by_updates(vllm_fleet, new_state, "resumed-v", 3)
    assert r.token_ids == long_ref and r.finish_reason == "length"
    assert r.num_preemptions == 3 and r.weight_versions == [first, first + 1, first + 2, first + 3]


# ---------------------------------------------------------------------------- failures (last)


async def test_torch_failed_update_names_worker_and_cause_and_generation_resumes(torch_fleet, long_ref):
    client = torch_fleet.client()
    good = torch_fleet.weight_version
    task = asyncio.create_task(client.generate("through-failure", PROMPTS[0], greedy(LONG)))
    await wait_tokens(torch_fleet, "through-failure", 20)
    with pytest.raises(WeightUpdateError) as info:
        await client.update_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))], version=good + 1)
    message = str(info.value)
    assert info.value.worker_id in ("w0-0", "w1-0") and info.value.worker_id in message
    assert "down_proj" in message and "(3, 3)" in message  # the cause, not just "failed"
    r = await asyncio.wait_for(task, 120)
    assert r.token_ids == long_ref and r.num_preemptions == 1 and r.weight_versions == [good, good]
    stats = await client.stats()
    assert stats["weight_version"] == good
    assert [(w["worker_id"], w["weight_version"], w["state"]) for w in stats["workers"]] == [
        ("w0-0", good, "ready"), ("w1-0", good, "ready")]


async def test_torch_failed_first_update_leaves_no_mix_the_worker_reloads_its_weights(model_dir, hf, new_state,
                                                                                      no_leaks_module):
    # A fleet of its own: its first update, with nothing kept to restore. The perturbed
    # tensors go first, a bucket each, then a name the model lacks fails the update.
    ref = hf_greedy(hf, PROMPTS[3])
    cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"model": model_dir})
    async with Supervisor(cfg) as sup:
        client = sup.client()
        bad = list(new_state.items()) + [("model.no_such_weight", torch.zeros(2))]
        with pytest.raises(WeightUpdateError, match="no_such_weight") as info:
            await client.update_weights(bad, version=1, bucket_bytes=64 << 10)
        assert str(info.value).count("w0-0") == 1  # the worker is named once, not by each layer
        r = await asyncio.wait_for(client.generate("after", PROMPTS[3], greedy()), 120)
        assert r.token_ids == ref and r.weight_versions == [0]
        [worker] = (await client.stats())["workers"]
        assert (worker["weight_version"], worker["restarts"], worker["state"]) == (0, 1, "ready")


async def test_torch_first_update_with_ddp_names_is_refused_whole_and_restarts_no_worker(no_leaks_module):
    # A fleet of its own, at its first update. DDP's wrapper names every parameter "module.<name>":
    # the workers refuse each bucket before copying anything, so none holds a mix, none is
    # restarted, and the error says what to pass instead.
    new = tiny_llama_model(seed=1)
    cfg = FleetConfig(engine="torch", num_workers=2, engine_options={"seed": 0}, frontend_addr=None)
    async with Supervisor(cfg) as sup:
        client = sup.client()
        before = await client.generate("before", PROMPTS[3], greedy())
        wrapped = [(f"module.{n}", p) for n, p in new.named_parameters()]
        with pytest.raises(WeightUpdateError, match=r"names start with 'module.' \(a DDP wrapper\?\): "
                                                    r"pass model.module.named_parameters\(\)"):
            await client.update_weights(wrapped, version=1, bucket_bytes=256 << 10)
        stats = await client.stats()
        assert [(w["weight_version"], w["restarts"], w["state"]) for w in stats["workers"]] == [(0, 0, "ready")] * 2
        assert stats["weight_version"] == 0
        r = await client.generate("after-refusal", PROMPTS[3], greedy())
        assert r.token_ids == before.token_ids and r.weight_versions == [0]
        await client.update_weights(new.named_parameters(), version=1)
        results = await all_greedy(sup, "after-update", PROMPTS[3:5])
        for prompt, r in zip(PROMPTS[3:5], results):
            assert r.token_ids == hf_greedy(new, prompt) and r.weight_versions == [1]
        stats = await client.stats()
        assert [(w["weight_version"], w["restarts"]) for w in stats["workers"]] == [(1, 0)] * 2


async def test_torch_worker_sigkill_resumes_its_requests_and_restart_catches_up(torch_fleet, hf_new, long_ref):
    sup = torch_fleet
    client = sup.client()
    version = sup.weight_version
    tasks = [asyncio.create_task(client.generate(f"k{i}", PROMPTS[0], greedy(LONG))) for i in range(2)]
    for i in range(2):
        await wait_tokens(sup, f"k{i}", 20)
    victim = sup.slots[0]
    moved = {e.request_id for e in sup.table.on_worker(victim.worker_id)}
    assert moved  # deterministic routing put one request on each worker
    os.kill(victim.pid, signal.SIGKILL)
    for i, task in enumerate(tasks):
        r = await asyncio.wait_for(task, 120)
        assert r.token_ids == long_ref
        assert r.num_preemptions == (1 if f"k{i}" in moved else 0)
        assert r.worker == "w1-0"
    assert await wait_for(lambda: sup.slots[0] is not victim and sup.slots[0].state.value == "ready", 60)
    assert sup.slots[0].weight_version == version
    results = await all_greedy(sup, "after-kill", PROMPTS[:2])
    assert {r.worker for r in results} == {sup.slots[0].worker_id, "w1-0"}
    for prompt, r in zip(PROMPTS, results):
        assert r.token_ids == hf_greedy(hf_new, prompt) and r.weight_versions == [version]


@pytest.mark.vllm
async def test_vllm_worker_sigkill_mid_request_resumes_on_the_restarted_worker(vllm_fleet, long_ref):
    sup = vllm_fleet
    version = sup.weight_version
    task = asyncio.create_task(sup.client().generate("killed", PROMPTS[0], greedy(LONG)))
    await wait_tokens(sup, "killed", 20)
    victim = sup.slots[0]
    engine_procs = descendants(victim.pid)  # vLLM's EngineCore and its model worker
    assert engine_procs
    os.kill(victim.pid, signal.SIGKILL)
    r = await asyncio.wait_for(task, 240)  # waits for a new vLLM to start and catch up
    assert r.token_ids == long_ref and r.finish_reason == "length"
    assert r.num_preemptions == 1 and r.weight_versions == [version, version]
    assert r.worker == sup.slots[0].worker_id != victim.worker_id and sup.slots[0].weight_version == version
    assert await wait_for(lambda: gone(engine_procs), 10)  # the killed worker's engine went with it


@pytest.mark.vllm
async def test_vllm_failed_reload_is_fatal_restarts_the_worker_at_the_last_good_version(vllm_fleet, hf_new, long_ref):
    sup = vllm_fleet
    client = sup.client()
    good = sup.weight_version
    victim = sup.slots[0]
    assert victim.state.value == "ready"
    restarts = (await client.stats())["workers"][0]["restarts"]
    task = asyncio.create_task(client.generate("through-reload", PROMPTS[0], greedy(LONG)))
    await wait_tokens(sup, "through-reload", 20)
    # A valid name with the wrong shape: vLLM's reload fails half-way and the model is lost.
    with pytest.raises(WeightUpdateError) as info:
        await client.update_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))], version=good + 1)
    assert info.value.worker_id == victim.worker_id and victim.worker_id in str(info.value)
    assert "dead" in str(info.value)  # the cause: the engine did not survive the reload
    # The worker says why and exits; the supervisor restarts it and brings it to `good`.
    assert await wait_for(lambda: not victim.alive, 30)
    assert "engine died loading weights" in victim.last_error
    r = await asyncio.wait_for(task, 240)  # the interrupted request resumes on the new worker
    assert r.token_ids == long_ref and r.weight_versions == [good, good]
    assert sup.slots[0].worker_id != victim.worker_id and sup.slots[0].weight_version == good
    r = await client.generate("after-reload", PROMPTS[4], greedy())
    assert r.token_ids == hf_greedy(hf_new, PROMPTS[4]) and r.weight_versions == [good]
    stats = await client.stats()
    (worker,) = stats["workers"]
    assert stats["weight_version"] == good and worker["weight_version"] == good
    assert worker["state"] == "ready" and worker["restarts"] == restarts + 1
    assert "engine died loading weights" in worker["last_error"]
