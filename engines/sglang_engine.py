"""The SGLang engine, written against SGLang's documented offline ``sglang.Engine`` API.

SGLang needs a CUDA stack, so this adapter is tested against a stand-in
(tests/engines/sglang_standin.py) with the same method signatures. Every optional operation
is looked up on the engine object at run time: an older SGLang that lacks one makes the
adapter drop the matching capability and raise ``Unsupported``, instead of failing at import.

Options: ``model`` (path, required), ``engine_factory`` ("module:callable" building the engine;
default "sglang:Engine"), ``extra`` (more keyword arguments for the engine: tp_size,
mem_fraction_static, ...). ``seed`` maps to SGLang's ``random_seed``; ``sampling_seed`` (set per
worker by a fleet, derived from ``seed``) takes its place when present.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ..errors import EngineFailed, Unsupported
from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineOutput

__all__ = ["SglangEngine", "load_factory"]

logger = logging.getLogger(__name__)

# capability -> engine methods it needs
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
        kwargs: dict[str, Any] = {"model_path": str(self.options["model"]), "skip_tokenizer_init": True}
        seed = self.options.get("sampling_seed", self.options.get("seed"))
        if seed is not None:
            kwargs["random_seed"] = int(seed)
        kwargs.update(self.options.get("extra") or {})
        # Building an SGLang engine blocks while it loads the model; keep the loop alive.
        self.engine = await asyncio.to_thread(factory, **kwargs)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            try:
                await asyncio.to_thread(self.engine.shutdown)
            except Exception:
                logger.exception("sglang shutdown raised")
        self.engine = None

    def capabilities(self) -> set[str]:
        if self.engine is None:
            return set()
        caps = {"logprobs"}
        for cap, methods in NEEDS.items():
            if all(callable(getattr(self.engine, m, None)) for m in methods):
                caps.add(cap)
        return caps

    def _method(self, cap: str, index: int = 0) -> Any:
        if self.engine is None:
            raise EngineFailed("the sglang engine is not running")
        fn = getattr(self.engine, NEEDS[cap][index], None)
        if cap not in self.capabilities() or fn is None:
            raise Unsupported(f"this SGLang engine has no {NEEDS[cap][index]}()")
        return fn

    @staticmethod
    async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        """SGLang's Engine methods are synchronous (they wait on its scheduler); a stand-in
        or a newer version may be async. Either way the event loop keeps running."""
        if asyncio.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

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
        """Raises EngineFailed when SGLang fails the request."""
        if self.engine is None:
            raise EngineFailed("the sglang engine is not running")
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
        fn = getattr(self.engine, "abort_request", None)
        if fn is None:  # versions without Engine.abort_request still have the manager's
            fn = self.engine.tokenizer_manager.abort_request
        await self._call(fn, request_id)

    # ------------------------------------------------------------------ control

    async def pause(self) -> None:
        await self._call(self._method("pause", 0))
        self._paused = True

    async def resume(self) -> None:
        await self._call(self._method("pause", 1))
        self._paused = False

    async def sleep(self, level: int = 1) -> None:
        await self._call(self._method("sleep", 0))

    async def wake_up(self) -> None:
        await self._call(self._method("sleep", 1))

    async def clear_kv_cache(self) -> None:
        await self._call(self._method("clear_kv_cache"))

    async def start_profile(self, trace_dir: str) -> None:
        # SGLang takes the trace directory per call (older versions read SGLANG_TORCH_PROFILER_DIR).
        fn = self._method("profile", 0)
        try:
            await self._call(fn, output_dir=trace_dir)
        except TypeError:
            await self._call(fn)

    async def stop_profile(self) -> None:
        await self._call(self._method("profile", 1))

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Hand named tensors to update_weights_from_tensor (flushing the cache after)."""
        fn = self._method("load_weights")
        named = [(str(n), t) for n, t in weights]
        await self._call(fn, named_tensors=named, load_format=None, flush_cache=True)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self._running),
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "paused": self._paused,
        }
