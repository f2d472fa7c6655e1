"""The SGLang engine, written against SGLang's offline ``sglang.Engine`` and the
TokenizerManager it holds (``engine.tokenizer_manager``).

The Engine's synchronous control methods (flush_cache, update_weights_from_tensor,
release_memory_occupation, ...) each run ``self.loop.run_until_complete`` on the loop that
was current when the Engine was built, while ``async_generate`` runs on the caller's. So the
adapter builds the Engine on the worker's running loop and awaits the TokenizerManager's
coroutines there itself, with SGLang's request objects (``sglang.srt.managers.io_struct``);
abort_request, which writes to the manager's ZMQ socket, is called on that loop too, never
from another thread.

SGLang needs a CUDA stack, so this adapter is tested against a stand-in
(tests/engines/sglang_standin.py) shaped like it. Every optional operation is looked up on
the TokenizerManager at run time: an older SGLang that lacks one makes the adapter drop the
matching capability and raise ``Unsupported``, instead of failing at import.

Options: ``model`` (path, required), ``engine_factory`` ("module:callable" building the engine;
default "sglang:Engine"), ``extra`` (more keyword arguments for the engine, SGLang's server
args: tp_size, mem_fraction_static, ...). ``seed`` maps to SGLang's ``random_seed``;
``sampling_seed`` (set per worker by a fleet, derived from ``seed``) takes its place when
present. ``enable_memory_saver`` is passed True unless ``extra`` says otherwise, as verl does
for a rollout that shares its GPUs with training: without it SGLang's
release/resume_memory_occupation free nothing, so the adapter only lists "sleep" when the
engine's server args have it on. ``pause`` keeps requests (SGLang's ``retract`` mode: they go
back to the waiting queue, and their KV cache is rebuilt on resume, so the cache may be
flushed, e.g. by a weight update, while paused).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ..errors import EngineFailed, Unsupported
from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineOutput, check_prompt

__all__ = ["SglangEngine", "load_factory"]

logger = logging.getLogger(__name__)

# capability -> TokenizerManager methods it needs
NEEDS = {
    "pause": ("pause_generation", "continue_generation"),
    "sleep": ("release_memory_occupation", "resume_memory_occupation"),
    "load_weights": ("update_weights_from_tensor",),
    "clear_kv_cache": ("flush_cache",),
    "profile": ("start_profile", "stop_profile"),
}


def load_factory(spec: str) -> Any:
    """'package.module:attr' -> the attribute (imported lazily)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"engine_factory must look like 'module:callable', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def finish_reason(meta: dict[str, Any]) -> str | None:
    """SGLang's meta_info['finish_reason'] ({'type': 'stop'|'length'|'abort', ...}) as ours."""
    fr = meta.get("finish_reason")
    if not fr:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    return {"stop": "stop", "length": "length"}.get(str(kind), FinishReason.ABORT.value)


def io_struct() -> Any:
    """SGLang's request objects, imported when first needed (a fleet of other engines never
    imports sglang)."""
    return importlib.import_module("sglang.srt.managers.io_struct")


class SglangEngine(Engine):
    name = "sglang"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        if not self.options.get("model"):
            raise ValueError("the sglang engine needs option 'model' (a model path)")
        self.engine: Any = None
        self._running: set[str] = set()
        self._paused = False
        self._closed = False
        self.num_tokens = 0
        self.num_requests = 0

    async def start(self) -> None:
        factory = load_factory(str(self.options.get("engine_factory") or "sglang:Engine"))
        kwargs: dict[str, Any] = {"model_path": str(self.options["model"]), "skip_tokenizer_init": True,
                                  "enable_memory_saver": True}
        seed = self.options.get("sampling_seed", self.options.get("seed"))
        if seed is not None:
            kwargs["random_seed"] = int(seed)
        kwargs.update(self.options.get("extra") or {})
        # Built here, not in a thread: the Engine keeps the loop current at its making, and its
        # TokenizerManager's asyncio objects and sockets must live on the loop that awaits
        # them. The loop is held while the model loads; the worker is not serving yet.
        self.engine = factory(**kwargs)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            try:
                # It kills the engine's processes and waits for them; no loop is involved.
                await asyncio.to_thread(self.engine.shutdown)
            except Exception:
                logger.exception("sglang shutdown raised")
        self.engine = None

    @property
    def _manager(self) -> Any:
        if self.engine is None:
            raise EngineFailed("the sglang engine is not running")
        return self.engine.tokenizer_manager

    def capabilities(self) -> set[str]:
        if self.engine is None:
            return set()
        manager = self.engine.tokenizer_manager
        caps = {"logprobs"}
        for cap, methods in NEEDS.items():
            if all(callable(getattr(manager, m, None)) for m in methods):
                caps.add(cap)
        if not getattr(getattr(self.engine, "server_args", None), "enable_memory_saver", False):
            caps.discard("sleep")  # releasing would free nothing
        return caps

    def _method(self, cap: str, index: int = 0) -> Any:
        manager = self._manager
        fn = getattr(manager, NEEDS[cap][index], None)
        if cap not in self.capabilities() or fn is None:
            why = "enable_memory_saver is off" if cap == "sleep" and fn is not None else \
                f"its TokenizerManager has no {NEEDS[cap][index]}()"
            raise Unsupported(f"this SGLang engine cannot {cap}: {why}")
        return fn

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _sampling(params: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 means no limit
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
        }
        if params.seed is not None:
            out["sampling_seed"] = params.seed
        return out

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Raises InvalidRequest (a prompt the model cannot take), EngineFailed when SGLang
        fails the request."""
        manager = self._manager
        # With skip_tokenizer_init SGLang takes input_ids as given: an id outside the
        # vocabulary would reach the model's embedding.
        check_prompt(request_id, prompt_ids, max_len=int(manager.context_len),
                     vocab_size=int(manager.model_config.vocab_size))
        if params.max_tokens == 0:
            yield EngineOutput([], [] if params.logprobs else None, FinishReason.LENGTH.value)
            return
        self.num_requests += 1
        self._running.add(request_id)
        # rid is the id abort_request takes; SGLang keeps it as meta_info['id'].
        stream = await self.engine.async_generate(
            input_ids=list(prompt_ids),
            sampling_params=self._sampling(params),
            stream=True,
            rid=request_id,
            return_logprob=params.logprobs,
        )
        sent = 0
        try:
            async for chunk in stream:
                ids = list(chunk.get("output_ids", chunk.get("token_ids", [])))
                meta = chunk.get("meta_info") or {}
                # Streamed chunks carry every token so far or only the new ones, depending on
                # SGLang's incremental_streaming_output; completion_tokens tells which.
                total = meta.get("completion_tokens")
                new = ids[sent:] if total is not None and len(ids) == total else ids
                sent += len(new)
                lps = None
                if params.logprobs:
                    pairs = meta.get("output_token_logprobs") or []
                    lps = [float(p[0]) for p in pairs[len(pairs) - len(new):]] if new else []
                reason = finish_reason(meta)
                self.num_tokens += len(new)
                if new or reason:
                    yield EngineOutput(new, lps, reason)
                if reason:
                    return
            yield EngineOutput([], [] if params.logprobs else None, FinishReason.ABORT.value)
        except (GeneratorExit, asyncio.CancelledError):
            await self.abort(request_id)
            raise
        except EngineFailed:
            raise
        except Exception as exc:
            raise EngineFailed(f"sglang failed request {request_id}: {exc}", request_id=request_id) from exc
        finally:
            self._running.discard(request_id)
            if hasattr(stream, "aclose"):
                await stream.aclose()

    async def abort(self, request_id: str) -> None:
        if self.engine is None or request_id not in self._running:
            return
        # On the loop, not in a thread: it sends on the manager's ZMQ socket.
        self.engine.tokenizer_manager.abort_request(rid=request_id)

    # ------------------------------------------------------------------ control

    async def pause(self) -> None:
        fn = self._method("pause", 0)
        await fn(io_struct().PauseGenerationReqInput(mode="retract"))
        self._paused = True

    async def resume(self) -> None:
        fn = self._method("pause", 1)
        await fn(io_struct().ContinueGenerationReqInput())
        self._paused = False

    async def sleep(self, level: int = 1) -> None:
        fn = self._method("sleep", 0)
        await fn(io_struct().ReleaseMemoryOccupationReqInput(), None)

    async def wake_up(self) -> None:
        fn = self._method("sleep", 1)
        await fn(io_struct().ResumeMemoryOccupationReqInput(), None)

    async def clear_kv_cache(self) -> None:
        result = await self._method("clear_kv_cache")()
        # SGLang refuses to flush while requests run (or are paused in place); the cache is
        # then as it was, which costs reuse of stale prefixes, not correctness of new ones.
        if result is not None and not getattr(result, "success", True):
            logger.warning("sglang refused to flush its cache: requests are running")

    async def start_profile(self, trace_dir: str) -> None:
        # SGLang takes the trace directory per call (older versions read SGLANG_TORCH_PROFILER_DIR).
        fn = self._method("profile", 0)
        try:
            await fn(output_dir=trace_dir)
        except TypeError:
            await fn()

    async def stop_profile(self) -> None:
        await self._method("profile", 1)()

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Hand named tensors to update_weights_from_tensor (flushing the cache after). Raises
        EngineFailed when SGLang reports the update failed."""
        fn = self._method("load_weights")
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(str(n), t) for n, t in weights]
        # One payload per TP rank, as Engine.update_weights_from_tensor makes them: each rank
        # deserializes its own copy.
        tp_size = int(getattr(self.engine.server_args, "tp_size", 1) or 1)
        obj = io_struct().UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(tp_size)],
            load_format=None,
            flush_cache=True,
        )
        success, message = await fn(obj, None)
        if not success:
            raise EngineFailed(f"sglang refused the weight update: {message}")

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self._running),
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "paused": self._paused,
        }
