"""Methods rollfleet adds to vLLM's worker, so weights load inside the process that holds the model.

vLLM mixes this class into its worker class when the engine is started with
``worker_extension_cls="rollfleet.engines.vllm_ext.RollfleetWorkerExtension"``; the adapter
calls the methods by name through ``collective_rpc``. Only plain data crosses that call (a
shared-memory segment's name and a list of tensor descriptions): tensors passed as
collective_rpc arguments arrive as nested lists and break the reload.

A segment is a file in /dev/shm (POSIX shared memory on Linux). It is mapped with ``mmap``
rather than ``multiprocessing.shared_memory`` because attaching through the latter registers
the segment with Python's resource tracker, which unlinks it when this process exits, and
these segments belong to somebody else. This module never unlinks a segment.

Weights go through the model runner's ``reload_weights(weights_iterator=...)``: editing
parameters in place does not change vLLM's CPU output (its linear layers keep a packed copy).
One reload must carry every part of a fused layer (q/k/v, gate/up): a layer that receives
only some of its parts is rebuilt with the rest uninitialised (on the CPU vLLM keeps no copy
of the parts it could fill them from). Buckets that may split a layer are therefore staged
(copied) and applied together by ``rollfleet_commit``, and a reload that would still leave a
fused layer part-filled, or an integer tensor for a model of float weights (vLLM's loaders would
cast it without a word), is refused before anything is loaded: the method returns
``{"refused": why}`` instead of a count (nothing staged is kept), and the model is as it was.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["RollfleetWorkerExtension", "SHM_DIR", "tensor_views", "parse_entry", "missing_fused_parts"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def parse_entry(entry: Any) -> tuple[str, str, list[int], int, int]:
    """One tensor description, a dict {'name','dtype','shape','offset','nbytes'} or a
    5-sequence in that order, as (name, dtype, shape, offset, nbytes)."""
    if isinstance(entry, dict):
        if "part_offset" in entry:
            raise ValueError(f"tensor {entry.get('name')!r} is split across buckets; join it before loading")
        name, dtype, shape, offset, nbytes = (
            entry["name"],
            entry["dtype"],
            entry["shape"],
            entry["offset"],
            entry["nbytes"],
        )
    else:
        name, dtype, shape, offset, nbytes = entry
    return str(name), str(dtype), [int(s) for s in shape], int(offset), int(nbytes)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def tensor_views(buf: Any, entries: Sequence[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each description, viewing ``buf`` without copying."""
    size = len(buf)
    for entry in entries:
        name, dtype, shape, offset, nbytes = parse_entry(entry)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(f"tensor {name!r} [{offset}, {offset + nbytes}) lies outside the segment ({size} bytes)")
        dt = torch_dtype(dtype)
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
        yield name, raw.view(dt).reshape(shape)


def missing_fused_parts(names: Sequence[str], packed: dict[str, list[str]] | None) -> list[str]:
    """The names a reload of ``names`` also needs so that no fused layer is left part-filled:
    ``packed`` is the model's ``packed_modules_mapping`` ({"qkv_proj": ["q_proj", "k_proj",
    "v_proj"], ...}); a name whose module is one part (``...layers.0.self_attn.q_proj.weight``)
    needs its siblings (``...k_proj.weight``, ``...v_proj.weight``)."""
    part_of = {part: fused for fused, parts in (packed or {}).items() for part in parts if part != fused}
    have, missing = set(names), set()
    for name in names:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused = part_of.get(leaf)
        if fused is None:
            continue
        for part in packed[fused]:  # type: ignore[index]
            other = f"{parent}.{part}.{param}" if parent else f"{part}.{param}"
            if other not in have:
                missing.add(other)
    return sorted(missing)


def map_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write (torch.frombuffer needs a writable buffer)."""
    if "/" in name or not name:
        raise ValueError(f"bad shared-memory segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class RollfleetWorkerExtension:
    """Mixed into vLLM's worker; ``self.model_runner`` is the worker's model runner."""

    def rollfleet_load_shm(self, descriptor: dict[str, Any], commit: bool = True) -> int:
        """Load the tensors a segment holds; returns how many.

        commit=True applies them now, together with anything staged before. commit=False
        stages a copy (the owner may reuse the segment for the next bucket) until
        ``rollfleet_commit``.
        """
        mm = map_segment(str(descriptor.get("shm_name") or descriptor["name"]))
        views = weights = None
        try:
            entries = descriptor["tensors"]
            whole = [e for e in entries if not (isinstance(e, dict) and "part_offset" in e)]
            parts = [e for e in entries if isinstance(e, dict) and "part_offset" in e]
            views = list(tensor_views(mm, whole))
            count = len(views)
            staged = self._rollfleet_staged()
            if parts:
                # Tensors split across buckets are joined here (into fresh memory) as parts arrive.
                from rollfleet.weights.bucket import Assembler

                assembler = getattr(self, "_rollfleet_assembler", None)
                if assembler is None:
                    assembler = self._rollfleet_assembler = Assembler()
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                done = assembler.add(buf, parts)
                del buf
                staged.extend(done)
                count += len(done)
            if not commit:
                staged.extend((name, t.clone()) for name, t in views)
                return count
            weights = staged + views
            staged.clear()
            refused = self._rollfleet_refusal(weights)
            if refused:
                self._rollfleet_assembler = None
                return {"refused": refused}
            self._rollfleet_reload(weights)
            return count
        finally:
            views = weights = None  # the tensors export mm's buffer; drop them before closing it
            try:
                mm.close()
            except BufferError:
                # Something still views the buffer; the mapping goes when that does.
                logger.warning("shared-memory mapping still in use; left for the garbage collector")

    def rollfleet_commit(self) -> int:
        """Apply every staged tensor in one reload; returns how many."""
        staged = self._rollfleet_staged()
        weights = list(staged)
        staged.clear()
        refused = self._rollfleet_refusal(weights)
        if refused:
            self._rollfleet_assembler = None
            return {"refused": refused}
        if weights:
            self._rollfleet_reload(weights)
        return len(weights)

    def rollfleet_discard(self) -> int:
        """Drop staged tensors (an aborted update); returns how many were dropped."""
        staged = self._rollfleet_staged()
        count = len(staged)
        staged.clear()
        self._rollfleet_assembler = None
        return count

    def rollfleet_num_staged(self) -> int:
        return len(self._rollfleet_staged())

    def _rollfleet_staged(self) -> list[tuple[str, torch.Tensor]]:
        staged = getattr(self, "_rollfleet_staged_weights", None)
        if staged is None:
            staged = []
            self._rollfleet_staged_weights = staged
        return staged

    def _rollfleet_refusal(self, weights: list[tuple[str, torch.Tensor]]) -> str | None:
        """Why a reload of these tensors would corrupt the model (None: it would not)."""
        model = self._rollfleet_model()
        # vLLM's loaders copy an integer tensor into a float parameter without a word (a cast):
        # refused where every parameter is a float (a quantized model's integer ones are not).
        ints = [f"{name} ({t.dtype})" for name, t in weights if not t.is_floating_point()]
        if ints and model is not None and all(p.is_floating_point() for p in model.parameters()):
            shown = ", ".join(ints[:3]) + (f" and {len(ints) - 3} more" if len(ints) > 3 else "")
            return (f"load_weights: integer or bool tensors where the model's weights are floats: {shown}; "
                    "nothing was loaded")
        names = [name for name, _ in weights]
        missing = missing_fused_parts(names, getattr(model, "packed_modules_mapping", None))
        if not missing:
            return None
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return (f"load_weights: vLLM fuses these tensors with others, which must come in the same update: "
                f"missing {shown}; nothing was loaded")

    def _rollfleet_model(self) -> Any:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)

    def _rollfleet_tied_names(self) -> dict[str, list[str]]:
        """{name: the other names of the same parameter} for tied parameters (lm_head.weight and
        model.embed_tokens.weight under tie_word_embeddings), found once, before any reload."""
        tied = getattr(self, "_rollfleet_tied", None)
        if tied is None:
            groups: dict[int, list[str]] = {}
            model = self._rollfleet_model()
            if model is not None:
                for name, param in model.named_parameters(remove_duplicate=False):
                    groups.setdefault(id(param), []).append(name.replace(".base_layer.", "."))
            tied = {n: [m for m in names if m != n] for names in groups.values() if len(set(names)) > 1 for n in names}
            self._rollfleet_tied = tied
        return tied

    def _rollfleet_reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # A trainer's named_parameters() gives a tied parameter once (model.embed_tokens.weight
        # without lm_head.weight); vLLM's reload rebuilds each layer from what it is sent, and
        # on the CPU lm_head then kept its old packed copy: each tied name gets the tensor too.
        tied = self._rollfleet_tied_names()
        if tied:
            names = {name for name, _ in weights}
            extra = []
            for name, tensor in weights:
                for other in tied.get(name, ()):
                    if other not in names:
                        names.add(other)
                        extra.append((other, tensor))
            weights = weights + extra
        # The worker's own reload_weights sets the current vLLM config around the runner's.
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
        reload(weights_iterator=weights)
