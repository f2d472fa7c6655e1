"""A no-model engine for transport tests and overhead benchmarks.

Tokens are a deterministic function of the sequence so far (its last token and its
length), so resuming with prompt + partial tokens continues exactly where an
uninterrupted run would. ``tokens_per_s`` paces generation (0: as fast as possible).
A weight update with a tensor named ``offset`` shifts every later token, so tests can
see which weights produced which tokens; a tensor named ``fail`` makes the load fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineOutput

__all__ = ["EchoEngine", "echo_next_token"]


def echo_next_token(last_token: int, length: int, vocab_size: int, offset: int = 0) -> int:
    """The token that follows a sequence whose last token and length are given."""
    return (last_token * 31 + length * 7 + 11 + offset) % vocab_size


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.vocab_size = int(self.options.get("vocab_size", 32000))
        self.tokens_per_s = float(self.options.get("tokens_per_s", 0.0))
        self.eos_token_id = self.options.get("eos_token_id")
        self.offset = 0
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._sleeping = False
        self.num_tokens = 0
        self.num_requests = 0

    async def start(self) -> None:
        if self.options.get("fail_start"):
            raise RuntimeError("echo engine asked to fail at start (fail_start option)")

    def capabilities(self) -> set[str]:
        return {"pause", "sleep", "load_weights", "clear_kv_cache", "logprobs"}

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        self.num_requests += 1
        self._running.add(request_id)
        try:
            if params.max_tokens == 0:
                yield EngineOutput([], [] if params.logprobs else None, FinishReason.LENGTH.value)
                return
            last = prompt_ids[-1] if prompt_ids else 0
            length = len(prompt_ids)
            delay = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
            stop = set(params.stop_token_ids)
            if self.eos_token_id is not None and not params.ignore_eos:
                stop.add(int(self.eos_token_id))
            for i in range(params.max_tokens):
                if delay:
                    await asyncio.sleep(delay)
                elif i and i % 64 == 0:
                    await asyncio.sleep(0)  # let aborts in
                if not self._resumed.is_set():
                    await self._resumed.wait()
                if request_id in self._aborted:
                    yield EngineOutput([], [] if params.logprobs else None, FinishReason.ABORT.value)
                    return
                token = echo_next_token(last, length, self.vocab_size, self.offset)
                last, length = token, length + 1
                self.num_tokens += 1
                finish = None
                if token in stop:
                    finish = FinishReason.STOP.value
                elif i == params.max_tokens - 1:
                    finish = FinishReason.LENGTH.value
                yield EngineOutput([token], [-1.0] if params.logprobs else None, finish)
                if finish:
                    return
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def sleep(self, level: int = 1) -> None:
        self._sleeping = True

    async def wake_up(self) -> None:
        self._sleeping = False

    async def clear_kv_cache(self) -> None:
        return None

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in weights:
            if name == "fail":  # lets tests exercise a worker that cannot load an update
                raise ValueError("echo engine was sent a tensor named 'fail'")
            if name == "offset":
                self.offset = int(tensor.reshape(-1)[0]) if hasattr(tensor, "reshape") else int(tensor)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self._running),
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "paused": not self._resumed.is_set(),
            "sleeping": self._sleeping,
            "offset": self.offset,
        }
