"""A no-model engine for transport tests and overhead benchmarks.

Tokens are a deterministic function of the sequence so far (its last token and its
length), so resuming with prompt + partial tokens continues exactly where an
uninterrupted run would. ``tokens_per_s`` paces generation (0: as fast as possible).
A weight update with a tensor named ``offset`` shifts every later token, so tests can
see which weights produced which tokens; a tensor named ``fail`` makes the load fail (an empty
one loads, so that an update can hold the name).
Prompts are checked as a model's would be (``vocab_size``, 32000): an empty one, or one
with an id outside the vocabulary, is refused (InvalidRequest, wire code bad_field).
``max_model_len`` (default 1048576) is its context, as a model's: a prompt of that many
tokens or more is refused the same way, and a request stops (finish reason ``length``) when
prompt and output reach it, whatever its ``max_tokens``, as vLLM's and the torch engine's do.

Capacity, to stand in for a real engine in scaling runs:

- ``max_running``: N -- at most N requests generate at once (a real engine's batch limit,
  e.g. vLLM's ``max_num_seqs``); later ones wait their turn in arrival order, and an abort
  ends a waiting request at once. 0 (default): no limit.
- ``step_tokens``: K -- a request makes its tokens K at a time, one output each K tokens, and
  when paced one wait each K (K / tokens_per_s apart), so that thousands of paced sequences
  cost the worker little CPU. Default 1.

Fault options, for reliability tests. The generate faults fire when a request's sequence
(prompt + output) reaches a given length inside one generate call; a call whose prompt is
already that long (a resumed request) is spared, so a request resumed elsewhere completes:

- ``fail_start``: start() raises.
- ``start_delay_s``: start() takes this long (a window to kill a worker during start-up).
- ``control_delay_s``: sleep, wake_up, pause and resume each take this long before they take
  effect (as a real engine's sleep takes seconds: a window in which other things happen).
- ``fail_generate_after``: N -- generate raises RuntimeError when the sequence reaches N
  tokens; the request fails with engine_error and the worker goes on.
- ``fail_fatal``: with the option above, raise EngineDead (engines.base) instead: the
  worker reports it, exits and is restarted; its other requests resume.
- ``stall_after``: N -- generate stops producing tokens when the sequence reaches N tokens
  and ignores aborts; the worker's loop (and its heartbeats) go on, as with a hung engine.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineDead, EngineOutput, check_prompt

__all__ = ["EchoEngine", "EngineDead", "echo_next_token", "echo_tokens"]

# Enum member values are properties: read them once, not per token.
_STOP, _LENGTH, _ABORT = FinishReason.STOP.value, FinishReason.LENGTH.value, FinishReason.ABORT.value

DEFAULT_MAX_MODEL_LEN = 1 << 20  # a long-context model's; bounds what one request makes the fleet hold


def echo_next_token(last_token: int, length: int, vocab_size: int, offset: int = 0) -> int:
    """The token that follows a sequence whose last token and length are given."""
    return (last_token * 31 + length * 7 + 11 + offset) % vocab_size


def echo_tokens(prompt: list[int], n: int, vocab_size: int = 32000, offset: int = 0) -> list[int]:
    """The ``n`` tokens the echo engine generates after ``prompt`` (defaults: its own)."""
    out, last, length = [], prompt[-1], len(prompt)
    for _ in range(n):
        last = echo_next_token(last, length, vocab_size, offset)
        length += 1
        out.append(last)
    return out


class EchoEngine(Engine):
    name = "echo"
    # The worker may run generate() up to its first await outside any task (see
    # EngineWorker._start): nothing here needs asyncio.current_task() or asyncio.timeout.
    inline_first_step = True

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.vocab_size = int(self.options.get("vocab_size", 32000))
        self.tokens_per_s = float(self.options.get("tokens_per_s", 0.0))
        self.eos_token_id = self.options.get("eos_token_id")
        self.fail_after = _opt_int(self.options.get("fail_generate_after"))
        self.fail_fatal = bool(self.options.get("fail_fatal"))
        self.stall_after = _opt_int(self.options.get("stall_after"))
        self.max_running = int(self.options.get("max_running") or 0)
        self.step_tokens = max(1, int(self.options.get("step_tokens") or 1))
        self.max_model_len = int(self.options.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
        self.control_delay_s = float(self.options.get("control_delay_s") or 0.0)
        self._free = self.max_running  # slots left when max_running is set
        self._waiting: dict[str, asyncio.Future[bool]] = {}  # arrival order; True: slot granted
        self.offset = 0
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        # Set, and replaced by a fresh one, at every resume and abort: a request held by a pause
        # wakes and looks again (an abort ends it at once, paused or not, as vLLM's does).
        self._wake = asyncio.Event()
        self._sleeping = False
        self.num_tokens = 0
        self.num_requests = 0

    async def start(self) -> None:
        if self.options.get("fail_start"):
            raise RuntimeError("echo engine asked to fail at start (fail_start option)")
        delay = float(self.options.get("start_delay_s") or 0.0)
        if delay > 0:
            await asyncio.sleep(delay)

    def capabilities(self) -> set[str]:
        return {"pause", "sleep", "load_weights", "clear_kv_cache", "logprobs"}

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        check_prompt(request_id, prompt_ids, max_len=self.max_model_len, vocab_size=self.vocab_size)
        self.num_requests += 1
        self._running.add(request_id)
        slot = False
        try:
            if self.max_running:
                slot = await self._take_slot(request_id)
                if not slot:  # aborted while waiting
                    yield EngineOutput([], [] if params.logprobs else None, _ABORT)
                    return
            # The context ends the request where max_tokens would not (check_prompt left room for one).
            max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
            if max_tokens == 0:
                yield EngineOutput([], [] if params.logprobs else None, _LENGTH)
                return
            last = prompt_ids[-1] if prompt_ids else 0
            length = len(prompt_ids)
            step = self.step_tokens
            delay = step / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
            # The fault length this call can reach (-1: none); one int compare per token.
            fault_at = -1
            if self.fail_after is not None or self.stall_after is not None:
                fault_at = min((n for n in (self.fail_after, self.stall_after) if n is not None and n > length),
                               default=-1)
            stop = set(params.stop_token_ids)
            if self.eos_token_id is not None and not params.ignore_eos:
                stop.add(int(self.eos_token_id))
            made: list[int] = []  # tokens of the current step, not yet yielded
            for i in range(max_tokens):
                if i % step == 0 and made:
                    yield EngineOutput(made, [-1.0] * len(made) if params.logprobs else None, None)
                    made = []
                if delay:
                    if i % step == 0:
                        await asyncio.sleep(delay)
                elif i and i % 64 == 0:
                    await asyncio.sleep(0)  # let aborts in
                if not self._resumed.is_set() or request_id in self._aborted or length == fault_at:
                    if made:  # what was made is reported before waiting, stopping or failing
                        yield EngineOutput(made, [-1.0] * len(made) if params.logprobs else None, None)
                        made = []
                    while not self._resumed.is_set() and request_id not in self._aborted:
                        await self._wake.wait()
                    if request_id in self._aborted:
                        yield EngineOutput([], [] if params.logprobs else None, _ABORT)
                        return
                    if length == fault_at:
                        await self._fault(length)
                token = echo_next_token(last, length, self.vocab_size, self.offset)
                last, length = token, length + 1
                self.num_tokens += 1
                made.append(token)
                finish = None
                if token in stop:
                    finish = _STOP
                elif i == max_tokens - 1:
                    finish = _LENGTH
                if finish:
                    yield EngineOutput(made, [-1.0] * len(made) if params.logprobs else None, finish)
                    return
                if step == 1:
                    yield EngineOutput(made, [-1.0] if params.logprobs else None, None)
                    made = []
        finally:
            if slot:
                self._give_slot()
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    async def _take_slot(self, request_id: str) -> bool:
        """Wait for one of ``max_running`` slots; False if the request was aborted first."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._give_slot()  # granted, but the caller went away before taking it
            raise
        finally:
            if self._waiting.get(request_id) is waiter:
                del self._waiting[request_id]

    def _give_slot(self) -> None:
        """Hand a freed slot to the longest waiting request, or keep it."""
        while self._waiting:
            request_id = next(iter(self._waiting))
            waiter = self._waiting.pop(request_id)
            if not waiter.done():
                waiter.set_result(True)
                return
        self._free += 1

    async def _fault(self, length: int) -> None:
        if length == self.stall_after:
            await asyncio.Event().wait()  # stuck for good; only cancellation ends it
        if self.fail_fatal:
            raise EngineDead(f"echo engine died at length {length} (fail_fatal option)")
        raise RuntimeError(f"echo engine failed at length {length} (fail_generate_after option)")

    async def abort(self, request_id: str) -> None:
        waiter = self._waiting.pop(request_id, None)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(False)
            return
        if request_id in self._running:
            self._aborted.add(request_id)
            self._poke()

    async def _control_delay(self) -> None:
        if self.control_delay_s:
            await asyncio.sleep(self.control_delay_s)

    async def pause(self) -> None:
        await self._control_delay()
        self._resumed.clear()

    async def resume(self) -> None:
        await self._control_delay()
        self._resumed.set()
        self._poke()

    def _poke(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def sleep(self, level: int = 1) -> None:
        await self._control_delay()
        self._sleeping = True

    async def wake_up(self) -> None:
        await self._control_delay()
        self._sleeping = False

    async def clear_kv_cache(self) -> None:
        return None

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in weights:
            if name == "fail" and math.prod(getattr(tensor, "shape", (1,))):  # tests: a worker that cannot load
                raise ValueError("echo engine was sent a tensor named 'fail'")
            if name == "offset":
                self.offset = int(tensor.reshape(-1)[0]) if hasattr(tensor, "reshape") else int(tensor)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self._running) - len(self._waiting),
            "num_waiting": len(self._waiting),
            "free_slots": self._free if self.max_running else None,
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "paused": not self._resumed.is_set(),
            "sleeping": self._sleeping,
            "offset": self.offset,
        }


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
