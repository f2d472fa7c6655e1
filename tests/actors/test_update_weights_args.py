"""Arguments of update_weights that are refused before any request is interrupted."""

import asyncio

import pytest

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.engines.tiny import tiny_llama_model
from rollfleet.transport.messages import SamplingParams


async def test_a_module_is_refused_with_what_to_pass_instead():
    model = tiny_llama_model(0)
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, frontend_addr=None,
                                      engine_options={"tokens_per_s": 200})) as fleet:
        client = fleet.client()
        running = asyncio.ensure_future(client.generate("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        # nn.Module is callable: it must not be taken for a callable that yields the tensors.
        with pytest.raises(ValueError, match=r"not a module \(LlamaForCausalLM\): pass model.named_parameters\(\)"):
            await fleet.update_weights(model, version=1)
        result = await running
        assert result.num_preemptions == 0 and result.weight_versions == [0]  # never interrupted
        assert fleet.weight_version == 0
        report = await fleet.update_weights(model.named_parameters(), version=1)
        assert report.ok and fleet.weight_version == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a process without CUDA")
@pytest.mark.parametrize("weights, call, match", [
    ({}, {"transport": "cuda_ipc"}, "transport 'cuda_ipc' needs CUDA in this process"),
    ({"transport": "cuda_ipc"}, {}, "transport 'cuda_ipc' needs CUDA in this process"),
    ({"transport": "collective", "collective_backend": "nccl"}, {}, "collective_backend 'nccl' needs CUDA"),
])
async def test_a_transport_that_needs_cuda_is_refused_without_it(weights, call, match):
    model = tiny_llama_model(0)
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, frontend_addr=None, weights=weights,
                                      engine_options={"tokens_per_s": 200})) as fleet:
        client = fleet.client()
        running = asyncio.ensure_future(client.generate("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match=match):
            await fleet.update_weights(model.named_parameters(), version=1, **call)
        result = await running
        assert result.num_preemptions == 0 and fleet.weight_version == 0  # refused before anything was stopped


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a process without CUDA")
@pytest.mark.parametrize("config, match", [
    ({"transport": "cuda_ipc"}, "transport 'cuda_ipc' needs CUDA in this process"),
    ({"transport": "collective", "collective_backend": "nccl"}, "collective_backend 'nccl' needs CUDA"),
])
async def test_a_weight_sender_used_directly_refuses_a_transport_that_needs_cuda_without_it(config, match):
    import torch

    from rollfleet.weights import WeightSender, WeightSyncConfig

    with pytest.raises(ValueError, match=match):  # before any link is looked at
        await WeightSender(WeightSyncConfig(**config)).update([("w", torch.zeros(2))], 1, [])


@pytest.mark.parametrize("weights, call, match", [
    ([("offset", "t"), ("x\udc80", "t")], {}, r"the name 'x\\udc80' is not valid UTF-8 text"),
    ([("offset", "t")], {"bucket_bytes": 1 << 63}, r"bucket_bytes must be an int >= 64 and < 2\*\*63"),
    ([("offset", "t")], {"bucket_bytes": 1 << 70}, r"bucket_bytes must be an int >= 64 and < 2\*\*63"),
])
async def test_what_the_wire_cannot_carry_is_refused_before_anything_is_interrupted(weights, call, match):
    import torch

    pairs = [(name, torch.tensor([3])) for name, _ in weights]
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, frontend_addr=None,
                                      engine_options={"tokens_per_s": 200})) as fleet:
        client = fleet.client()
        running = asyncio.ensure_future(client.generate("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match=match):
            await fleet.update_weights(pairs, version=1, **call)
        result = await running
        assert result.num_preemptions == 0 and fleet.weight_version == 0  # refused before anything was stopped
        assert (await fleet.update_weights(pairs[:1], version=1)).ok and fleet.weight_version == 1
