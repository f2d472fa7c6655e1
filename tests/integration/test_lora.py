"""LoRA adapters through the weight buckets: vLLM loads and uses them; torch says unsupported."""

from __future__ import annotations

import pytest
import torch

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.engines.tiny import build_tiny_llama, tiny_llama_model
from rollfleet.errors import Unsupported
from rollfleet.transport.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("no_leaks")

RANK, ALPHA = 8, 16
PROMPTS = [[1, 17, 42, 99], [1, 250, 3, 7, 300]]


def make_adapter(seed=3):
    """PEFT-named LoRA tensors for q_proj and v_proj of every layer of the tiny Llama."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for layer in range(2):
        for proj, out_dim in (("q_proj", 128), ("v_proj", 64)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors.append((f"{prefix}.lora_A.weight", torch.randn(RANK, 128, generator=g) * 0.2))
            tensors.append((f"{prefix}.lora_B.weight", torch.randn(out_dim, RANK, generator=g) * 0.2))
    config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA",
              "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}
    return tensors, config


def merged_greedy(tensors, prompts, n):
    """What the adapter should produce: W + alpha/r * B @ A, in transformers."""
    model = tiny_llama_model(0)
    named = dict(tensors)
    with torch.no_grad():
        for layer in range(2):
            for proj in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                a, b = named[f"{prefix}.lora_A.weight"], named[f"{prefix}.lora_B.weight"]
                weight = getattr(model.model.layers[layer].self_attn, proj).weight
                weight += (ALPHA / RANK) * (b @ a)
        outs = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                 pad_token_id=0, eos_token_id=None)
            outs.append(ids[0, len(p):].tolist())
    return outs


async def test_torch_engine_refuses_lora_with_a_clear_error():
    async with Supervisor(FleetConfig(engine="torch", num_workers=1)) as sup:
        tensors, config = make_adapter()
        with pytest.raises(Unsupported, match="LoRA"):
            await sup.update_weights(tensors, version=1, lora={"name": "a", "config": config})
        assert sup.weight_version == 0


@pytest.mark.vllm
@pytest.mark.slow
async def test_vllm_loads_a_lora_adapter_through_the_buckets(tmp_path):
    pytest.importorskip("vllm")
    model_dir = build_tiny_llama(str(tmp_path / "model"), seed=0)
    options = {"model": model_dir, "max_model_len": 256, "dtype": "float32", "enable_lora": True,
               "max_lora_rank": RANK}
    async with Supervisor(FleetConfig(engine="vllm", num_workers=1, engine_options=options,
                                      start_timeout_s=600)) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        base = [(await client.generate(f"b{i}", p, params)).token_ids for i, p in enumerate(PROMPTS)]
        tensors, config = make_adapter()
        report = await sup.update_weights(tensors, version=1, lora={"name": "policy", "config": config},
                                          bucket_bytes=4096)
        assert report.ok and report.num_buckets > 1
        adapted = [(await client.generate(f"a{i}", p, params)) for i, p in enumerate(PROMPTS)]
        assert [r.weight_versions for r in adapted] == [[1], [1]]
        assert [r.token_ids for r in adapted] != base
        assert [r.token_ids for r in adapted] == merged_greedy(tensors, PROMPTS, 12)
