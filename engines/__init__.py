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
                               "max_model_len", "start_delay_s", "control_delay_s", "stall_after", "fail_start",
                               "fail_generate_after", "fail_fatal"},
    "torch": _COMMON_OPTIONS | {"model", "dtype", "max_batch_size", "num_threads", "attn_implementation"},
    "vllm": _COMMON_OPTIONS | {"model", "dtype", "max_model_len", "enforce_eager", "gpu_memory_utilization",
                               "tensor_parallel_size", "enable_lora", "max_lora_rank", "profile_dir", "enable_sleep_mode",
                               "extra"},
    "sglang": _COMMON_OPTIONS | {"model", "engine_factory", "extra"},
}


# Options a fleet sets for each worker itself (one given by the user would silently override it);
# an engine built directly takes them. What to use instead:
_FLEET_OPTIONS = {
    "device": "choose the workers' devices with FleetConfig.devices (serve --devices)",
    "private_dir": "FleetConfig.private_dir_root chooses where the fleet's private directory goes",
}

# Values checked before a worker starts: (engine or None for all, option) -> (what it must
# be, test). Others are left to the engine (vLLM's own checks name what is wrong).
_FLOAT_DTYPES = frozenset({"float32", "float", "float16", "half", "bfloat16", "float64", "double"})


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _count(v: Any) -> bool:
    return type(v) is int and v >= 1


_VALUE_CHECKS: dict[tuple[str | None, str], tuple[str, Any]] = {
    ("echo", "tokens_per_s"): ("a number >= 0", lambda v: _number(v) and v >= 0),
    ("echo", "vocab_size"): ("an int >= 1", _count),
    ("echo", "max_running"): ("an int >= 0", lambda v: type(v) is int and v >= 0),
    ("echo", "step_tokens"): ("an int >= 1", _count),
    ("echo", "max_model_len"): ("an int >= 2", lambda v: type(v) is int and v >= 2),
    ("torch", "dtype"): (f"one of {', '.join(sorted(_FLOAT_DTYPES))}", lambda v: v in _FLOAT_DTYPES),
    ("torch", "max_batch_size"): ("an int >= 1", _count),
    ("torch", "num_threads"): ("an int >= 1", _count),
    ("vllm", "max_model_len"): ("an int >= 1", _count),
    ("vllm", "tensor_parallel_size"): ("an int >= 1", _count),
    ("vllm", "gpu_memory_utilization"): ("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    ("vllm", "enable_sleep_mode"): ("True or False", lambda v: type(v) is bool),
    (None, "seed"): ("an int", lambda v: type(v) is int),
    (None, "sampling_seed"): ("an int", lambda v: type(v) is int),
    (None, "model"): ("a non-empty str (a model directory or name)", lambda v: type(v) is str and v != ""),
}


def check_engine_options(name: str, options: dict[str, Any] | None) -> None:
    """Raise ValueError for an unknown engine, naming any option its engine does not read, one
    the fleet sets itself (device, private_dir), or one whose value cannot be right (a negative
    rate, a dtype that is not a float one, ...)."""
    known = ENGINE_OPTIONS.get(name)
    if known is None:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    if not options:
        return
    for key, instead in _FLEET_OPTIONS.items():
        if key in options:
            raise ValueError(f"engine option {key!r} is set by the fleet for each worker: {instead}")
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        hint = " (other arguments of the engine itself go in 'extra', a dict)" if "extra" in known else ""
        raise ValueError(f"unknown {name} engine option(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(sorted(known - _FLEET_OPTIONS.keys()))}{hint}")
    for key, value in options.items():
        check = _VALUE_CHECKS.get((name, key)) or _VALUE_CHECKS.get((None, key))
        if check is not None and value is not None and not check[1](value):
            raise ValueError(f"{name} engine option {key!r} must be {check[0]}, got {value!r}")


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
