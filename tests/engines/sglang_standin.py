"""A stand-in for ``sglang.Engine``, NOT SGLang: it mirrors the method signatures of SGLang's
offline Engine API that rollfleet's sglang adapter uses, and produces tokens with a
deterministic rule instead of a model. SGLang needs CUDA and cannot run on the test machines.

The next token is ``(last * 31 + length * 7 + 11 + offset) % vocab_size``; a weight update
with a tensor named ``offset`` shifts it, so tests can see the update take effect. Streamed
chunks carry every output token so far (SGLang's default, non-incremental streaming).

``MinimalStandinEngine`` has only generation and abort, like an old SGLang, to show the
adapter degrading instead of failing.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class MinimalStandinEngine:
    """Generation, abort and shutdown only (stand-in, not SGLang)."""

    vocab_size = 512
    step_s = 0.001
    """Seconds per token, so a test can act while a request runs."""

    def __init__(self, model_path: str, skip_tokenizer_init: bool = False, random_seed: int | None = None, **kwargs: Any):
        self.model_path = model_path
        self.skip_tokenizer_init = skip_tokenizer_init
        self.random_seed = random_seed
        self.kwargs = kwargs
        self.offset = 0
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.resumed = threading.Event()
        self.resumed.set()
        self.is_shutdown = False
        self.calls: list[str] = []

    def next_token(self, last: int, length: int) -> int:
        return (last * 31 + length * 7 + 11 + self.offset) % self.vocab_size

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        image_data: Any = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        lora_path: str | None = None,
        custom_logit_processor: str | None = None,
        stream: bool = False,
        rid: str | None = None,
    ) -> Any:
        """Like SGLang: with stream=True returns an async generator of dicts, else one dict."""
        gen = self._stream(list(input_ids or []), dict(sampling_params or {}), return_logprob, rid or "anon")
        if stream:
            return gen
        last = None
        async for last in gen:
            pass
        return last

    async def _stream(self, ids: list[int], sp: dict[str, Any], return_logprob: bool, rid: str):
        self.running.add(rid)
        out: list[int] = []
        lps: list[tuple[float, int, None]] = []
        stop = set(sp.get("stop_token_ids") or [])
        try:
            last, length = (ids[-1] if ids else 0), len(ids)
            for i in range(int(sp.get("max_new_tokens", 128))):
                while not self.resumed.is_set():  # paused: hold, keep state
                    await asyncio.sleep(0.001)
                await asyncio.sleep(self.step_s)
                if rid in self.aborted:
                    yield self._chunk(rid, out, lps, return_logprob, {"type": "abort", "message": "aborted"})
                    return
                token = self.next_token(last, length)
                last, length = token, length + 1
                out.append(token)
                lps.append((-1.0 - 0.001 * len(out), token, None))
                reason = None
                if token in stop:
                    reason = {"type": "stop", "matched": token}
                elif i == int(sp.get("max_new_tokens", 128)) - 1:
                    reason = {"type": "length", "length": len(out)}
                yield self._chunk(rid, out, lps, return_logprob, reason)
                if reason:
                    return
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)

    @staticmethod
    def _chunk(rid, out, lps, return_logprob, reason) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "completion_tokens": len(out)}
        if return_logprob:
            meta["output_token_logprobs"] = list(lps)
        return {"output_ids": list(out), "meta_info": meta}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.calls.append("abort_request")
        if abort_all:
            self.aborted |= self.running
        elif rid in self.running:
            self.aborted.add(rid)

    def shutdown(self) -> None:
        self.is_shutdown = True


class StandinEngine(MinimalStandinEngine):
    """The optional operations too (stand-in, not SGLang)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.memory_released = False
        self.num_flushes = 0
        self.profile_dir: str | None = None

    def pause_generation(self) -> None:
        self.calls.append("pause_generation")
        self.resumed.clear()

    def continue_generation(self) -> None:
        self.calls.append("continue_generation")
        self.resumed.set()

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: str | None = None, flush_cache: bool = True) -> tuple[bool, str]:
        self.calls.append("update_weights_from_tensor")
        for name, tensor in named_tensors:
            if name == "offset":
                self.offset = int(tensor.reshape(-1)[0])
        if flush_cache:
            self.flush_cache()
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.memory_released = True

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.memory_released = False

    def flush_cache(self) -> None:
        self.num_flushes += 1

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None, activities: list[str] | None = None) -> None:
        self.profile_dir = output_dir

    def stop_profile(self) -> None:
        self.profile_dir = None
