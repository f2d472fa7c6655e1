"""The vllm adapter refuses a DDP or torch.compile wrapper's names before vLLM sees them.

vLLM's loader fails on an unknown name half-way through a reload, which leaves its model
unusable (EngineDead: the worker is restarted, a minute or more with a real model). Names
that all carry a wrapper's prefix are refused up front instead, like the torch engine does,
and the engine serves on. No vLLM is started here: the refusal comes before any call to it (a stand-in for vLLM's
AsyncLLM records the calls that do reach it).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rollfleet.engines.base import EngineDead, WeightsRefused  # noqa: E402
from rollfleet.engines.tiny import tiny_llama_model  # noqa: E402
from rollfleet.engines.vllm_engine import VllmEngine  # noqa: E402


class AsyncLLMStandIn:
    """A stand-in for vLLM's AsyncLLM, with its ``collective_rpc`` signature: it records each
    call and fails it as vLLM's loader fails on an unknown name. What is checked is that the
    refused updates never reach it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append(method)
        raise RuntimeError("There is no module or parameter named 'module' in LlamaForCausalLM")


@pytest.fixture
def engine():
    eng = VllmEngine({"model": "/nonexistent"})
    eng.llm = AsyncLLMStandIn()
    return eng


@pytest.mark.parametrize("prefix, hint", [("module.", "model.module.named_parameters()"),
                                          ("_orig_mod.", "model._orig_mod.named_parameters()"),
                                          ("_fsdp_wrapped_module.", "StateDictType.FULL_STATE_DICT")])
async def test_wrapped_names_are_refused_and_the_engine_lives(engine, prefix, hint):
    pairs = [(prefix + n, p.detach()) for n, p in tiny_llama_model(0).named_parameters()]
    with pytest.raises(WeightsRefused, match="nothing was loaded") as info:
        await engine.load_weights(pairs)
    assert hint in str(info.value)
    descriptor = {"name": "unused", "tensors": [{"name": n, "dtype": "float32", "shape": list(t.shape), "offset": 0,
                                                  "nbytes": t.numel() * 4} for n, t in pairs]}
    with pytest.raises(WeightsRefused, match="nothing was loaded"):
        await engine.load_weights_from_descriptor(descriptor, commit=False)
    with pytest.raises(WeightsRefused, match="nothing was loaded"):  # the list form of entries too
        await engine.load_weights_from_descriptor({"name": "unused", "tensors": [[pairs[0][0], "float32", [1], 0, 4]]})
    assert engine.llm.calls == [] and not engine.dead


async def test_names_wrapped_inside_are_refused_too(engine):
    # FSDP's auto-wrap of each layer alone: the embeddings and the head keep their own names.
    pairs = [(n.replace("self_attn.", "_fsdp_wrapped_module.self_attn."), p.detach())
             for n, p in tiny_llama_model(0).named_parameters()]
    assert any("_fsdp_wrapped_module." not in n for n, _ in pairs)
    with pytest.raises(WeightsRefused, match="nothing was loaded") as info:
        await engine.load_weights(pairs)
    assert "StateDictType.FULL_STATE_DICT" in str(info.value) and "_fsdp_wrapped_module.self_attn" in str(info.value)
    assert engine.llm.calls == [] and not engine.dead


async def test_plain_names_still_reach_vllm(engine):
    descriptor = {"name": "unused", "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [128],
                                                  "offset": 0, "nbytes": 512}]}
    # It reaches vLLM, whose failure half-way through a load kills the engine (as it would).
    with pytest.raises(EngineDead, match="vllm weight load failed"):
        await engine.load_weights_from_descriptor(descriptor)
    assert engine.llm.calls == ["rollfleet_load_shm"] and engine.dead
