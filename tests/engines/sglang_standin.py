"""A stand-in for ``sglang.Engine``, NOT SGLang: it is shaped like SGLang's offline Engine and
the TokenizerManager it holds, and produces tokens with a deterministic rule instead of a
model. SGLang needs CUDA and cannot run on the test machines.

The shape it keeps, for the adapter to be caught where it would fail on SGLang:

- ``Engine.__init__(**server_args)`` fixes ``self.loop`` (the running loop, else a new one);
  its synchronous control methods run ``self.loop.run_until_complete(tokenizer_manager.X(obj,
  None))`` as SGLang's do, so calling them from a coroutine or another thread fails here too.
- The optional operations live on ``engine.tokenizer_manager`` as coroutines taking SGLang's
  request objects (``pause_generation(PauseGenerationReqInput(mode=...))``, ...);
  ``abort_request(rid=..., abort_all=...)`` is synchronous and, standing for a ZMQ send, refuses
  to run off the thread that built the engine. The Engine itself has no pause or abort.
- The manager's asyncio objects are bound to the loop that first uses them.
- ``release/resume_memory_occupation`` free nothing unless ``enable_memory_saver`` was passed.

When sglang is not installed, importing this module puts fake ``sglang.srt.managers.io_struct``
and ``sglang.srt.utils`` modules in ``sys.modules``: dataclasses named and shaped like SGLang's
request objects, and a ``MultiprocessingSerializer`` (pickle), so that the adapter's imports
from SGLang's module paths resolve. With sglang installed, its own are used.

The next token is ``(last * 31 + length * 7 + 11 + offset) % vocab_size``; a weight update
with a tensor named ``offset`` shifts it, so tests can see the update take effect; a name the
model does not have makes the update fail, as (False, message). Streamed chunks carry every
output token so far (SGLang's default, non-incremental streaming).

``MinimalStandinEngine`` has only generation and abort, like an old SGLang, to show the
adapter degrading instead of failing.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, List, Literal, Optional, Union


def _install_fake_sglang() -> None:
    @dataclass
    class GenerateReqInput:
        input_ids: Optional[List[int]] = None
        sampling_params: Optional[dict] = None
        return_logprob: bool = False
        stream: bool = False
        rid: Optional[str] = None

    @dataclass
    class PauseGenerationReqInput:
        mode: Literal["abort", "retract", "in_place"] = "abort"

        def __post_init__(self):
            if self.mode not in ("abort", "retract", "in_place"):
                raise ValueError(f"Invalid mode: {self.mode!r}")

    @dataclass
    class ContinueGenerationReqInput:
        pass

    @dataclass
    class FlushCacheReqInput:
        pass

    @dataclass
    class FlushCacheReqOutput:
        success: bool

    @dataclass
    class UpdateWeightsFromTensorReqInput:
        serialized_named_tensors: List[Union[str, bytes]]
        load_format: Optional[str] = None
        flush_cache: bool = True
        abort_all_requests: bool = False
        weight_version: Optional[str] = None

    @dataclass
    class ReleaseMemoryOccupationReqInput:
        tags: Optional[List[str]] = None

    @dataclass
    class ResumeMemoryOccupationReqInput:
        tags: Optional[List[str]] = None

    class MultiprocessingSerializer:
        @staticmethod
        def serialize(obj: Any, output_str: bool = False) -> bytes:
            return pickle.dumps(obj)

        @staticmethod
        def deserialize(data: bytes) -> Any:
            return pickle.loads(data)

    io = types.ModuleType("sglang.srt.managers.io_struct")
    for cls in (GenerateReqInput, PauseGenerationReqInput, ContinueGenerationReqInput, FlushCacheReqInput,
                FlushCacheReqOutput, UpdateWeightsFromTensorReqInput, ReleaseMemoryOccupationReqInput,
                ResumeMemoryOccupationReqInput):
        cls.__module__ = io.__name__
        setattr(io, cls.__name__, cls)
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = MultiprocessingSerializer
    names = ("sglang", "sglang.srt", "sglang.srt.managers")
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[io.__name__] = io
    sys.modules[utils.__name__] = utils
    sys.modules["sglang"].srt = sys.modules["sglang.srt"]
    sys.modules["sglang.srt"].managers = sys.modules["sglang.srt.managers"]
    sys.modules["sglang.srt"].utils = utils
    sys.modules["sglang.srt.managers"].io_struct = io


try:
    from sglang.srt.managers import io_struct  # noqa: F401
    from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
except ImportError:
    _install_fake_sglang()

from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.utils import MultiprocessingSerializer  # noqa: E402


@dataclass
class ServerArgs:
    """The server args the tests use (SGLang's ServerArgs refuses unknown ones too)."""

    model_path: str
    skip_tokenizer_init: bool = False
    random_seed: Optional[int] = None
    tp_size: int = 1
    enable_memory_saver: bool = False
    mem_fraction_static: Optional[float] = None
    log_level: str = "error"


@dataclass
class ModelConfig:
    vocab_size: int = 512
    context_len: int = 4096


class MinimalTokenizerManager:
    """Generation and abort (stand-in, not SGLang)."""

    step_s = 0.001
    """Seconds per token, so a test can act while a request runs."""

    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.model_config = ModelConfig()
        self.context_len = self.model_config.context_len
        self.offset = 0
        self.rid_to_state: dict[str, Any] = {}
        self.aborted: set[str] = set()
        self.calls: list[str] = []
        # asyncio objects bind to the first loop that waits on them, as SGLang's do
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.pause_mode: Optional[str] = None
        self._owner = threading.get_ident()

    def _send_to_scheduler(self, what: str) -> None:
        # SGLang's ZMQ sockets are not thread-safe; one used off its thread corrupts messages.
        if threading.get_ident() != self._owner:
            raise RuntimeError(f"{what}: the tokenizer manager's socket used from another thread")
        self.calls.append(what)

    def next_token(self, last: int, length: int) -> int:
        return (last * 31 + length * 7 + 11 + self.offset) % self.model_config.vocab_size

    async def generate_request(self, obj: Any, request: Any = None):
        """Like SGLang's: an async generator of dicts, one per step when obj.stream."""
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        rid = obj.rid or "anon"
        self.rid_to_state[rid] = obj
        ids, sp = list(obj.input_ids or []), dict(obj.sampling_params or {})
        out: list[int] = []
        lps: list[tuple[float, int, None]] = []
        stop = set(sp.get("stop_token_ids") or [])
        n = int(sp.get("max_new_tokens", 128))
        try:
            last, length = (ids[-1] if ids else 0), len(ids)
            for i in range(n):
                # paused (retract/in_place): the request waits, keeping what it made
                async with self.is_pause_cond:
                    await self.is_pause_cond.wait_for(lambda: not self.is_pause or rid in self.aborted)
                await asyncio.sleep(self.step_s)
                if rid in self.aborted:
                    yield self._chunk(rid, out, lps, obj.return_logprob, {"type": "abort", "message": "aborted"})
                    return
                token = self.next_token(last, length)
                last, length = token, length + 1
                out.append(token)
                lps.append((-1.0 - 0.001 * len(out), token, None))
                reason = None
                if token in stop:
                    reason = {"type": "stop", "matched": token}
                elif i == n - 1:
                    reason = {"type": "length", "length": len(out)}
                if obj.stream or reason:
                    yield self._chunk(rid, out, lps, obj.return_logprob, reason)
                if reason:
                    return
        finally:
            self.rid_to_state.pop(rid, None)
            self.aborted.discard(rid)

    @staticmethod
    def _chunk(rid, out, lps, return_logprob, reason) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "completion_tokens": len(out)}
        if return_logprob:
            meta["output_token_logprobs"] = list(lps)
        return {"output_ids": list(out), "meta_info": meta}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and rid not in self.rid_to_state:
            return
        self._send_to_scheduler("abort_request")
        self.aborted |= set(self.rid_to_state) if abort_all else {rid}
        self._wake()

    def _wake(self) -> None:
        async def notify():
            async with self.is_pause_cond:
                self.is_pause_cond.notify_all()

        asyncio.get_running_loop().create_task(notify())


class TokenizerManager(MinimalTokenizerManager):
    """The optional operations too, with SGLang's signatures (stand-in, not SGLang)."""

    param_names = frozenset({"offset", "model.embed_tokens.weight"})

    def __init__(self, server_args: ServerArgs):
        super().__init__(server_args)
        self.memory_released = False
        self.num_flushes = 0
        self.profile_dir: Optional[str] = None
        self.refuse_flush = False

    async def pause_generation(self, obj: io_struct.PauseGenerationReqInput) -> None:
        async with self.is_pause_cond:
            self.is_pause, self.pause_mode = True, obj.mode
            self._send_to_scheduler("pause_generation")
        if obj.mode == "abort":
            while self.rid_to_state:
                self.abort_request(abort_all=True)
                await asyncio.sleep(0.01)

    async def continue_generation(self, obj: io_struct.ContinueGenerationReqInput) -> None:
        async with self.is_pause_cond:
            self.is_pause, self.pause_mode = False, None
            self._send_to_scheduler("continue_generation")
            self.is_pause_cond.notify_all()

    async def flush_cache(self) -> io_struct.FlushCacheReqOutput:
        self._send_to_scheduler("flush_cache")
        await asyncio.sleep(0)
        # SGLang flushes only when no request is in the running batch
        running = bool(self.rid_to_state) and self.pause_mode != "retract"
        if self.refuse_flush or running:
            return io_struct.FlushCacheReqOutput(success=False)
        self.num_flushes += 1
        return io_struct.FlushCacheReqOutput(success=True)

    async def update_weights_from_tensor(self, obj: io_struct.UpdateWeightsFromTensorReqInput, request: Any = None) -> tuple[bool, str]:
        self._send_to_scheduler("update_weights_from_tensor")
        if len(obj.serialized_named_tensors) != self.server_args.tp_size:
            return False, "one payload per TP rank expected"
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        unknown = [n for n, _ in named if n not in self.param_names]
        if unknown:
            return False, f"Failed to update weights: no parameter {unknown[0]}"
        for name, tensor in named:
            if name == "offset":
                self.offset = int(tensor.reshape(-1)[0])
        if obj.flush_cache:
            await self.flush_cache()
        return True, "Succeeded to update model weights."

    async def release_memory_occupation(self, obj: io_struct.ReleaseMemoryOccupationReqInput, request: Any = None) -> None:
        self._send_to_scheduler("release_memory_occupation")
        await asyncio.sleep(0)
        if self.server_args.enable_memory_saver:  # else torch_memory_saver is a no-op
            self.memory_released = True

    async def resume_memory_occupation(self, obj: io_struct.ResumeMemoryOccupationReqInput, request: Any = None) -> None:
        self._send_to_scheduler("resume_memory_occupation")
        await asyncio.sleep(0)
        self.memory_released = False

    async def start_profile(self, output_dir: Optional[str] = None, start_step: Optional[int] = None,
                            num_steps: Optional[int] = None, activities: Optional[List[str]] = None,
                            with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None) -> None:
        self._send_to_scheduler("start_profile")
        self.profile_dir = output_dir

    async def stop_profile(self) -> None:
        self._send_to_scheduler("stop_profile")
        self.profile_dir = None


class MinimalStandinEngine:
    """An Engine holding a MinimalTokenizerManager (stand-in, not SGLang)."""

    manager_class: type = MinimalTokenizerManager

    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs(**kwargs)
        self.tokenizer_manager = self.manager_class(self.server_args)
        self.is_shutdown = False
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)

    async def async_generate(self, prompt: Optional[str] = None, sampling_params: Optional[dict] = None,
                             input_ids: Optional[List[int]] = None, image_data: Any = None,
                             return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                             top_logprobs_num: Optional[int] = None, lora_path: Optional[str] = None,
                             custom_logit_processor: Optional[str] = None, stream: bool = False,
                             rid: Optional[str] = None) -> Any:
        """Like SGLang's: with stream=True an async generator of dicts, else one dict."""
        obj = io_struct.GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params,
                                         return_logprob=return_logprob, stream=stream, rid=rid)
        gen = self.tokenizer_manager.generate_request(obj, None)
        if stream:
            return gen
        return await gen.__anext__()

    def shutdown(self) -> None:
        self.is_shutdown = True


class StandinEngine(MinimalStandinEngine):
    """An Engine with SGLang's synchronous control methods, each driving the Engine's own loop
    (stand-in, not SGLang)."""

    manager_class = TokenizerManager

    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        obj = io_struct.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named_tensors)
                                      for _ in range(self.server_args.tp_size)],
            load_format=load_format, flush_cache=flush_cache)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))

    def release_memory_occupation(self, tags=None):
        obj = io_struct.ReleaseMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory_occupation(self, tags=None):
        obj = io_struct.ResumeMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.resume_memory_occupation(obj, None))

    def start_profile(self, **kwargs):
        self.loop.run_until_complete(self.tokenizer_manager.start_profile(**kwargs))

    def stop_profile(self):
        self.loop.run_until_complete(self.tokenizer_manager.stop_profile())
