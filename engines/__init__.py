"""Engine adapters behind one interface: echo, torch (CPU default), vllm, sglang."""

from __future__ import annotations

from typing import Any

from .base import CAPABILITIES, Engine, EngineDead, EngineOutput

__all__ = ["Engine", "EngineOutput", "EngineDead", "CAPABILITIES", "ENGINE_NAMES", "create_engine"]

ENGINE_NAMES = ("echo", "torch", "vllm", "sglang")


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
