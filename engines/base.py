"""The one interface every engine adapter implements.

An engine lives inside an EngineWorker process and owns the device. It knows nothing
about sockets: the worker calls these methods and forwards what ``generate`` yields.

Capabilities are discovered, not assumed: ``capabilities()`` returns the operations the
installed engine really has; calling one it lacks raises ``Unsupported``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest, Unsupported
from ..transport.messages import SamplingParams

__all__ = ["Engine", "EngineOutput", "EngineDead", "WeightsRefused", "WRAPPER_PREFIXES", "wrapper_hint", "CAPABILITIES", "check_prompt"]


class EngineDead(RuntimeError):
    """The engine can no longer serve (e.g. a failed weight reload left it half-loaded).
    Any adapter raises this; the worker then reports why and exits, and is restarted."""


class WeightsRefused(ValueError):
    """``load_weights`` refused its tensors (an unknown name, a wrong shape or dtype) before
    applying any of them: the model is as it was. An engine that checks them all first raises
    this, so that a failed update does not count its weights as a mix of two versions."""


WRAPPER_PREFIXES = (
    ("module.", "the names start with 'module.' (a DDP wrapper?): pass model.module.named_parameters()"),
    ("_orig_mod.", "the names hold '_orig_mod.' (a torch.compile wrapper): pass the compiled module's own names, "
                   "model._orig_mod.named_parameters() for a model compiled whole"),
    ("_fsdp_wrapped_module.", "the names hold '_fsdp_wrapped_module.' (an FSDP wrapper): pass the full "
                              "state dict, model.state_dict() under FSDP.state_dict_type(model, "
                              "StateDictType.FULL_STATE_DICT), whose names are the model's own"),
)
"""Name prefixes that wrappers of a trainer's model add, each with what to pass instead."""

NESTED_WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.")
"""Those of WRAPPER_PREFIXES that also stand inside a name, after each submodule a wrapper
wrapped (FSDP's auto-wrap policy, a compiled layer): no model of its own has such a part."""


def _carries(name: str, prefix: str) -> bool:
    return name.startswith(prefix) or (prefix in NESTED_WRAPPERS and f".{prefix}" in name)


def _unwrapped(name: str, prefix: str) -> str:
    return ".".join(part for part in name.split(".") if f"{part}." != prefix) if prefix in NESTED_WRAPPERS \
        else name[len(prefix):]


def wrapper_hint(names: list[str], known: Any = None) -> str | None:
    """What to pass instead when the names carry a wrapper's prefix; None otherwise. DDP's
    ``module.`` counts when every name starts with it; the parts of NESTED_WRAPPERS wherever they
    stand in any name. Given ``known`` (the model's names), every such name must be one of
    them once the wrapper's parts are taken out."""
    for prefix, hint in WRAPPER_PREFIXES:
        if prefix in NESTED_WRAPPERS:
            carrying = [n for n in names if _carries(n, prefix)]
        else:
            carrying = names if all(n.startswith(prefix) for n in names) else []
        if carrying and (known is None or all(_unwrapped(n, prefix) in known for n in carrying)):
            return hint
    return None


# Every optional operation an engine may have. "generate" and "abort" are mandatory.
CAPABILITIES = (
    "pause",  # pause()/resume(): stop scheduling, keep requests
    "sleep",  # sleep()/wake_up(): release device memory
    "load_weights",  # load_weights(named tensors)
    "clear_kv_cache",
    "profile",  # start_profile(dir)/stop_profile()
    "lora",  # load_lora(name, named tensors)
    "logprobs",
)


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one request since the previous output."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    """None while running; then one of FinishReason's values."""


def check_prompt(request_id: str, prompt_ids: list[int], *, max_len: int, vocab_size: int) -> None:
    """Refuse a prompt the model cannot take: InvalidRequest (wire code ``bad_field``) when it
    is empty, has ``max_len`` tokens or more (no room for one more), or holds an id outside
    [0, vocab_size)."""
    if not prompt_ids:
        raise InvalidRequest("prompt_ids is empty", code="bad_field", request_id=request_id)
    if len(prompt_ids) >= max_len:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; the model takes fewer than {max_len}",
                             code="bad_field", request_id=request_id)
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", code="bad_field",
                             request_id=request_id)


class Engine(abc.ABC):
    """Base class. Subclasses override what they support and list it in capabilities()."""

    name: str = "base"
    accepts_remote_tensors: bool = False
    """True when ``load_weights`` takes ``weights.remote.RemoteTensor`` values (a tensor of
    the sender's process, read with ``copy_into(dst)`` or ``read()``): the shm transport then
    lets the engine read the trainer's tensors straight into its parameters."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    # -- lifecycle
    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; raise on failure (the worker reports it and exits)."""

    async def shutdown(self) -> None:
        """Release everything. Idempotent."""

    def capabilities(self) -> set[str]:
        return set()

    # -- requests
    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Stream outputs until one has a finish_reason. Aborting ends the stream with 'abort'.
        A prompt or sampling the engine refuses raises InvalidRequest with code ``bad_field``
        (``check_prompt``): the worker answers with that code, not ``engine_error``."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop one request; unknown ids are ignored."""

    # -- optional operations
    async def pause(self) -> None:
        raise Unsupported(f"{self.name} engine cannot pause")

    async def resume(self) -> None:
        raise Unsupported(f"{self.name} engine cannot resume")

    async def sleep(self, level: int = 1) -> None:
        raise Unsupported(f"{self.name} engine cannot sleep")

    async def wake_up(self) -> None:
        raise Unsupported(f"{self.name} engine cannot wake_up")

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Apply named tensors; they take effect from the next decode step."""
        raise Unsupported(f"{self.name} engine cannot load weights")

    async def load_lora(self, name: str, weights: Iterable[tuple[str, Any]], config: dict[str, Any]) -> None:
        raise Unsupported(f"{self.name} engine does not support LoRA adapters")

    async def clear_kv_cache(self) -> None:
        raise Unsupported(f"{self.name} engine cannot clear its KV cache")

    async def start_profile(self, trace_dir: str) -> None:
        raise Unsupported(f"{self.name} engine cannot profile")

    async def stop_profile(self) -> None:
        raise Unsupported(f"{self.name} engine cannot profile")

    def stats(self) -> dict[str, Any]:
        return {}
