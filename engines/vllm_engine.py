"""The vLLM engine: ``AsyncLLM`` (vLLM v1) driven token-in/token-out inside the worker process.

vLLM spawns its own processes (EngineCore, which spawns the Worker holding the model). The
adapter points their socket files, temp files and cache into the fleet's private directory
(``private_dir``), removes what it created there on shutdown, and kills any of those
processes still alive afterwards.

Weights reach the model through vLLM's worker process: tensors are written into a POSIX
shared-memory segment and an extension method (``vllm_ext.RollfleetWorkerExtension``) maps it
and calls the model runner's ``reload_weights``; the prefix cache, whose blocks hold the old
weights' KV, is reset after each. A failed reload leaves the model half
loaded (meta tensors), so it raises ``EngineDead`` and the engine refuses further work.

Options: ``model`` (dir, required), ``max_model_len`` (512), ``gpu_memory_utilization``,
``dtype``, ``seed`` (vLLM's seed: its draws for requests without one; a fleet passes each worker
its own, ``sampling_seed``, derived from it), ``tensor_parallel_size``, ``enforce_eager`` (default: True without CUDA),
``enable_lora``, ``max_lora_rank`` (16), ``profile_dir`` (enables vLLM's torch profiler; it is
configured once, at start), ``enable_sleep_mode`` (default: True where vLLM has sleep mode, CUDA: without
it vLLM's sleep frees no memory, so the engine then offers no ``sleep``), ``private_dir``, ``extra`` (more
engine arguments).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ..actors.process import claim_private_dir, kmp_names, record_shm, shm_names_mapped, unlink_shm
from ..errors import EngineFailed, InvalidRequest, Unsupported
from ..transport.messages import FinishReason, SamplingParams
from .base import WRAPPER_PREFIXES, Engine, EngineDead, EngineOutput, WeightsRefused, check_prompt, wrapper_hint

__all__ = ["VllmEngine", "EngineDead", "write_segment"]

logger = logging.getLogger(__name__)

EXTENSION = "rollfleet.engines.vllm_ext.RollfleetWorkerExtension"
ALIGN = 64
# vLLM's finish reasons that are not ours: a detected repetition is a stop.
FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def write_segment(weights: Iterable[tuple[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Copy named tensors into a new /dev/shm segment; returns (segment name, descriptions).

    The caller unlinks ``/dev/shm/<name>``. The name is unguessable so another local user
    cannot pre-create or read it; the file is created 0600 with O_EXCL.
    """
    import torch

    tensors = [(str(name), t.detach().to("cpu").contiguous()) for name, t in weights]
    entries, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(
            {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
             "offset": offset, "nbytes": nbytes}
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    seg = "rollfleet-" + secrets.token_hex(16)
    path = os.path.join("/dev/shm", seg)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(offset, 1))
        mm = mmap.mmap(fd, max(offset, 1))
        try:
            for (_, t), e in zip(tensors, entries):
                if e["nbytes"]:
                    dst = torch.frombuffer(mm, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"])
                    dst.copy_(t.reshape(-1).view(torch.uint8))
                    del dst
        finally:
            mm.close()
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return seg, entries


def _client_error(exc: BaseException) -> bool:
    """vLLM's own verdict that a request is the client's fault (its VLLMClientError, the 4xx
    of its server; absent in old versions)."""
    return any(cls.__name__ == "VLLMClientError" for cls in type(exc).__mro__)


def _terminate(procs: list[Any]) -> None:
    """SIGTERM, then SIGKILL after 5 s, and reap."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        logger.warning("vllm child %d ignored SIGTERM; killing it", p.pid)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _own_resource_tracker() -> int | None:
    """Pid of the multiprocessing resource tracker this process started, if any."""
    import multiprocessing.resource_tracker as rt

    tracker = getattr(rt, "_resource_tracker", None)
    return getattr(tracker, "_pid", None) if getattr(tracker, "_fd", None) is not None else None


def _stop_resource_tracker() -> None:
    """Close this process's end of the tracker's pipe, so that it cleans up and exits (a
    later use of multiprocessing starts a new one); killed if it has not within 5 s (it
    ignores SIGTERM)."""
    import multiprocessing.resource_tracker as rt

    import psutil

    tracker = rt._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        if fd is None or pid is None:
            return
        tracker._fd = tracker._pid = None
        os.close(fd)
    try:
        proc = psutil.Process(pid)
        try:
            proc.wait(timeout=5)
        except psutil.TimeoutExpired:
            logger.warning("multiprocessing resource tracker %d did not exit; killing it", pid)
            proc.kill()
            proc.wait(timeout=5)
    except psutil.Error:
        pass


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        if not self.options.get("model"):
            raise ValueError("the vllm engine needs option 'model' (a model directory)")
        self._dead = False
        self.llm: Any = None
        self.active_lora: str | None = None
        self._loras: dict[str, Any] = {}
        self._running: set[str] = set()
        self._paused = False
        self._sleep_level = 0  # the level vLLM sleeps at; 0: awake
        self._weights_awake = True  # its weights' GPU memory is mapped (asleep: until a load needs it)
        self._stale_prefix = False  # the prefix cache may hold KV of older weights (see _drop_prefix_cache)
        self._children: list[Any] = []
        self._run_dir: str | None = None
        self._shm_names: set[str] = set()
        self._shm_list: str | None = None
        self._own_private = False
        self._profile_dir: str | None = None
        self._trace_dir: str | None = None
        self._profile_before: set[str] = set()
        self._closed = False
        self.num_tokens = 0
        self.num_requests = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        import psutil
        import torch

        opts = self.options
        private = opts.get("private_dir")
        if not private:
            private = tempfile.mkdtemp(prefix="rollfleet-vllm-")
            self._own_private = True
            # Marked as this process's, as a fleet's private directory is: if it is killed, the
            # next fleet started on this machine removes the directory and the shm names it lists.
            claim_private_dir(private)
        os.makedirs(private, mode=0o700, exist_ok=True)
        # Our own subdirectory for sockets and temp files, so shutdown can remove exactly it.
        self._run_dir = tempfile.mkdtemp(prefix="vllm-", dir=private)
        env = {
            "VLLM_RPC_BASE_PATH": self._run_dir,
            "TMPDIR": self._run_dir,
            "VLLM_CACHE_ROOT": os.path.join(private, "vllm-cache"),
        }
        cuda = torch.cuda.is_available()
        if not cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; vLLM's default would claim far more
        args = self._engine_args(cuda)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        finally:
            # vLLM's children copied the environment when spawned; the host process keeps its own.
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        # vLLM's processes share queues through multiprocessing shared memory: listed where
        # the supervisor finds them if this process is killed (actors/process.py).
        pids = [p.pid for p in self._children]
        self._shm_names = shm_names_mapped(pids) | kmp_names(pids)  # killed children leave both
        # This process's own too (record_shm adds its OpenMP registration): killed with its
        # supervisor (the whole job's process group), it leaves nobody else who knows its pid.
        self._shm_list = record_shm(private, self._shm_names | shm_names_mapped([os.getpid()]))
        logger.info("vllm engine started: model %s, %d child processes", opts["model"], len(self._children))

    def _engine_args(self, cuda: bool) -> dict[str, Any]:
        opts = self.options
        args: dict[str, Any] = {
            "model": str(opts["model"]),
            "skip_tokenizer_init": True,
            "enforce_eager": bool(opts.get("enforce_eager", not cuda)),
            "max_model_len": int(opts.get("max_model_len", 512)),
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
        }
        for key in ("gpu_memory_utilization", "dtype", "seed", "tensor_parallel_size"):
            if opts.get(key) is not None:
                args[key] = opts[key]
        sleep = opts.get("enable_sleep_mode")
        if sleep is None:  # vLLM's own default is off: its sleep would then free no memory
            sleep = cuda and _sleep_mode_available()
        if sleep:
            args["enable_sleep_mode"] = True  # (weights and KV cache in its cumem pool, which sleep releases)
        if opts.get("sampling_seed") is not None:
            # vLLM draws unseeded requests from one generator seeded with this: the same value in
            # every worker would give them the same samples.
            args["seed"] = int(opts["sampling_seed"])
        if opts.get("enable_lora"):
            args["enable_lora"] = True
            args["max_lora_rank"] = int(opts.get("max_lora_rank", 16))
        if opts.get("profile_dir"):
            self._profile_dir = os.path.abspath(str(opts["profile_dir"]))
            os.makedirs(self._profile_dir, exist_ok=True)
            args["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": self._profile_dir}
        args.update(opts.get("extra") or {})
        return args

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.llm is not None:
            try:
                self.llm.shutdown()
            except Exception:
                logger.exception("vllm shutdown raised")
            self.llm = None
        names = self._shm_names | shm_names_mapped([p.pid for p in self._children if p.is_running()])
        await asyncio.to_thread(self._reap)
        # A clean shutdown has unlinked them; an engine that died (or children killed) has not.
        left = unlink_shm(names)
        if left:
            logger.info("unlinked shared memory left by vLLM's processes: %s", ", ".join(sorted(left)))
        if self._shm_list:
            with contextlib.suppress(OSError):
                record_shm(os.path.dirname(self._shm_list), set())  # what this process itself may leave
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        if self._own_private:
            shutil.rmtree(os.path.dirname(self._run_dir or ""), ignore_errors=True)

    def _reap(self) -> None:
        import psutil

        # Python's multiprocessing resource tracker, started by this process for vLLM's
        # children, goes last and by itself: once nobody writes to it any more it unlinks the
        # semaphores and segments those children registered and did not release (a killed
        # vLLM process releases nothing).
        tracker = _own_resource_tracker()
        alive = [p for p in self._children if p.is_running() and p.pid != tracker]
        _terminate(alive)
        if tracker is not None and any(p.pid == tracker for p in self._children):
            _stop_resource_tracker()

    def capabilities(self) -> set[str]:
        if self.llm is None:
            return set()
        llm, caps = self.llm, {"logprobs", "load_weights"}
        if hasattr(llm, "pause_generation") and hasattr(llm, "resume_generation"):
            caps.add("pause")
        if hasattr(llm, "sleep") and hasattr(llm, "wake_up") and _sleep_frees_memory(llm):
            caps.add("sleep")
        if hasattr(llm, "reset_prefix_cache"):
            caps.add("clear_kv_cache")
        if self._profile_dir and hasattr(llm, "start_profile"):
            caps.add("profile")
        if self.options.get("enable_lora") and hasattr(llm, "add_lora"):
            caps.add("lora")
        return caps

    @property
    def dead(self) -> bool:
        """A weight reload failed half-way (nothing more can run), or vLLM's own engine process
        died (``AsyncLLM.errored``): the worker then exits and is restarted."""
        return self._dead or bool(self.llm is not None and getattr(self.llm, "errored", False))

    @dead.setter
    def dead(self, value: bool) -> None:
        self._dead = value

    def _check(self) -> Any:
        if self.dead:
            why = "after a failed weight reload" if self._dead else "(its engine process died)"
            raise EngineDead(f"the vllm engine is dead {why}")
        if self.llm is None:
            raise EngineFailed("the vllm engine is not running")
        return self.llm

    # ------------------------------------------------------------------ requests

    def _sampling(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),  # vLLM: 0 means no limit; it also turns -1 into 0
            seed=params.seed,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            # 0: only the chosen token's logprob (vLLM always includes the sampled token)
            logprobs=0 if params.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Raises InvalidRequest (a prompt the model cannot take, or a request vLLM refuses as
        the client's fault), EngineDead, EngineFailed (vLLM failed the request)."""
        llm = self._check()
        # vLLM checks the prompt's length but not its ids: an id outside the vocabulary would
        # reach the model's embedding.
        config = llm.model_config
        check_prompt(request_id, prompt_ids, max_len=config.max_model_len, vocab_size=config.get_vocab_size())
        if params.max_tokens == 0:
            yield EngineOutput([], [] if params.logprobs else None, FinishReason.LENGTH.value)
            return
        try:
            # vLLM checks its own ranges here (a temperature above 2, ...), before the request is
            # counted as running.
            sampling = self._sampling(params)
        except Exception as exc:
            if _client_error(exc) or isinstance(exc, ValueError):
                raise InvalidRequest(f"vllm refused request {request_id}: {exc}", code="bad_field",
                                     request_id=request_id) from exc
            raise
        if self._stale_prefix and not self._running:
            await self._drop_prefix_cache()
        lora = self._loras.get(self.active_lora) if self.active_lora else None
        self.num_requests += 1
        self._running.add(request_id)
        stream = llm.generate({"prompt_token_ids": list(prompt_ids)}, sampling, request_id, lora_request=lora)
        finished = False
        try:
            async for out in stream:
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps = None
                if params.logprobs:
                    lps = [float(d[t].logprob) for t, d in zip(ids, comp.logprobs or [])]
                reason = comp.finish_reason if out.finished else None
                if reason == "error":
                    raise EngineFailed(f"vllm failed request {request_id}", request_id=request_id)
                if reason is not None:
                    reason = FINISH.get(str(reason), FinishReason.ABORT.value)
                    finished = True
                self.num_tokens += len(ids)
                if ids or reason:
                    yield EngineOutput(ids, lps, reason)
                if finished:
                    return
            # The stream ended without a finished output: only an abort does that.
            yield EngineOutput([], [] if params.logprobs else None, FinishReason.ABORT.value)
        except (EngineFailed, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            if self.dead:
                raise EngineDead(str(exc)) from exc
            if _client_error(exc):
                raise InvalidRequest(f"vllm refused request {request_id}: {exc}", code="bad_field",
                                     request_id=request_id) from exc
            raise EngineFailed(f"vllm failed request {request_id}: {exc}", request_id=request_id) from exc
        finally:
            self._running.discard(request_id)
            # Closing vLLM's generator aborts the request there if it still runs.
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        if self.llm is not None and not self.dead:
            await self.llm.abort(request_id)

    # ------------------------------------------------------------------ control

    async def pause(self) -> None:
        """Stop scheduling; running requests keep their state and KV cache ('keep' mode)."""
        llm = self._check()
        if not hasattr(llm, "pause_generation"):
            raise Unsupported("this vLLM cannot pause generation")
        await llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        llm = self._check()
        if not hasattr(llm, "resume_generation"):
            raise Unsupported("this vLLM cannot resume generation")
        await llm.resume_generation()
        self._paused = False

    async def sleep(self, level: int = 1) -> None:
        llm = self._check()
        # Where vLLM has no sleep mode (CPU), or was started without it, its sleep frees
        # nothing and aborts the running requests: refuse it rather than pretend.
        if not _sleep_frees_memory(llm):
            raise Unsupported(_NO_SLEEP)
        await llm.sleep(level)
        self._sleep_level, self._weights_awake = level, False

    async def wake_up(self) -> None:
        llm = self._check()
        if not _sleep_frees_memory(llm):
            raise Unsupported(_NO_SLEEP)
        await llm.wake_up()
        self._sleep_level, self._weights_awake = 0, True

    async def _wake_weights(self) -> None:
        """A weight update while asleep (hybrid mode: between training steps): vLLM's sleep
        unmapped the weights' GPU memory, so map it back before loading into it, and leave the
        KV cache asleep until ``wake_up``. After a level 2 sleep the weights' old contents are
        gone: only what the update sends is then right, so send every tensor."""
        if self._sleep_level and not self._weights_awake:
            await self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    async def clear_kv_cache(self) -> None:
        llm = self._check()
        if not hasattr(llm, "reset_prefix_cache"):
            raise Unsupported("this vLLM cannot reset its prefix cache")
        if not await llm.reset_prefix_cache():
            logger.warning("vllm kept its prefix cache: requests are still running")

    async def start_profile(self, trace_dir: str) -> None:
        """vLLM writes traces into ``profile_dir`` (fixed at start); when ``trace_dir``
        differs, stop_profile moves the new trace files there."""
        llm = self._check()
        if not self._profile_dir:
            raise Unsupported("start the vllm engine with option 'profile_dir' to profile")
        self._trace_dir = os.path.abspath(trace_dir) if trace_dir else self._profile_dir
        self._profile_before = set(_walk(self._profile_dir))
        await llm.start_profile()

    async def stop_profile(self) -> None:
        llm = self._check()
        if not self._profile_dir:
            raise Unsupported("start the vllm engine with option 'profile_dir' to profile")
        await llm.stop_profile()
        dest, self._trace_dir = self._trace_dir, None
        if dest and dest != self._profile_dir:
            os.makedirs(dest, exist_ok=True)
            for path in set(_walk(self._profile_dir)) - self._profile_before:
                shutil.move(path, os.path.join(dest, os.path.relpath(path, self._profile_dir).replace(os.sep, "_")))

    def stats(self) -> dict[str, Any]:
        unfinished = self.llm.get_num_unfinished_requests() if self.llm is not None and not self.dead else 0
        return {
            "num_running": len(self._running),
            "num_unfinished": unfinished,
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "paused": self._paused,
            "dead": self.dead,
            "active_lora": self.active_lora,
        }

    # ------------------------------------------------------------------ weights

    async def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Apply named tensors in one reload, then drop the prefix cache (its blocks hold the old
        weights' KV: see ``_drop_prefix_cache``). Raises WeightsRefused (nothing loaded, the engine
        serves on) for names a trainer's wrapper prefixed (see ``refuse_wrapped_names``) or a
        fused layer sent in part (q_proj without k_proj and v_proj, gate_proj without up_proj:
        vLLM would rebuild it with the missing parts uninitialised), and EngineDead when the
        reload fails."""
        await self._through_segment(weights, commit=True)
        await self._drop_prefix_cache()

    async def load_weights_from_descriptor(self, descriptor: dict[str, Any], *, commit: bool = True) -> int:
        """Load the tensors of a segment somebody else created and still owns (never unlinked
        here). ``descriptor``: {'name': segment, 'tensors': [{'name','dtype','shape','offset',
        'nbytes'} or [name, dtype, shape, offset, nbytes], ...]}. commit=False stages a copy
        until ``commit_weights``; do that when a bucket may hold only part of a fused layer.
        Returns the number of tensors. Raises WeightsRefused (nothing loaded or staged, the
        engine serves on) for names a trainer's wrapper prefixed, or (commit=True) when what is
        staged and this segment hold a fused layer only in part (as ``commit_weights``; what
        was staged is dropped), EngineDead when the reload fails."""
        self._check()
        refuse_wrapped_names([e["name"] if isinstance(e, dict) else e[0] for e in descriptor.get("tensors") or []])
        await self._wake_weights()
        count = _counted(await self._rpc("rollfleet_load_shm", {"descriptor": descriptor, "commit": commit}))
        if commit:
            await self._drop_prefix_cache()
        return count

    async def stage_weights(self, weights: Iterable[tuple[str, Any]]) -> int:
        """Copy named tensors into vLLM's worker without applying them, as
        ``load_weights_from_descriptor(commit=False)`` does with a segment: ``commit_weights``
        applies everything staged in one reload, ``discard_weights`` drops it. For buckets of
        the transports without segments (zmq, a collective, cuda_ipc), any of which may hold
        only part of a fused layer. Returns the number of tensors. Raises WeightsRefused for
        names a trainer's wrapper prefixed, EngineDead when the copy fails."""
        return await self._through_segment(weights, commit=False)

    async def _through_segment(self, weights: Iterable[tuple[str, Any]], *, commit: bool) -> int:
        """Write named tensors into a segment of our own and have vLLM's worker load them from
        it (``commit``) or stage copies; the segment goes at once either way."""
        self._check()
        weights = list(weights)
        refuse_wrapped_names([name for name, _ in weights])
        await self._wake_weights()
        seg, entries = await asyncio.to_thread(write_segment, weights)
        try:
            return _counted(await self._rpc("rollfleet_load_shm", {"descriptor": {"name": seg, "tensors": entries},
                                                                   "commit": commit}))
        finally:
            os.unlink(os.path.join("/dev/shm", seg))

    async def commit_weights(self) -> int:
        """Apply everything staged by load_weights_from_descriptor(commit=False). Raises
        WeightsRefused, dropping it all and loading nothing, when it holds a fused layer only
        in part (q_proj without k_proj and v_proj, ...): the model is then as it was."""
        self._check()
        count = _counted(await self._rpc("rollfleet_commit", {}))
        if count:
            await self._drop_prefix_cache()
        return count

    async def discard_weights(self) -> int:
        """Drop staged tensors (the update was aborted)."""
        self._check()
        return int(await self._rpc("rollfleet_discard", {}))

    async def _drop_prefix_cache(self) -> None:
        """After new weights: vLLM's prefix cache keeps the KV blocks of earlier prompts, computed
        with the old weights, and a later prompt that starts alike would reuse them. vLLM resets
        it only while no request holds blocks (a fleet aborts its requests before an update);
        when some still run, it is reset at the first request that comes once none do."""
        llm = self.llm
        if llm is None or not hasattr(llm, "reset_prefix_cache"):
            return
        self._stale_prefix = not await llm.reset_prefix_cache()
        if self._stale_prefix:
            logger.info("vllm kept its prefix cache after a weight load (requests still run); reset later")

    async def _rpc(self, method: str, kwargs: dict[str, Any]) -> Any:
        try:
            results = await self.llm.collective_rpc(method, kwargs=kwargs)
        except Exception as exc:
            # A reload that stopped half-way leaves meta tensors behind: nothing more can run.
            self.dead = True
            raise EngineDead(f"vllm weight load failed, engine is dead: {exc}") from exc
        return results[0] if isinstance(results, list) and results else results

    # ------------------------------------------------------------------ LoRA

    async def load_lora(self, name: str, weights: Iterable[tuple[str, Any]], config: dict[str, Any]) -> None:
        """Write a PEFT adapter dir (adapter_model.safetensors + adapter_config.json) under the
        private dir and register it with vLLM. Requests use it after ``set_active_lora(name)``."""
        llm = self._check()
        if not self.options.get("enable_lora"):
            raise Unsupported("start the vllm engine with option enable_lora=True to load LoRA adapters")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = os.path.join(self._run_dir or tempfile.gettempdir(), "lora", secrets.token_hex(8))
        os.makedirs(path, exist_ok=True)
        tensors = {str(n): t.detach().to("cpu").contiguous() for n, t in weights}
        await asyncio.to_thread(save_file, tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        old = self._loras.get(name)
        lora_id = old.lora_int_id if old is not None else len(self._loras) + 1
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=old is not None)
        if not await llm.add_lora(request):
            raise EngineFailed(f"vllm refused LoRA adapter {name!r}")
        self._loras[name] = request

    def set_active_lora(self, name: str | None) -> None:
        """Adapter used by later generate calls (None: the base model). The Engine.generate
        signature has no adapter argument, so the choice is engine-wide."""
        if name is not None and name not in self._loras:
            raise ValueError(f"no LoRA adapter named {name!r} was loaded")
        self.active_lora = name


def _counted(result: Any) -> int:
    """A weight-loading method's count, or WeightsRefused where it refused the reload whole
    (a fused layer, q/k/v or gate/up, sent only in part: vLLM would rebuild it with the other
    parts uninitialised; see vllm_ext)."""
    if isinstance(result, dict) and "refused" in result:
        raise WeightsRefused(str(result["refused"]))
    return int(result)


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


_NO_SLEEP = ("vllm has no sleep mode here (it would free no memory): not on this platform, or the engine was "
             "started with enable_sleep_mode False")


def _sleep_frees_memory(llm: Any) -> bool:
    """vLLM's platform has sleep mode and this engine was started with it (its memory in the pool
    that sleep releases)."""
    return _sleep_mode_available() and bool(getattr(getattr(llm, "model_config", None), "enable_sleep_mode", False))


def _walk(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out.extend(os.path.join(d, f) for f in files if not stat.S_ISSOCK(os.stat(os.path.join(d, f)).st_mode))
    return out


def refuse_wrapped_names(names: list[str]) -> None:
    """Raise WeightsRefused when the names carry a wrapper's prefix (base.wrapper_hint: DDP's on
    every name, torch.compile's or FSDP's on any, wherever it stands): vLLM's loader fails on
    such a name half-way through a reload, which leaves the model unusable (EngineDead, a
    restart of the worker), so they are refused here, before vLLM sees any of them."""
    hint = wrapper_hint(names)
    if hint is not None:
        wrapped = [n for n in names if any(p in n for p, _ in WRAPPER_PREFIXES)] or names
        shown = ", ".join(wrapped[:3]) + (f" and {len(wrapped) - 3} more" if len(wrapped) > 3 else "")
        raise WeightsRefused(f"load_weights: unknown names: {shown}; {hint}; nothing was loaded")
