"""Packing named tensors into fixed-size byte buckets, and reading them back out.

A bucket is a run of bytes in a uint8 buffer plus one metadata entry per tensor (or per
part of a tensor): ``{'name', 'dtype', 'shape', 'offset', 'nbytes'}``, and for a part of a
tensor split across buckets also ``{'part_offset', 'total_nbytes'}``. Entries are plain
msgpack-able dicts; dtypes travel as names ("bfloat16", "float8_e4m3fn") and the bytes are
copied as they are, so every dtype arrives bit-exact and nothing is ever cast.

Offsets are aligned to 64 bytes so a whole tensor can be viewed in place with its own
dtype. A tensor larger than the room left is split at element boundaries: it fills the
current bucket and continues in the next ones.

``Packer`` pulls from the (name, tensor) iterable lazily, at most one tensor beyond the
bucket it is building, so a generator that gathers one parameter at a time stays bounded.

In place: with an ``in_place`` function (the cuda_ipc or shm channel's), a tensor the
receivers can read where it lies takes no room in the buffer; its entry says where it lies
instead (cuda_ipc: ``segment``, ``offset``, see cuda_ipc.export; shm: ``address``, see
remote.py) and its source must stay alive until the bucket is loaded. Such tensors still
count towards the bucket's size (as the room they would take in the buffer), which bounds
how much of the trainer's memory one bucket pins, and lets a bucket move them into its
buffer after all (``Bucket.unplace``) when the receivers cannot read them in place; one
larger than a bucket goes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "DTYPES",
    "dtype_name",
    "dtype_from_name",
    "Part",
    "Bucket",
    "Packer",
    "fill",
    "unpack",
    "Assembler",
    "bucket_nbytes",
    "check_whole",
    "is_in_place",
    "named_pairs",
    "check_pair",
]

ALIGN = 64

IN_PLACE_MIN_BYTES = 1 << 20
"""Smallest tensor the engines read in place (cuda_ipc, shm): below it a copy through the
buffer costs less than the view or the system call that reading in place takes."""
_END = object()


def _dtypes() -> dict[str, torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    ]  # fmt: skip
    # Older torch builds lack some of these (fp8, wide unsigned ints): keep what exists.
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: dict[str, torch.dtype] = _dtypes()
_NAMES = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype; ValueError for dtypes rollfleet does not move."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent as weights") from None


def dtype_from_name(name: Any) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}") from None


def named_pairs(named_tensors: Any) -> Iterable[Any]:
    """What an update's ``named_tensors`` stands for as (name, tensor) pairs: a Mapping (a
    ``state_dict()``) gives its items, anything else is taken as an iterable of pairs."""
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def check_pair(item: Any) -> tuple[str, torch.Tensor]:
    """One element of an update's tensors, checked: a (str, torch.Tensor) pair."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ValueError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weights must be (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                         f"{type(tensor).__name__})")
    if not name.isascii():  # the usual case, at no cost; else it must be valid UTF-8 to be sent
        try:
            name.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"weights: the name {name!r} is not valid UTF-8 text ({exc.reason})") from None
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and _is_dtensor(tensor):
        # Its bytes are one rank's shard, not the tensor the engine holds: copying it fails deep
        # in torch ("got mixed torch.Tensor and DTensor"), which does not say what to send.
        raise ValueError(f"weights: {name!r} is a DTensor (a shard of an FSDP2 or tensor-parallel model); send "
                         "whole tensors, e.g. (name, p.full_tensor()) for each parameter (full_tensor() is a "
                         "collective: every rank of the mesh must call it)")
    if tensor.is_meta:  # (torch's own error: "Cannot copy out of meta tensor; no data!")
        raise ValueError(f"weights: {name!r} is on the meta device: it has a shape and no data; send the "
                         "tensor once it is materialized (e.g. after the model's weights were loaded)")
    return name, tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has none
        return False
    return isinstance(tensor, DTensor)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_in_place(entry: dict[str, Any]) -> bool:
    """Whether a bucket entry is read where it lies (cuda_ipc ``segment``, shm ``address``)
    rather than from the bucket's buffer."""
    return "segment" in entry or "address" in entry


@dataclass(slots=True)
class Part:
    """One entry of a bucket and where its bytes come from."""

    entry: dict[str, Any]
    source: torch.Tensor
    """The tensor itself (whole entry) or its bytes as a flat uint8 tensor (split part)."""
    start: int = 0
    """Byte offset of a split part in ``source``."""


@dataclass(slots=True)
class Bucket:
    index: int
    parts: list[Part] = field(default_factory=list)
    nbytes: int = 0
    """Bytes used in the buffer: end of the last part."""
    in_place: int = 0
    """Bytes of the tensors read in place (no room in the buffer)."""
    in_place_room: int = 0
    """Room those tensors would take in the buffer (each aligned)."""
    num_taken: int = 0
    """Items pulled from the input so far, when this bucket was closed."""
    last: bool = False
    """No bucket follows."""

    @property
    def entries(self) -> list[dict[str, Any]]:
        return [p.entry for p in self.parts]

    @property
    def sources_in_place(self) -> list[torch.Tensor]:
        return [p.source for p in self.parts if is_in_place(p.entry)]

    def unplace(self) -> None:
        """Move the tensors read in place into the buffer, after the others: they fit, as
        they counted towards the bucket's size. (Before the bucket is filled or sent.)"""
        end = self.nbytes
        for part in self.parts:
            e = part.entry
            if is_in_place(e):
                for key in ("segment", "address", "handle"):
                    e.pop(key, None)
                e["offset"] = _align(end)
                end = e["offset"] + e["nbytes"]
        self.nbytes, self.in_place, self.in_place_room = end, 0, 0


@dataclass(slots=True)
class _Pending:
    name: str
    tensor: torch.Tensor
    nbytes: int
    done: int = 0
    flat: torch.Tensor | None = None
    where: dict[str, Any] | None = None
    """Set when the tensor is read in place: the entry's ``segment`` and ``offset``."""


class Packer:
    """Iterate to get Buckets of at most ``bucket_bytes`` (rounded down to ALIGN) each."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 in_place: Callable[[torch.Tensor], dict[str, Any] | None] | None = None) -> None:
        capacity = bucket_bytes - bucket_bytes % ALIGN
        if capacity < ALIGN:
            raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
        self.capacity = capacity
        self.num_taken = 0
        self.num_tensors = 0
        self.nbytes = 0
        self.nbytes_in_place = 0
        self._in_place = in_place
        self._source = iter(named_pairs(named_tensors))
        self._pending: _Pending | None = None

    def stop_in_place(self, *yielded: Bucket | None) -> None:
        """From now on every tensor goes through the buffers: the one already taken, and those
        of the ``yielded`` buckets (not sent yet) too."""
        self._in_place = None
        for bucket in yielded:
            if bucket is not None:
                self.nbytes_in_place -= bucket.in_place
                bucket.unplace()
        p = self._pending
        if p is not None and p.where is not None:
            p.where = None
            self.nbytes_in_place -= p.nbytes

    def _take(self) -> _Pending | None:
        item = next(self._source, _END)
        if item is _END:
            return None
        self.num_taken += 1
        name, tensor = check_pair(item)
        dtype_name(tensor.dtype)  # refuse unknown dtypes before any byte moves
        nbytes = tensor.numel() * tensor.element_size()
        self.num_tensors += 1
        self.nbytes += nbytes
        where = self._in_place(tensor) if self._in_place is not None else None
        if where is not None:
            self.nbytes_in_place += nbytes
        return _Pending(name, tensor, nbytes, where=where)

    def __iter__(self) -> Iterator[Bucket]:
        bucket = Bucket(0)
        self._pending = self._take()
        while self._pending is not None:
            p = self._pending
            if p.where is not None:
                if bucket.parts and _align(bucket.nbytes) + bucket.in_place_room + _align(p.nbytes) > self.capacity:
                    yield self._close(bucket, last=False)
                    bucket = Bucket(bucket.index + 1)
                    continue  # (stop_in_place may have been called meanwhile)
                entry = _entry(p, 0, p.nbytes)
                entry.update(p.where)
                bucket.parts.append(Part(entry, p.tensor))
                bucket.in_place += p.nbytes
                bucket.in_place_room += _align(p.nbytes)
                self._pending = self._take()
                continue
            start = _align(bucket.nbytes)
            room = max(0, self.capacity - start - bucket.in_place_room)
            if p.done == 0 and p.nbytes <= room:
                bucket.parts.append(Part(_entry(p, start, p.nbytes), p.tensor))
                bucket.nbytes = start + p.nbytes
                self._pending = self._take()
                continue
            if p.done == 0 and p.nbytes <= self.capacity:
                # Fits in a fresh bucket: do not split it needlessly.
                yield self._close(bucket, last=False)
                bucket = Bucket(bucket.index + 1)
                continue
            size = p.tensor.element_size()
            chunk = min(room // size * size, p.nbytes - p.done)
            if chunk == 0:
                yield self._close(bucket, last=False)
                bucket = Bucket(bucket.index + 1)
                continue
            if p.flat is None:
                p.flat = p.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            entry = _entry(p, start, chunk)
            entry["part_offset"] = p.done
            entry["total_nbytes"] = p.nbytes
            bucket.parts.append(Part(entry, p.flat, p.done))
            bucket.nbytes = start + chunk
            p.done += chunk
            if p.done == p.nbytes:
                self._pending = self._take()
            else:
                yield self._close(bucket, last=False)
                bucket = Bucket(bucket.index + 1)
        if bucket.parts:
            yield self._close(bucket, last=True)

    def _close(self, bucket: Bucket, last: bool) -> Bucket:
        bucket.num_taken = self.num_taken
        bucket.last = last
        return bucket


def _entry(p: _Pending, offset: int, nbytes: int) -> dict[str, Any]:
    return {
        "name": p.name,
        "dtype": dtype_name(p.tensor.dtype),
        "shape": list(p.tensor.shape),
        "offset": offset,
        "nbytes": nbytes,
    }


def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
    """Copy a bucket's bytes into ``buffer`` (uint8, any device). Non-contiguous and
    other-device sources are copied directly, without an intermediate contiguous copy."""
    with torch.no_grad():
        for part in bucket.parts:
            e = part.entry
            n = e["nbytes"]
            if n == 0 or is_in_place(e):
                continue
            dst = buffer[e["offset"] : e["offset"] + n]
            if "part_offset" in e:
                dst.copy_(part.source[part.start : part.start + n])
            else:
                src = part.source.detach()
                if src.is_contiguous():
                    dst.copy_(src.reshape(-1).view(torch.uint8))  # raw bytes, whatever they hold
                else:
                    dst.view(src.dtype).view(src.shape).copy_(src)


def bucket_nbytes(entries: list[dict[str, Any]]) -> int:
    """Bytes of a buffer that a bucket's entries use (what a collective must move); entries
    read in place (``is_in_place``) use none."""
    return max((e["offset"] + e["nbytes"] for e in entries if not is_in_place(e)), default=0)


def _check(entry: Any, buffer_size: int | None) -> tuple[str, torch.dtype, list[int], int, int]:
    if type(entry) is not dict:
        raise ValueError("tensor entry must be a map")
    name, shape, offset, nbytes = entry.get("name"), entry.get("shape"), entry.get("offset"), entry.get("nbytes")
    if type(name) is not str:
        raise ValueError("tensor entry: 'name' must be a string")
    dtype = dtype_from_name(entry.get("dtype"))
    if type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{name}: 'shape' must be a list of ints >= 0")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise ValueError(f"{name}: 'offset' and 'nbytes' must be ints >= 0")
    if buffer_size is not None and offset + nbytes > buffer_size:
        raise ValueError(f"{name}: bytes [{offset}, {offset + nbytes}) lie outside the {buffer_size}-byte buffer")
    return name, dtype, shape, offset, nbytes


def check_whole(entry: Any, buffer_size: int | None = None) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, offset, nbytes) of an entry for a whole tensor (not a split
    part), checked against itself (bytes match the shape, offset aligned to the dtype) and,
    when given, the buffer's size; ValueError otherwise."""
    name, dtype, shape, offset, nbytes = _check(entry, buffer_size)
    if "part_offset" in entry:
        raise ValueError(f"{name}: a split tensor part needs an Assembler")
    if nbytes != _numel(shape) * dtype.itemsize:
        raise ValueError(f"{name}: {nbytes} bytes do not match shape {shape} of {entry['dtype']}")
    if offset % dtype.itemsize:
        raise ValueError(f"{name}: offset {offset} is not aligned to {dtype.itemsize} bytes")
    return name, dtype, shape, offset, nbytes


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unpack(buffer: torch.Tensor, entries: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views of the whole tensors of a bucket, in ``buffer`` itself (no copy): they are valid
    only until the buffer is reused. Split parts need an ``Assembler``; ValueError here."""
    out = []
    for entry in entries:
        name, dtype, shape, offset, nbytes = check_whole(entry, buffer.numel())
        out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
    return out


class Assembler:
    """Turns bucket entries into complete tensors, joining the parts of split tensors.

    Whole tensors come back as views of the buffer (valid until it is reused); split
    tensors are assembled into a tensor on the buffer's device and returned when their
    last part arrives. With ``keep`` the assembly space of each split tensor is reused by
    the next update (call ``start`` at the beginning of each one): fresh memory costs a page
    fault per page, as much as a copy, so a tensor handed out is then valid only until the
    next update.
    """

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._partial: dict[str, tuple[torch.Tensor, int, dict[str, Any]]] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()

    @property
    def incomplete(self) -> list[str]:
        return sorted(self._partial)

    def start(self) -> None:
        """A new update: forget partial tensors and the space of tensors the last one lacked."""
        self._partial.clear()
        if self._used:
            self._spare = {n: t for n, t in self._spare.items() if n in self._used}
        self._used = set()

    def add(self, buffer: torch.Tensor, entries: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for entry in entries:
            if type(entry) is dict and "part_offset" in entry:
                done = self._add_part(buffer, entry)
                if done is not None:
                    out.append(done)
            else:
                out.extend(unpack(buffer, [entry]))
        return out

    def _space(self, name: str, total: int, device: torch.device) -> torch.Tensor:
        spare = self._spare.get(name)
        if spare is not None and spare.numel() == total and spare.device == device:
            return spare
        data = torch.empty(total, dtype=torch.uint8, device=device)
        if self.keep:
            self._spare[name] = data
        return data

    def _add_part(self, buffer: torch.Tensor, entry: dict[str, Any]) -> tuple[str, torch.Tensor] | None:
        name, dtype, shape, offset, nbytes = _check(entry, buffer.numel())
        part_offset, total = entry.get("part_offset"), entry.get("total_nbytes")
        itemsize = dtype.itemsize
        if type(part_offset) is not int or type(total) is not int or total != _numel(shape) * itemsize:
            raise ValueError(f"{name}: bad split part (part_offset {part_offset!r}, total_nbytes {total!r})")
        if part_offset < 0 or part_offset + nbytes > total:
            raise ValueError(f"{name}: part [{part_offset}, {part_offset + nbytes}) outside {total} bytes")
        held = self._partial.get(name)
        if held is None:
            held = (self._space(name, total, buffer.device), 0, entry)
            self._used.add(name)
        data, received, first = held
        if first["dtype"] != entry["dtype"] or first["shape"] != shape or data.numel() != total:
            raise ValueError(f"{name}: parts disagree on dtype or shape")
        data[part_offset : part_offset + nbytes].copy_(buffer[offset : offset + nbytes])
        received += nbytes
        if received < total:
            self._partial[name] = (data, received, first)
            return None
        self._partial.pop(name, None)
        return name, data.view(dtype).view(shape)

    def clear(self) -> None:
        """Forget partial tensors (an update ended or failed); kept space stays."""
        self._partial.clear()

    def release(self) -> None:
        """Forget everything, kept space included."""
        self._partial.clear()
        self._spare.clear()
        self._used = set()
