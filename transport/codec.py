"""msgpack codec for rollfleet messages.

Frame layout of one message: ``(header, *buffers)``. ``header`` is a msgpack map with
string keys; ``buffers`` are raw bytes frames (tensor data, weight buckets), referred to
from the header by index and sent with ``copy=False``. Nothing is ever pickled.

``decode`` validates everything it returns: protocol version, type tag, required fields and
field types. Bad input raises ``DecodeError`` carrying a wire error code and, where it could
be read, the correlation id, so the caller can answer with an ``error`` message.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Sequence

import msgpack

from .messages import (
    CHECKS,
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Error,
    Generate,
    Message,
    SamplingParams,
)

__all__ = ["DecodeError", "encode", "decode", "decode_header", "error_for", "DEFAULT_MAX_HEADER_BYTES"]

DEFAULT_MAX_HEADER_BYTES = 16 * 1024 * 1024

_RESERVED = ("v", "type", "id")


class DecodeError(Exception):
    """Input that is not a valid message. ``code`` is the wire error code to answer with."""

    def __init__(self, code: str, message: str, msg_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.msg_id = msg_id


# Per message class: [(field name, checker, required)], built once from the annotations.
_SPECS: dict[type[Message], list[tuple[str, Any, bool]]] = {}


def _spec(cls: type[Message]) -> list[tuple[str, Any, bool]]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = []
        for f in dataclasses.fields(cls):
            if f.name == "id":
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            annotation = f.type if isinstance(f.type, str) else typing.get_type_hints(cls)[f.name]
            spec.append((f.name, CHECKS[str(annotation)], required))
        _SPECS[cls] = spec
    return spec


def _packable(value: Any) -> Any:
    if isinstance(value, SamplingParams):
        return value.to_wire()
    return value


def encode(msg: Message) -> bytes:
    """Encode a message to its header frame (the caller sends buffers as further frames)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE.value, "id": msg.id}
    for name, _, _ in _spec(type(msg)):
        header[name] = _packable(getattr(msg, name))
    return msgpack.packb(header, use_bin_type=True)


def decode_header(raw: bytes | memoryview, max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict[str, Any]:
    """Unpack a header frame to a map, checking size, shape, version and id."""
    if len(raw) > max_bytes:
        raise DecodeError("too_large", f"header of {len(raw)} bytes exceeds {max_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError("bad_frame", f"not a msgpack value: {type(exc).__name__}") from None
    if type(header) is not dict:
        raise DecodeError("bad_message", f"header must be a map, got {type(header).__name__}")
    msg_id = header.get("id")
    if type(msg_id) is not str:
        raise DecodeError("bad_field", "field 'id' must be a string")
    if header.get("v") != PROTOCOL_VERSION:
        raise DecodeError(
            "version_mismatch", f"protocol version {header.get('v')!r} != {PROTOCOL_VERSION}", msg_id
        )
    return header


def decode(frames: Sequence[bytes | memoryview], max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Message:
    """Decode ``(header, *buffers)`` into a message; extra buffers are checked by the caller."""
    if not frames:
        raise DecodeError("bad_frame", "empty message")
    header = decode_header(frames[0], max_bytes)
    msg_id = header["id"]
    type_tag = header.get("type")
    cls = MESSAGE_CLASSES.get(type_tag) if type(type_tag) is str else None
    if cls is None:
        raise DecodeError("unknown_type", f"unknown message type {type_tag!r}", msg_id)
    values: dict[str, Any] = {"id": msg_id}
    for name, check, required in _spec(cls):
        if name not in header:
            if required:
                raise DecodeError("bad_field", f"{type_tag}: missing field '{name}'", msg_id)
            continue
        value = header[name]
        if not check(value):
            raise DecodeError(
                "bad_field", f"{type_tag}: field '{name}' has wrong type {type(value).__name__}", msg_id
            )
        values[name] = value
    if cls is Generate and "sampling" in values:
        try:
            values["sampling"] = SamplingParams.from_wire(values["sampling"])
        except (ValueError, TypeError) as exc:
            raise DecodeError("bad_field", f"generate: {exc}", msg_id) from None
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise DecodeError("bad_field", f"{type_tag}: {exc}", msg_id) from None


def error_for(exc: DecodeError) -> Error:
    """The ``error`` message answering a frame that failed to decode."""
    return Error(id=exc.msg_id or "", code=exc.code, message=str(exc))
