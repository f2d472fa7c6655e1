"""The default engine: a transformers causal LM, batched, on the CPU (or one GPU).

How it runs. All model work happens on one engine thread, so the asyncio loop of the
worker process stays free for heartbeats and aborts. The loop side only posts messages
to the thread's inbox (a new request, an abort, a control call) and reads each request's
asyncio.Queue; the thread hands results back with ``loop.call_soon_threadsafe``, once per
step. Control calls (pause, load_weights, sleep, ...) run on the thread between two steps,
so they never race a forward pass and need no lock.

Each turn of the thread: handle the inbox; unless paused or asleep, prefill the waiting
requests one at a time (unpadded, so a prompt is computed exactly as transformers'
``generate`` computes it), merge their KV caches into the running batch, then run one
decode step for every running request together. The batch cache is left-padded: row i
keeps its n_i tokens in the last n_i columns, the attention mask hides the padding, and
position ids count each row's own tokens. Finished rows are dropped and all-padding
columns trimmed; the cache is rebuilt only when the batch changes.

Sampling: temperature 0 is greedy (argmax, as ``generate(do_sample=False)``); otherwise
top-k, then top-p, then a draw from the request's own ``torch.Generator``, seeded with
``params.seed`` (or from the engine's ``seed`` option and arrival order when unset).
Logprobs are ``log_softmax`` of the raw logits, before temperature and filtering, so they
say how likely the model itself found the token, whatever the sampling settings.

Options: ``model`` (a local directory; unset builds the tiny random Llama in memory),
``device`` ("cpu"), ``dtype`` ("float32"), ``max_batch_size`` (32), ``seed`` (0),
``attn_implementation`` ("sdpa").
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ..errors import DuplicateRequest, EngineFailed, FleetClosed, InvalidRequest
from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineOutput

__all__ = ["TorchEngine"]

logger = logging.getLogger(__name__)

_ABORT = FinishReason.ABORT.value
_STOP = FinishReason.STOP.value
_LENGTH = FinishReason.LENGTH.value


class _Seq:
    """One request's state. Written by the engine thread only, after it is posted."""

    __slots__ = ("request_id", "prompt", "params", "queue", "stop", "generator", "tokens",
                 "done", "aborted")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, stop: set[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.stop = stop
        self.generator: torch.Generator | None = None
        self.tokens: list[int] = []  # generated so far
        self.done = False
        self.aborted = False


class _Batch:
    """The running requests and their left-padded KV cache (one row each)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seqs: list[_Seq] = []
        self.cache: Any = None  # a DynamicCache, rebuilt when rows join or leave
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)  # tokens cached per row
        self.last = torch.zeros(0, dtype=torch.long, device=device)  # next input per row

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers] if self.cache else []

    def add(self, parts: list[tuple[_Seq, Any, int]], config: Any) -> None:
        """Append rows: (seq, its prefill cache, its next input token)."""
        from transformers import DynamicCache

        lengths = [c.layers[0].keys.shape[2] for _, c, _ in parts]
        width = max([self.mask.shape[1], *lengths])
        kv = [[_pad_left(k, width - k.shape[2]), _pad_left(v, width - v.shape[2])] for k, v in self.layers()]
        masks = [_pad_left(self.mask, width - self.mask.shape[1])] if self.seqs else []
        for (seq, cache, _), n in zip(parts, lengths):
            for i, layer in enumerate(cache.layers):
                k, v = _pad_left(layer.keys, width - n), _pad_left(layer.values, width - n)
                if i < len(kv):
                    kv[i] += [k, v]
                else:
                    kv.append([k, v])
            row = torch.zeros(1, width, dtype=torch.long, device=self.device)
            row[:, width - n:] = 1
            masks.append(row)
            self.seqs.append(seq)
        # kv[i] is [k_old, v_old, k1, v1, k2, v2, ...]: keys at even places, values at odd.
        self.cache = DynamicCache(ddp_cache_data=[(torch.cat(x[0::2]), torch.cat(x[1::2])) for x in kv],
                                  config=config)
        self.mask = torch.cat(masks)
        new = torch.tensor([[n, tok] for (_, _, tok), n in zip(parts, lengths)], device=self.device)
        self.pos = torch.cat([self.pos, new[:, 0]])
        self.last = torch.cat([self.last, new[:, 1]])

    def keep(self, rows: list[int], config: Any) -> None:
        """Keep only these rows, then trim columns that are padding in every row."""
        from transformers import DynamicCache

        if not rows:
            self.seqs, self.cache = [], None
            self.mask, self.pos, self.last = self.mask[:0, :0], self.pos[:0], self.last[:0]
            return
        index = torch.tensor(rows, device=self.device)
        self.seqs = [self.seqs[i] for i in rows]
        self.pos, self.last = self.pos[index], self.last[index]
        cut = self.mask.shape[1] - int(self.pos.max())
        self.mask = self.mask[index, cut:]
        self.cache = DynamicCache(ddp_cache_data=[(k[index, :, cut:], v[index, :, cut:]) for k, v in self.layers()],
                                  config=config)


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """Add n zero columns before the sequence axis (the last-but-one of KV, the last of a mask)."""
    if n == 0:
        return t
    if t.dim() == 2:
        return torch.cat([t.new_zeros(t.shape[0], n), t], dim=1)
    shape = list(t.shape)
    shape[2] = n
    return torch.cat([t.new_zeros(shape), t], dim=2)


def _sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row of raw logits under each row's temperature, top-k and top-p.

    Row work is batched; only the one uniform draw per row comes from that row's own
    generator, so a seeded request draws the same tokens in any batch. Sorting the vocab
    is slow on a CPU, so only rows with top_p < 1 are sorted.
    """
    vocab = logits.shape[1]
    device, dtype = logits.device, logits.dtype
    x = logits / torch.tensor([p.temperature for p in params], device=device, dtype=dtype)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks], device=device)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=device)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value stay in
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=device, dtype=dtype)[:, None]
        sub = x[nucleus]
        sorted_x = torch.sort(sub, dim=-1, descending=True).values
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep tokens while the mass before them is below top_p: a prefix, never empty.
        num_keep = ((torch.cumsum(probs, dim=-1) - probs) < top_p).sum(dim=1, keepdim=True)
        x[nucleus] = sub.masked_fill(sub < sorted_x.gather(1, num_keep - 1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, generator=g, device=device, dtype=dtype) for g in generators])
    # right=True skips zero-probability tokens; the fix-up covers u * total rounding up to total.
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    last = vocab - 1 - (probs > 0).flip(1).int().argmax(dim=1, keepdim=True)
    index = torch.where(probs.gather(1, index) > 0, index, last)
    return index[:, 0]


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.device = torch.device(self.options.get("device") or "cpu")
        dtype_name = self.options.get("dtype") or "float32"
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a torch floating dtype name, got {dtype_name!r}")
        self.dtype = dtype
        self.max_batch_size = int(self.options.get("max_batch_size") or 32)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        self.seed = int(self.options.get("seed") or 0)
        self.model: Any = None
        self.trace_path: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        self._failure: BaseException | None = None
        self._requests: dict[str, _Seq] = {}  # loop side: streams not yet ended
        self._waiting: deque[_Seq] = deque()
        self._batch = _Batch(self.device)
        self._seeds = random.Random(self.seed)
        self._paused = False
        self._sleeping = False
        self._profiler: Any = None
        self.num_tokens = self.num_requests = self.num_steps = self.num_prefills = 0
        self.num_weight_loads = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model and start the engine thread; raises what loading raises."""
        self._loop = asyncio.get_running_loop()
        self.model = await asyncio.to_thread(self._load_model)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        eos = config.eos_token_id
        if eos is None and getattr(self.model, "generation_config", None) is not None:
            eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        self._thread = threading.Thread(target=self._run, name="rollfleet-torch-engine", daemon=True)
        self._thread.start()
        logger.info("torch engine ready on %s (%s, max batch %d)", self.device, self.dtype, self.max_batch_size)

    def _load_model(self) -> Any:
        path = self.options.get("model")
        if path:
            from transformers import AutoModelForCausalLM

            attn = self.options.get("attn_implementation") or "sdpa"
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation=attn)
        else:
            from .tiny import tiny_llama_model

            model = tiny_llama_model(self.seed)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.requires_grad_(False)
        return model

    async def shutdown(self) -> None:
        """Stop the thread and end every open stream with 'abort'. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            if self._thread.is_alive():
                logger.warning("torch engine thread still busy after 30 s; leaving it (daemon)")
        # The thread is gone: settle what it left behind.
        for item in self._inbox:
            if item[0] == "call":
                _settle(item[3], None, FleetClosed("torch engine shut down"))
        self._inbox.clear()
        for seq in self._requests.values():
            if not seq.done:
                seq.done = True
                seq.queue.put_nowait(_final(seq, _ABORT))
        if self._profiler is not None:
            self._profiler = None

    def capabilities(self) -> set[str]:
        return {"pause", "sleep", "load_weights", "clear_kv_cache", "profile", "logprobs"}

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Stream new tokens. Raises InvalidRequest (bad prompt), DuplicateRequest, EngineFailed."""
        self._check_alive()
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already running", request_id=request_id)
        if not prompt_ids:
            raise InvalidRequest("prompt_ids is empty", request_id=request_id)
        if len(prompt_ids) >= self.max_len:
            raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; the model takes fewer than {self.max_len}",
                                 request_id=request_id)
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", request_id=request_id)
        self.num_requests += 1
        if params.max_tokens == 0:
            yield EngineOutput([], [] if params.logprobs else None, _LENGTH)
            return
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seq = _Seq(request_id, list(prompt_ids), params, stop)
        self._requests[request_id] = seq
        self._post(("add", seq))
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Coalesce whatever else is queued, so a slow reader gets fewer, larger chunks.
                while item.finish_reason is None and not seq.queue.empty():
                    more = seq.queue.get_nowait()
                    if isinstance(more, BaseException):
                        raise more
                    item.token_ids += more.token_ids
                    if item.logprobs is not None and more.logprobs is not None:
                        item.logprobs += more.logprobs
                    item.finish_reason = more.finish_reason
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.done:  # the reader went away early: free the request on the thread
                self._post(("abort", seq))
            if self._requests.get(request_id) is seq:
                del self._requests[request_id]

    async def abort(self, request_id: str) -> None:
        """Stop one request at the next step boundary; unknown ids are ignored."""
        seq = self._requests.get(request_id)
        if seq is not None and not seq.done:
            self._post(("abort", seq))

    # ------------------------------------------------------------------ control
    async def pause(self) -> None:
        """Stop stepping; returns once no forward pass is running. Requests wait."""
        await self._call(self._set, "_paused", True)

    async def resume(self) -> None:
        await self._call(self._set, "_paused", False)

    async def sleep(self, level: int = 1) -> None:
        """Drop KV caches and stop stepping; on CUDA also move the weights to CPU memory.

        Every level keeps the weights (in CPU memory); running requests recompute their
        cache on wake_up and continue.
        """
        await self._call(self._sleep)

    async def wake_up(self) -> None:
        await self._call(self._wake_up)

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy named tensors into the model between two steps; raises ValueError on bad input.

        ``weights`` is consumed on the engine thread. Names are state-dict names. Every
        tensor is checked as it arrives and the good ones are applied; unknown names and
        shape or dtype mismatches are collected and raised together at the end, so after a
        ValueError the model may hold a mix of old and new weights: load a full set again.
        """
        await self._call(self._load_weights, weights)

    async def clear_kv_cache(self) -> None:
        """Drop every KV cache; running requests recompute theirs and carry on."""
        await self._call(self._requeue)

    async def start_profile(self, trace_dir: str) -> None:
        """Record a torch.profiler trace of the engine thread until stop_profile."""
        await self._call(self._profile_start, trace_dir)

    async def stop_profile(self) -> None:
        """Write the chrome trace into the directory given to start_profile (see trace_path)."""
        await self._call(self._profile_stop)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self._batch.seqs),
            "num_waiting": len(self._waiting),
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "num_prefills": self.num_prefills,
            "num_weight_loads": self.num_weight_loads,
            "paused": self._paused,
            "sleeping": self._sleeping,
            "device": str(self.device),
        }

    # ------------------------------------------------------------------ loop side plumbing
    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineFailed(f"torch engine thread died: {self._failure!r}")
        if self._thread is None or self._stopping:
            raise FleetClosed("torch engine is not running")

    def _post(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    async def _call(self, fn: Any, *args: Any) -> Any:
        self._check_alive()
        assert self._loop is not None  # set by start(); _check_alive already ran
        fut = self._loop.create_future()
        self._post(("call", fn, args, fut))
        return await fut

    def _deliver(self, outputs: list[tuple[_Seq, Any]]) -> None:
        for seq, item in outputs:
            seq.queue.put_nowait(item)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._turn():
                    pass
        except BaseException as exc:  # a bug, not a bad request: fail everything loudly
            logger.exception("torch engine thread died")
            self._failure = exc
            error = EngineFailed(f"torch engine thread died: {exc!r}")
            self._send([(s, error) for s in self._all_seqs()])
            with self._cond:
                items = list(self._inbox)
                self._inbox.clear()
            for item in items:
                if item[0] == "call":
                    self._to_loop(_settle, item[3], None, error)
                elif item[0] == "add":
                    self._send([(item[1], error)])

    def _turn(self) -> bool:
        """One turn: inbox, then (unless paused or asleep) prefills and one decode step."""
        with self._cond:
            while not self._inbox and not self._stopping and not self._runnable():
                self._cond.wait()
            if self._stopping:
                return False
            items = list(self._inbox)
            self._inbox.clear()
        out: list[tuple[_Seq, Any]] = []
        aborted: set[_Seq] = set()
        for item in items:
            if item[0] == "add":
                self._waiting.append(item[1])
            elif item[0] == "abort":
                aborted.add(item[1])
            else:
                _, fn, args, fut = item
                try:
                    result, error = fn(*args), None
                except Exception as exc:
                    result, error = None, exc
                self._to_loop(_settle, fut, result, error)
        if aborted:
            self._abort(aborted, out)
        if self._runnable():
            self._admit(out)
            if self._batch.seqs:
                self._decode(out)
        self._send(out)
        return True

    def _runnable(self) -> bool:
        return not self._paused and not self._sleeping and bool(self._waiting or self._batch.seqs)

    def _send(self, out: list[tuple[_Seq, Any]]) -> None:
        if out:
            self._to_loop(self._deliver, out)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _all_seqs(self) -> list[_Seq]:
        return [*self._batch.seqs, *self._waiting]

    def _abort(self, aborted: set[_Seq], out: list[tuple[_Seq, Any]]) -> None:
        self._waiting = deque(s for s in self._waiting if s not in aborted)
        rows = [i for i, s in enumerate(self._batch.seqs) if s not in aborted]
        if len(rows) < len(self._batch.seqs):
            self._batch.keep(rows, self.model.config)
        for seq in aborted:
            if not seq.done:
                seq.done = seq.aborted = True
                out.append((seq, _final(seq, _ABORT)))

    def _admit(self, out: list[tuple[_Seq, Any]]) -> None:
        """Prefill waiting requests, one at a time, while the batch has room."""
        parts = []
        while self._waiting and len(self._batch.seqs) + len(parts) < self.max_batch_size:
            seq = self._waiting.popleft()
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
            self._batch.add(parts, self.model.config)

    def _decode(self, out: list[tuple[_Seq, Any]]) -> None:
        """One forward pass for every running request, then drop the finished rows."""
        b = self._batch
        mask = torch.cat([b.mask, torch.ones(len(b.seqs), 1, dtype=torch.long, device=self.device)], dim=1)
        try:
            result = self.model(input_ids=b.last[:, None], attention_mask=mask, position_ids=b.pos[:, None],
                                past_key_values=b.cache, use_cache=True)
        except Exception as exc:
            logger.exception("decode step failed; failing %d requests", len(b.seqs))
            for seq in b.seqs:
                seq.done = True
                out.append((seq, EngineFailed(f"decode step failed: {exc!r}", request_id=seq.request_id)))
            self._batch = _Batch(self.device)
            return
        self.num_steps += 1
        b.mask, b.pos = mask, b.pos + 1
        tokens = self._emit(b.seqs, result.logits[:, -1], out)
        b.last = torch.tensor(tokens, device=self.device)
        rows = [i for i, s in enumerate(b.seqs) if not s.done]
        if len(rows) < len(b.seqs):
            b.keep(rows, self.model.config)

    def _emit(self, seqs: list[_Seq], logits: torch.Tensor, out: list[tuple[_Seq, Any]]) -> list[int]:
        """Choose one token per row, record it, and queue its output (finished or not)."""
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature > 0]
        if rows:
            for i in rows:
                seq = seqs[i]
                if seq.generator is None:
                    seq.generator = torch.Generator(device=self.device)
                    seed = seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63)
                    seq.generator.manual_seed(seed)
            picked = [seqs[i] for i in rows]
            drawn = _sample(logits[rows], [s.params for s in picked], [s.generator for s in picked])  # type: ignore[misc]
            chosen[rows] = drawn
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
            lp = [logprobs[i]] if seq.params.logprobs and logprobs is not None else None
            out.append((seq, EngineOutput([token], lp, finish)))
        return tokens

    # ------------------------------------------------------------------ control, on the thread
    def _set(self, name: str, value: Any) -> None:
        setattr(self, name, value)

    def _requeue(self) -> None:
        """Drop the batch cache; running requests go back to the front of the queue.

        Their next prefill runs over prompt + generated tokens, which rebuilds the cache
        and samples the next token, so they continue where they were.
        """
        self._waiting.extendleft(reversed(self._batch.seqs))
        self._batch = _Batch(self.device)

    def _sleep(self) -> None:
        self._requeue()
        self._sleeping = True
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def _wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self._sleeping = False

    def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        params = self.model.state_dict(keep_vars=True)
        unknown, bad = [], []
        for name, tensor in weights:
            target = params.get(name)
            if target is None:
                unknown.append(name)
            elif tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
                bad.append(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                           f"want {tuple(target.shape)} {target.dtype}")
            else:
                target.data.copy_(tensor)
        self.num_weight_loads += 1
        if unknown or bad:
            problems = ([f"unknown names: {', '.join(unknown)}"] if unknown else []) + bad
            raise ValueError("load_weights: " + "; ".join(problems))

    def _profile_start(self, trace_dir: str) -> None:
        if self._profiler is not None:
            raise InvalidRequest("a profile is already being recorded")
        os.makedirs(trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        profiler.start()
        self._profiler = (profiler, trace_dir)

    def _profile_stop(self) -> None:
        if self._profiler is None:
            raise InvalidRequest("no profile is being recorded")
        profiler, trace_dir = self._profiler
        self._profiler = None
        profiler.stop()
        path = os.path.join(trace_dir, f"torch-engine-{os.getpid()}-{time.time_ns()}.json")
        profiler.export_chrome_trace(path)
        self.trace_path = path
        logger.info("profile written to %s", path)


def _final(seq: _Seq, reason: str) -> EngineOutput:
    return EngineOutput([], [] if seq.params.logprobs else None, reason)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
