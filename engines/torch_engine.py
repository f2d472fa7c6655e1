"""The default engine: a transformers causal LM, batched, on the CPU (or one GPU).

Token-in/token-out. Concurrent requests share forward passes: the model runs on one
engine thread (``torch_runner``) that decodes all running requests together over one
left-padded KV cache (``torch_batch``), so the asyncio loop of the worker process stays
free for heartbeats and aborts.

Sampling: temperature 0 is greedy (argmax, as ``generate(do_sample=False)``), and so is any
temperature below 1e-5, as in vLLM; otherwise top-k, then top-p (which always keeps the most
likely token), then a draw from the request's own ``torch.Generator``, seeded with
``params.seed`` (when unset, from the engine's ``sampling_seed`` option and arrival order).
Logprobs are ``log_softmax`` of the raw logits, before temperature and filtering, so they
say how likely the model itself found the token, whatever the sampling settings.

Options: ``model`` (a local directory; unset builds the tiny random Llama of ``tiny.py``
in memory, so a demo needs no download), ``device`` ("cpu"), ``dtype`` ("float32"),
``max_batch_size`` (32), ``seed`` (0; the tiny model's seed), ``sampling_seed`` (the source of
seeds for requests without one; default ``seed``; a fleet passes each worker one of its own,
derived from this option or ``seed``: see ``actors.process.sampling_seed``), ``attn_implementation`` ("sdpa"), ``num_threads`` (torch intra-op
threads, process-wide; default 1 on the CPU, torch's own choice on a GPU).

Why 1 thread on the CPU by default: on a 2-core machine, the tiny model decoded ~30x
slower with torch's 2 OpenMP threads whenever another process wanted a core (a second
worker, the trainer), and barely faster with them when the machine was idle. Raise it for
a large model on a machine of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ..errors import DuplicateRequest, FleetClosed
from ..transport.messages import FinishReason, SamplingParams
from .base import Engine, EngineDead, EngineOutput, check_prompt
from .torch_runner import Runner, Seq, settle

__all__ = ["TorchEngine"]

logger = logging.getLogger(__name__)


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.device = torch.device(self.options.get("device") or "cpu")
        dtype_name = self.options.get("dtype") or "float32"
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must name a torch floating dtype, got {dtype_name!r}")
        self.dtype = dtype
        self.max_batch_size = int(self.options.get("max_batch_size") or 32)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        self.seed = int(self.options.get("seed") or 0)
        sampling = self.options.get("sampling_seed")
        self.sampling_seed = self.seed if sampling is None else int(sampling)
        threads = self.options.get("num_threads")
        if threads is None and self.device.type == "cpu":
            threads = 1
        self.num_threads: int | None = None if threads is None else int(threads)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        self.model: Any = None
        self.num_requests = 0
        self._runner: Runner | None = None
        self._closed = False
        self._requests: dict[str, Seq] = {}  # streams not yet ended

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model and start the engine thread; raises what loading raises."""
        self.model = await asyncio.to_thread(self._load_model)
        self._runner = Runner(self.model, device=self.device, max_batch_size=self.max_batch_size,
                              seed=self.sampling_seed, num_threads=self.num_threads, loop=asyncio.get_running_loop(),
                              on_death=self._on_death)
        self._runner.start()
        logger.info("torch engine ready on %s (%s, max batch %d)", self.device, self.dtype, self.max_batch_size)

    def _load_model(self) -> Any:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        path = self.options.get("model")
        if path:
            from transformers import AutoModelForCausalLM

            if str(path).startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(str(path))):
                # transformers would take it for a Hub repo id and say that its form is wrong.
                raise FileNotFoundError(f"model directory {path!r} does not exist")

            attn = self.options.get("attn_implementation") or "sdpa"
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation=attn)
        else:
            from .tiny import tiny_llama_model

            model = tiny_llama_model(self.seed)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.requires_grad_(False)
        return model

    async def shutdown(self) -> None:
        """Stop the engine thread and end every open stream with 'abort'. Idempotent."""
        self._closed = True
        if self._runner is None:
            return
        left = await asyncio.to_thread(self._runner.stop, 30.0)
        for item in left:
            if item[0] == "call":
                settle(item[3], None, FleetClosed("torch engine shut down"))
        for seq in self._requests.values():
            if not seq.done:
                seq.done = True
                seq.queue.put_nowait(seq.final(FinishReason.ABORT.value))

    def _on_death(self, reason: str) -> None:
        """The engine thread died: end every open stream with EngineDead (after what the thread
        sent before it died), so that the worker exits and its requests resume elsewhere."""
        for seq in self._requests.values():
            seq.done = True
            seq.queue.put_nowait(EngineDead(reason))

    @property
    def dead(self) -> bool:
        """True once the engine thread has died: the engine can serve nothing more."""
        return self._runner is not None and self._runner.failure is not None

    def capabilities(self) -> set[str]:
        return {"pause", "sleep", "load_weights", "clear_kv_cache", "profile", "logprobs"}

    @property
    def accepts_remote_tensors(self) -> bool:  # type: ignore[override]
        # On CPU the parameters are read into straight from the trainer's memory.
        return self.device.type == "cpu"

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Stream new tokens until a finish_reason.

        Raises InvalidRequest (empty, too long or out-of-vocabulary prompt),
        DuplicateRequest, FleetClosed (not started or shut down), EngineFailed (its prefill or
        a decode step failed), EngineDead (the engine thread died).
        """
        runner = self._live()
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already running", request_id=request_id)
        check_prompt(request_id, prompt_ids, max_len=runner.max_len, vocab_size=runner.vocab_size)
        self.num_requests += 1
        if params.max_tokens == 0:
            yield EngineOutput([], [] if params.logprobs else None, FinishReason.LENGTH.value)
            return
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else runner.eos_token_ids)
        seq = Seq(request_id, list(prompt_ids), params, stop)
        self._requests[request_id] = seq
        runner.post(("add", seq))
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
                runner.post(("abort", seq))
            if self._requests.get(request_id) is seq:
                del self._requests[request_id]

    async def abort(self, request_id: str) -> None:
        """Stop one request at the next step boundary; unknown ids are ignored."""
        seq = self._requests.get(request_id)
        if seq is not None and not seq.done and self._runner is not None:
            self._runner.post(("abort", seq))

    # ------------------------------------------------------------------ control
    async def pause(self) -> None:
        """Stop stepping; returns once no forward pass is running. Requests wait."""
        runner = self._live()
        await runner.call(runner.set_paused, True)

    async def resume(self) -> None:
        runner = self._live()
        await runner.call(runner.set_paused, False)

    async def sleep(self, level: int = 1) -> None:
        """Drop the KV cache and stop stepping; on CUDA also move the weights to CPU memory.

        Every level keeps the weights (on the CPU there is nothing else to free); running
        requests rebuild their cache after wake_up and carry on.
        """
        runner = self._live()
        await runner.call(runner.sleep)

    async def wake_up(self) -> None:
        runner = self._live()
        await runner.call(runner.wake_up)

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy named tensors (state-dict names) into the model between two decode steps.

        ``weights`` is consumed on the engine thread. Raises WeightsRefused (a ValueError) for
        unknown names and shape or dtype mismatches, all listed at once, before anything is
        copied: the model is then as it was. Names that carry a wrapper's prefix (DDP's ``module.``,
        torch.compile's ``_orig_mod.``, FSDP's ``_fsdp_wrapped_module.``, the last two also inside a
        name: base.wrapper_hint) are pointed out. The KV cache of running requests is kept, as vLLM keeps it.
        """
        runner = self._live()
        await runner.call(runner.load_weights, weights)

    async def clear_kv_cache(self) -> None:
        """Drop the KV cache; running requests rebuild theirs and carry on."""
        runner = self._live()
        await runner.call(runner.requeue)

    async def start_profile(self, trace_dir: str) -> None:
        """Record a torch.profiler trace of the engine thread until stop_profile."""
        runner = self._live()
        await runner.call(runner.profile_start, trace_dir)

    async def stop_profile(self) -> None:
        """Write the chrome trace into start_profile's directory; its path is ``trace_path``."""
        runner = self._live()
        await runner.call(runner.profile_stop)

    @property
    def trace_path(self) -> str | None:
        return self._runner.trace_path if self._runner else None

    def stats(self) -> dict[str, Any]:
        r = self._runner
        return {
            "num_running": len(r.batch.seqs) if r else 0,
            "num_waiting": len(r.waiting) if r else 0,
            "num_tokens": r.num_tokens if r else 0,
            "num_requests": self.num_requests,
            "num_steps": r.num_steps if r else 0,
            "num_prefills": r.num_prefills if r else 0,
            "num_weight_loads": r.num_weight_loads if r else 0,
            "paused": r.paused if r else False,
            "sleeping": r.sleeping if r else False,
            "device": str(self.device),
        }

    def _live(self) -> Runner:
        runner = self._runner
        if runner is not None and runner.failure is not None:
            raise EngineDead(f"torch engine thread died: {runner.failure!r}")
        if runner is None or self._closed:
            raise FleetClosed("torch engine is not running")
        return runner
