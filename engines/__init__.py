"""Engine adapters behind one interface: echo, torch (CPU default), vllm, sglang."""

from __future__ import annotations

from typing import Any

from .base import CAPABILITIES, Engine, EngineDead, EngineOutput

__all__ = ["Engine", "EngineOutput", "EngineDead", "CAPABILITIES", "ENGINE_NAMES", "ENGINE_OPTIONS",
           "check_engine_options", "create_engine"]

ENGINE_NAMES = ("echo", "torch", "vllm", "sglang")

# The options each engine reads; any other is refused before a worker starts (a misspelt one
# would otherwise be ignored without a word). Every engine takes the ones the supervisor sets
# itself: device, private_dir, sampling_seed (and seed, their base).
_COMMON_OPTIONS = frozenset({"device", "private_dir", "seed", "sampling_seed"})
ENGINE_OPTIONS: dict[str, frozenset[str]] = {
    "echo": _COMMON_OPTIONS | {"vocab_size", "tokens_per_s", "eos_token_id", "max_running", "step_tokens",
                               "start_delay_s", "stall_after", "fail_start", "fail_generate_after", "fail_fatal"},
    "torch": _COMMON_OPTIONS | {"model", "dtype", "max_batch_size", "num_threads", "attn_implementation"},
    "vllm": _COMMON_OPTIONS | {"model", "dtype", "max_model_len", "enforce_eager", "gpu_memory_utilization",
                               "tensor_parallel_size", "enable_lora", "max_lora_rank", "profile_dir", "extra"},
    "sglang": _COMMON_OPTIONS | {"model", "engine_factory", "extra"},
}


def check_engine_options(name: str, options: dict[str, Any] | None) -> None:
    """Raise ValueError for an unknown engine, or naming any option its engine does not read."""
    known = ENGINE_OPTIONS.get(name)
    if known is None:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    if not options:
        return
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        hint = " (other arguments of the engine itself go in 'extra', a dict)" if "extra" in known else ""
        raise ValueError(f"unknown {name} engine option(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(sorted(known))}{hint}")


def create_engine(name: str, options: dict[str, Any] | None = None) -> Engine:
    """Build an engine by name; heavy imports happen only for the engine asked for."""
    if name == "echo":
        from .echo import EchoEngine

        return EchoEngine(options)
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(options)
    if name == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine(options)
    if name == "sglang":
        from .sglang_engine import SglangEngine

        return SglangEngine(options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
