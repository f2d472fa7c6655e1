"""The torch engine's thread: it owns the model and the device and runs every step.

The asyncio side only posts to the inbox (a new request, an abort, a control call) and
reads each request's asyncio.Queue; the thread answers through
``loop.call_soon_threadsafe``, once per step. Control calls (pause, load_weights, sleep,
...) run on the thread between two steps, so they never race a forward pass and need no
lock; ``call`` returns once the thread has run one, so after ``pause`` no step is running.

An exception outside a forward pass is a bug, not a bad request: the thread dies, and on the
loop the control calls still waiting fail and ``on_death`` is told (the engine then ends every
open stream with ``EngineDead``, and the worker exits).

Each turn: handle the inbox; unless paused or asleep, prefill waiting requests one at a
time (unpadded, so a prompt is computed exactly as transformers' ``generate`` computes
it), add them to the running ``Batch``, then run one decode step for all of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import EngineFailed, FleetClosed, InvalidRequest
from ..transport.messages import FinishReason, SamplingParams
from .base import EngineDead, EngineOutput, WeightsRefused, wrapper_hint
from .torch_batch import SAMPLING_EPS, Batch, sample

__all__ = ["Runner", "Seq"]

logger = logging.getLogger(__name__)

_STOP, _LENGTH = FinishReason.STOP.value, FinishReason.LENGTH.value


class Seq:
    """One request. After it is posted, only the engine thread writes it."""

    __slots__ = ("request_id", "prompt", "params", "queue", "stop", "generator", "tokens", "done")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, stop: set[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.stop = stop  # stop_token_ids, plus EOS unless ignore_eos
        self.generator: torch.Generator | None = None  # made at the first sampled token
        self.tokens: list[int] = []  # generated so far
        self.done = False

    def final(self, reason: str) -> EngineOutput:
        return EngineOutput([], [] if self.params.logprobs else None, reason)


class Runner:
    def __init__(self, model: Any, *, device: torch.device, max_batch_size: int, seed: int,
                 num_threads: int | None, loop: asyncio.AbstractEventLoop,
                 on_death: Callable[[str], None]) -> None:
        self.model = model
        self.on_death = on_death  # called on the loop, with the reason, once the thread has died
        self.device = device
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.loop = loop
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        # The config's EOS and the generation config's, as vLLM stops at its tokenizer's EOS and
        # every one of generation_config.json (transformers' generate at the latter): chat models
        # often list the end of a turn only there (Llama 3 Instruct's <|eot_id|>).
        generation = getattr(model, "generation_config", None)
        self.eos_token_ids = _ids(config.eos_token_id) | _ids(getattr(generation, "eos_token_id", None))
        self.waiting: deque[Seq] = deque()
        self.batch = Batch(device)
        self.paused = self.sleeping = False
        self.failure: BaseException | None = None
        self.trace_path: str | None = None
        self.num_tokens = self.num_steps = self.num_prefills = self.num_weight_loads = 0
        self._seeds = random.Random(seed)  # seeds of requests that bring none
        self._profiler: tuple[Any, str] | None = None
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._taken: list[tuple[Any, ...]] = []  # the inbox items this turn is handling
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rollfleet-torch-engine", daemon=True)

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> list[tuple[Any, ...]]:
        """Stop the thread (blocking, up to ``timeout``); returns the inbox it left unread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("torch engine thread still busy after %.0f s; leaving it (daemon)", timeout)
        with self._cond:
            left = list(self._inbox)
            self._inbox.clear()
        return left

    @property
    def alive(self) -> bool:
        return self.failure is None and not self._stopping

    def post(self, item: tuple[Any, ...]) -> None:
        """Queue ("add", seq), ("abort", seq) or ("call", fn, args, future) for the thread."""
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread between two steps; raises what it raises."""
        if not self.alive:
            raise FleetClosed("torch engine is not running")
        fut = self.loop.create_future()
        self.post(("call", fn, args, fut))
        return await fut

    def _deliver(self, outputs: list[tuple[Seq, Any]]) -> None:
        for seq, item in outputs:
            seq.queue.put_nowait(item)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            if self.num_threads is not None:
                # Again here: with OpenMP the setting can be per calling thread.
                torch.set_num_threads(self.num_threads)
            with torch.inference_mode():
                while self._turn():
                    pass
        except BaseException as exc:  # a bug, not a bad request: the engine is dead
            logger.exception("torch engine thread died")
            self.failure = exc
            # On the loop, not here: a request that finished in the step that raised has its last
            # output in that step's list, which is lost, and only the loop knows every open stream.
            self._to_loop(self._died, f"torch engine thread died: {exc!r}")
        finally:
            if self._profiler is not None:  # stopped mid-profile: stop recording, keep nothing
                self._profiler[0].stop()
                self._profiler = None

    def _died(self, reason: str) -> None:
        """On the loop, once the thread has died: fail the control calls it left (one it died in
        included: a BaseException from it is not caught), then tell ``on_death``. ``call`` posts
        nothing from here on, since ``alive`` is False."""
        with self._cond:
            items = self._taken + list(self._inbox)
            self._inbox.clear()
        for item in items:
            if item[0] == "call":
                settle(item[3], None, EngineDead(reason))
        self.on_death(reason)

    def _turn(self) -> bool:
        with self._cond:
            while not self._inbox and not self._stopping and not self._runnable():
                self._cond.wait()
            if self._stopping:
                return False
            items = self._taken = list(self._inbox)
            self._inbox.clear()
        out: list[tuple[Seq, Any]] = []
        aborted: set[Seq] = set()
        for item in items:
            if item[0] == "add":
                self.waiting.append(item[1])
            elif item[0] == "abort":
                aborted.add(item[1])
            else:
                _, fn, args, fut = item
                try:
                    result, error = fn(*args), None
                except Exception as exc:
                    result, error = None, exc
                self._to_loop(settle, fut, result, error)
        self._taken = []
        if aborted:
            self._abort(aborted, out)
        if self._runnable():
            self._admit(out)
            if self.batch.seqs:
                self._decode(out)
        self._send(out)
        return True

    def _runnable(self) -> bool:
        return not self.paused and not self.sleeping and bool(self.waiting or self.batch.seqs)

    def _send(self, out: list[tuple[Seq, Any]]) -> None:
        if out:
            self._to_loop(self._deliver, out)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _abort(self, aborted: set[Seq], out: list[tuple[Seq, Any]]) -> None:
        self.waiting = deque(s for s in self.waiting if s not in aborted)
        rows = [i for i, s in enumerate(self.batch.seqs) if s not in aborted]
        if len(rows) < len(self.batch.seqs):
            self.batch.keep(rows, self.model.config)
        for seq in aborted:
            if not seq.done:  # it may have finished during the step the abort waited for
                seq.done = True
                out.append((seq, seq.final(FinishReason.ABORT.value)))

    def _admit(self, out: list[tuple[Seq, Any]]) -> None:
        """Prefill waiting requests, one at a time, while the batch has room."""
        parts = []
        while self.waiting and len(self.batch.seqs) + len(parts) < self.max_batch_size:
            seq = self.waiting.popleft()
            # prompt + tokens: a request requeued by clear_kv_cache or sleep rebuilds its cache.
            ids = torch.tensor([seq.prompt + seq.tokens], device=self.device)
            try:
                result = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            except Exception as exc:
                logger.exception("prefill of request %s failed", seq.request_id)
                seq.done = True
                out.append((seq, EngineFailed(f"prefill failed: {exc!r}", request_id=seq.request_id)))
                continue
            self.num_prefills += 1
            token = self._emit([seq], result.logits[:, -1], out)[0]
            if not seq.done:
                parts.append((seq, result.past_key_values, token))
        if parts:
            self.batch.add(parts, self.model.config)

    def _decode(self, out: list[tuple[Seq, Any]]) -> None:
        """One forward pass for every running request, then drop the finished rows."""
        b = self.batch
        mask = torch.cat([b.mask, torch.ones(len(b.seqs), 1, dtype=torch.long, device=self.device)], dim=1)
        try:
            result = self.model(input_ids=b.last[:, None], attention_mask=mask, position_ids=b.pos[:, None],
                                past_key_values=b.cache, use_cache=True)
        except Exception as exc:
            logger.exception("decode step failed; failing %d requests", len(b.seqs))
            for seq in b.seqs:
                seq.done = True
                out.append((seq, EngineFailed(f"decode step failed: {exc!r}", request_id=seq.request_id)))
            self.batch = Batch(self.device)
            return
        self.num_steps += 1
        b.mask, b.pos = mask, b.pos + 1
        b.last = torch.tensor(self._emit(b.seqs, result.logits[:, -1], out), device=self.device)
        rows = [i for i, s in enumerate(b.seqs) if not s.done]
        if len(rows) < len(b.seqs):
            b.keep(rows, self.model.config)

    def _emit(self, seqs: list[Seq], logits: torch.Tensor, out: list[tuple[Seq, Any]]) -> list[int]:
        """Choose one token per row, record it, and queue its output (finished or not)."""
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature >= SAMPLING_EPS]
        if rows:
            picked = [seqs[i] for i in rows]
            for seq in picked:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=self.device)
                    seed = seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63)
                    seq.generator.manual_seed(seed)
            chosen[rows] = sample(logits[rows], [s.params for s in picked], [s.generator for s in picked])
        logprobs = None
        if any(s.params.logprobs for s in seqs):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        tokens = chosen.tolist()
        self.num_tokens += len(tokens)
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.tokens.append(token)
            finish = None
            if token in seq.stop:
                finish = _STOP
            elif len(seq.tokens) >= seq.params.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_len:
                finish = _LENGTH
            seq.done = finish is not None
            lp = [logprobs[i]] if logprobs is not None and seq.params.logprobs else None
            out.append((seq, EngineOutput([token], lp, finish)))
        return tokens

    # ------------------------------------------------------------------ control, run via call()
    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    def requeue(self) -> None:
        """Drop the batch cache; running requests go back to the front of the queue.

        Their next prefill runs over prompt + generated tokens, which rebuilds the cache
        and samples the next token, so they continue where they were.
        """
        self.waiting.extendleft(reversed(self.batch.seqs))
        self.batch = Batch(self.device)

    def sleep(self) -> None:
        self.requeue()
        self.sleeping = True
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.sleeping = False

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy named tensors into the model. Every name, shape and dtype is checked first:
        one bad tensor raises WeightsRefused, which lists them all, and nothing is copied."""
        from ..weights.remote import RemoteTensor, read_into  # here: the weights package is not needed to start

        params = self.model.state_dict(keep_vars=True)
        # A name given twice: the last one wins (the reads in place below run after the copies).
        pairs = list({name: (name, tensor) for name, tensor in weights}.values())
        unknown, bad = [], []
        for name, tensor in pairs:
            target = params.get(name)
            if target is None:
                unknown.append(name)
            elif tuple(tensor.shape) != tuple(target.shape) or (
                    tensor.dtype != target.dtype and not (tensor.dtype.is_floating_point
                                                          and target.dtype.is_floating_point)):
                # A float of another width is cast, as vLLM's loaders do (fp32 master weights into a
                # bf16 engine); a shape, or an int/bool where a float is wanted, is an error.
                got, want = (tuple(tensor.shape), tensor.dtype), (tuple(target.shape), target.dtype)
                bad.append(f"{name}: got {got[0]} {got[1]}, want {want[0]} {want[1]}")
        if unknown or bad:
            raise WeightsRefused(f"load_weights: {_refusal(unknown, bad, params)}; nothing was loaded")
        remote = []  # (RemoteTensor, parameter): read together, across the machine's cores
        for name, tensor in pairs:
            target = params[name]
            if isinstance(tensor, RemoteTensor):
                if tensor.dtype == target.dtype and target.device.type == "cpu" and target.data.is_contiguous():
                    remote.append((tensor, target.data))
                else:
                    target.data.copy_(tensor.read())
            else:
                target.data.copy_(tensor)
        if remote:
            read_into(remote)
        self.num_weight_loads += 1

    def profile_start(self, trace_dir: str) -> None:
        if self._profiler is not None:
            raise InvalidRequest("a profile is already being recorded")
        os.makedirs(trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()  # here, on the thread that runs the model, so its ops are recorded
        self._profiler = (profiler, trace_dir)

    def profile_stop(self) -> None:
        if self._profiler is None:
            raise InvalidRequest("no profile is being recorded")
        profiler, trace_dir = self._profiler
        self._profiler = None
        profiler.stop()
        path = os.path.join(trace_dir, f"torch-engine-{os.getpid()}-{time.time_ns()}.json")
        profiler.export_chrome_trace(path)
        self.trace_path = path
        logger.info("profile written to %s", path)


def _ids(value: Any) -> set[int]:
    """Token ids given as None, one int or a list of them."""
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None}


MAX_LISTED = 10
"""Most names, and most bad tensors, one refusal lists (a bucket may hold hundreds)."""


def _refusal(unknown: list[str], bad: list[str], params: dict[str, Any]) -> str:
    """What is wrong with the tensors of a refused ``load_weights``, in words."""
    problems = []
    if unknown:
        problems.append(f"unknown names: {_listed(unknown)}")
        hint = wrapper_hint(unknown, params)
        if hint is not None:
            problems.append(hint)
    if bad:
        problems.append(f"wrong shape or dtype: {_listed(bad)}")
    return "; ".join(problems)


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return ", ".join(items[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Resolve a control call's future (on the loop), unless its caller gave up on it."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
