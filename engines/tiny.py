"""A tiny random Llama, so engines, tests and the demo run without downloading a model.

The shape is the smallest one every engine here accepts: vLLM's CPU attention kernel
refuses a head_dim of 16, so 4 heads of 32 over a hidden size of 128. Token-in/token-out,
so no tokenizer. The same seed gives the same weights (on the same torch version).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_LLAMA", "tiny_llama_config", "tiny_llama_model", "build_tiny_llama"]

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def tiny_llama_config() -> Any:
    """The ``LlamaConfig`` of the tiny model (float32)."""
    import torch
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_LLAMA, dtype=torch.float32)


def tiny_llama_model(seed: int = 0) -> Any:
    """A freshly initialised tiny ``LlamaForCausalLM`` in eval mode on the CPU."""
    import torch
    from transformers import LlamaForCausalLM

    # fork_rng: seeding must not disturb the caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config())
    return model.to(torch.float32).eval()


def build_tiny_llama(path: str, seed: int = 0) -> str:
    """Save the tiny model (safetensors + config.json) into ``path``; returns ``path``."""
    model = tiny_llama_model(seed)
    model.save_pretrained(path, safe_serialization=True)
    return path
