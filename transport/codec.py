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
import threading
import typing
from types import MemberDescriptorType
from typing import Any, Callable, Sequence

import msgpack

from .messages import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    WIRE_TYPES,
    Batch,
    Error,
    Message,
    SamplingParams,
)

__all__ = ["DecodeError", "encode", "encode_values", "build", "builder", "decode", "decode_header", "error_for", "batch_frame", "unbatch",
           "DEFAULT_MAX_HEADER_BYTES"]

DEFAULT_MAX_HEADER_BYTES = 16 * 1024 * 1024

_RESERVED = ("v", "type", "id")
_MISSING: Any = object()
_NONE = type(None)
_new = object.__new__


class DecodeError(Exception):
    """Input that is not a valid message. ``code`` is the wire error code to answer with;
    ``type_tag`` the message's type when it is a known one whose fields are at fault."""

    def __init__(self, code: str, message: str, msg_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.msg_id = msg_id
        self.type_tag: str | None = None


class _Spec:
    """What the codec needs of one message class, worked out once from its annotations."""

    __slots__ = ("cls", "tag", "nested", "nested_at", "fields", "names", "setters", "encode_msg", "encode_values",
                 "decode_fast", "build")

    def __init__(self, cls: type[Message]):
        hints: dict[str, Any] | None = None
        names: list[str] = []
        self.fields: list[tuple[str, frozenset[type], Any, bool]] = []
        self.nested: list[str] = []  # SamplingParams fields, sent as their wire map
        for f in dataclasses.fields(cls):
            if f.name == "id":
                continue
            if isinstance(f.type, str):
                annotation = f.type
            else:
                hints = hints or typing.get_type_hints(cls)
                annotation = str(hints[f.name])
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            types, contents = WIRE_TYPES[annotation]
            self.fields.append((f.name, types, contents, required))
            if annotation == "SamplingParams":
                self.nested.append(f.name)
            names.append(f.name)
        self.cls = cls
        self.tag = cls.TYPE.value
        self.names = tuple(names)
        self.nested_at = tuple(names.index(name) for name in self.nested)
        # The fast decoder reads an absent field as None: right only where a field that takes
        # None has None for its default (else the field-by-field path fills the default).
        absent_ok = all(_NONE not in types or default is None
                        for (_, types, _, _), default in zip(self.fields, _defaults(cls)))
        # A frozen dataclass sets its fields with object.__setattr__, that is through these
        # slot descriptors; called directly they build a message in half the time __init__
        # takes. Only for checked values, and classes without __post_init__.
        slots = [getattr(cls, name, None) for name in ("id", *names)]
        self.setters: tuple[Any, ...] = ()
        if all(isinstance(d, MemberDescriptorType) for d in slots) and not hasattr(cls, "__post_init__"):
            self.setters = tuple(d.__set__ for d in slots)
        # Key order on the wire: v, type, id, then the fields in class order (golden vectors).
        self.encode_msg, self.encode_values = _make_encoders(self)
        self.decode_fast = _make_decoder(self) if self.setters and absent_ok else None
        self.build = _make_builder(self) if self.setters else None


# Straight-line code per message class, written once at first use (as dataclasses writes
# __init__): a dict literal to pack, named checks and setter calls, instead of zips and
# loops over field tuples. Twice as fast as the generic code on a small message, and these
# run once per message on every hop.
def _make_encoders(spec: _Spec) -> tuple[Callable[..., bytes], Callable[..., bytes]]:
    names = ("id", *spec.names)
    args = [f"a{i}" for i in range(len(names))]
    ns: dict[str, Any] = {"_packer": _packer, "_SP": SamplingParams}
    items = [f"'v': {PROTOCOL_VERSION!r}", f"'type': {spec.tag!r}"]
    for name, arg in zip(names, args):
        if name in spec.nested:
            items.append(f"{name!r}: {arg}.to_wire() if isinstance({arg}, _SP) else {arg}")
        else:
            items.append(f"{name!r}: {arg}")
    body = "_packer()({" + ", ".join(items) + "})"
    src = (f"def encode_values({', '.join(args)}):\n    return {body}\n"
           f"def encode_msg(m):\n    return encode_values({', '.join(f'm.{n}' for n in names)})\n")
    exec(src, ns)
    return ns["encode_msg"], ns["encode_values"]


def _make_decoder(spec: _Spec) -> Callable[[dict[str, Any], str], Message | None]:
    """``fast(header, msg_id)``: the message when every field has a type a valid header may
    have (an absent one reads as None), else None (the caller then goes field by field)."""
    ns: dict[str, Any] = {"_nested": _nested_value, "_tag": spec.tag}
    lines = ["def fast(h, msg_id):"]
    checks = []
    for i, (name, types, contents, _) in enumerate(spec.fields):
        lines.append(f"    f{i} = h.get({name!r})")
        if len(types) == 1:
            ns[f"T{i}"] = next(iter(types))
            checks.append(f"type(f{i}) is T{i}")
        else:
            ns[f"T{i}"] = types
            checks.append(f"type(f{i}) in T{i}")
        if contents is not None:
            ns[f"C{i}"] = contents
            checks.append(f"(not f{i} or C{i}(f{i}))")
    if checks:
        lines.append(f"    if not ({' and '.join(checks)}):\n        return None")
    for i in spec.nested_at:
        lines.append(f"    if f{i} is not None:\n        f{i} = _nested(f{i}, _tag, msg_id)")
    lines += _making(spec, ns, ["msg_id", *(f"f{i}" for i in range(len(spec.fields)))])
    exec("\n".join(lines) + "\n", ns)
    return ns["fast"]


def _make_builder(spec: _Spec) -> Callable[..., Message]:
    """``build(id, *fields)``: the message made by its slot setters, nothing checked."""
    ns: dict[str, Any] = {}
    args = [f"a{i}" for i in range(len(spec.setters))]
    lines = [f"def build({', '.join(args)}):", *_making(spec, ns, args)]
    exec("\n".join(lines) + "\n", ns)
    return ns["build"]


def _making(spec: _Spec, ns: dict[str, Any], values: list[str]) -> list[str]:
    """The lines that make and return the message from ``values`` (expressions, id first),
    each set through its slot's setter; what they name goes into ``ns``."""
    ns.update(_new=_new, _cls=spec.cls)
    lines = ["    m = _new(_cls)"]
    for i, (setter, value) in enumerate(zip(spec.setters, values, strict=True)):
        ns[f"S{i}"] = setter
        lines.append(f"    S{i}(m, {value})")
    return lines + ["    return m"]


def _nested_value(value: Any, type_tag: str, msg_id: str) -> SamplingParams:
    try:
        return SamplingParams.from_wire(value)
    except (ValueError, TypeError) as exc:
        raise DecodeError("bad_field", f"{type_tag}: {exc}", msg_id) from None


def _defaults(cls: type[Message]) -> list[Any]:
    return [f.default for f in dataclasses.fields(cls) if f.name != "id"]


_SPECS: dict[type[Message], _Spec] = {}


def _spec(cls: type[Message]) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _Spec(cls)
    return spec


# Packers keep a buffer between calls; one per thread, as a Packer is not thread-safe.
_local = threading.local()


def _packer() -> Callable[[Any], bytes]:
    pack = _local.__dict__.get("pack")
    if pack is None:
        pack = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack


def encode(msg: Message) -> bytes:
    """Encode a message to its header frame (the caller sends buffers as further frames)."""
    return (_SPECS.get(type(msg)) or _spec(type(msg))).encode_msg(msg)


def encode_values(cls: type[Message], *values: Any) -> bytes:
    """``encode(cls(...))`` without making the message: ``values`` are its id and then every
    field, in class order. For hot paths that hold the values already."""
    return (_SPECS.get(cls) or _spec(cls)).encode_values(*values)


def build(cls: type[Message], *values: Any) -> Message:
    """``cls(...)`` from its id and then every field, in class order, in half the time:
    for hot paths whose values are right by construction (nothing is checked)."""
    spec = _SPECS.get(cls) or _spec(cls)
    if spec.build is None or len(values) != len(spec.setters):
        return cls(**dict(zip(("id", *spec.names), values)))
    return spec.build(*values)


def builder(cls: type[Message]) -> Callable[..., Message]:
    """``build`` for one class, looked up once: for a hot path that makes many of them."""
    spec = _SPECS.get(cls) or _spec(cls)
    if spec.build is None:
        return lambda *values: build(cls, *values)
    return spec.build


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """An ext value (no field of the protocol holds one), kept as read whatever its type code,
    so that one in a field the receiver does not know is skipped with it: msgpack's ExtType
    refuses the codes msgpack reserves (-128..-2), which would fail the frame for a field
    nobody reads. Made without that check, it packs again as the same ext. Timestamps (-1)
    are msgpack's own, checked by it."""
    return tuple.__new__(msgpack.ExtType, (code, data))


def decode_header(raw: bytes | memoryview, max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict[str, Any]:
    """Unpack a header frame to a map, checking size, shape, version and id. A batch some of
    whose messages cannot be unpacked still decodes: each of those is the DecodeError it would
    get in a frame of its own, in its place among the others (``unbatch`` hands it on)."""
    if len(raw) > max_bytes:
        raise DecodeError("too_large", f"header of {len(raw)} bytes exceeds {max_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_ext)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        header = _unpack_apart(raw, exc)
    try:
        _check_header(header)
    except DecodeError as exc:
        if type(header) is dict and header.get("type") == "batch":
            exc.msg_id = ""  # a batch's own id is ignored, even in an error about it
        raise
    return header


def _failure(raw: bytes | memoryview, exc: Exception) -> DecodeError:
    """What a frame that msgpack could not unpack is answered with."""
    if type(exc) is ValueError and "map key" in str(exc):
        # Keys other than str or bin are refused while unpacking (a map of int keys would let a
        # sender pick hash collisions); answer with the message's id when it can be read.
        return DecodeError("bad_field", "a map has a key that is not a str", _read_id(raw))
    return DecodeError("bad_frame", f"not a msgpack value: {type(exc).__name__}")


# A batch of more messages than this is not taken apart when it fails to unpack (the frontend
# refuses a client's batch of more anyway, PROTOCOL.md 7): cutting a message out costs about a
# microsecond, and a bad frame must not hold the loop for long.
MAX_BATCH_APART = 1024


def _array_length(view: memoryview, at: int) -> int | None:
    """The length of the msgpack array whose header starts at ``at``; None if none does."""
    head = view[at]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(view[at + 1:at + 3], "big")
    if head == 0xDD:
        return int.from_bytes(view[at + 1:at + 5], "big")
    return None


def _unpack_apart(raw: bytes | memoryview, exc: Exception) -> dict[str, Any]:
    """The map of a frame that failed to unpack whole (``exc``), when what failed lies inside
    the messages of a batch: each message is cut out of the frame without being built and
    unpacked alone, so that one bad message is answered on its own. Raises the frame's
    DecodeError when the fault is elsewhere, and ``bad_frame`` when a message cannot be cut out
    (nested deeper than msgpack's limit on its own, or cut short): its end is then unknown, and
    so are the messages after it, whatever fault came before.

    Only bad frames come here; a valid one never pays for this."""
    if _id_and_type(raw)[1] != "batch":
        raise _failure(raw, exc) from None
    view = memoryview(raw)
    header: dict[str, Any] = {}
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_ext, max_buffer_size=max(len(view), 1))
        unpacker.feed(view)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if type(key) is not str and type(key) is not bytes:  # as strict_map_key refuses it
                raise DecodeError("bad_field", "a map has a key that is not a str", "") from None
            count = _array_length(view, unpacker.tell()) if key == "messages" else None
            if count is not None:
                if count > MAX_BATCH_APART:
                    raise _failure(raw, exc) from None
                unpacker.read_array_header()
                try:
                    header[key] = [_cut_out(view, unpacker) for _ in range(count)]
                except Exception:  # a message's end cannot be found, nor those after it (PROTOCOL 4.3)
                    raise DecodeError("bad_frame", "a message of the batch cannot be told apart from the next "
                                      "(nested too deep, or cut short by the end of the frame)") from None
            else:
                header[key] = unpacker.unpack()
    except DecodeError:
        raise
    except Exception:
        raise _failure(raw, exc) from None
    if unpacker.tell() != len(view):  # bytes after the batch's map: the batch's own fault (PROTOCOL 4.3)
        raise DecodeError("bad_frame", "not a msgpack value: bytes after the batch's map")
    return header


def _cut_out(view: memoryview, unpacker: msgpack.Unpacker) -> Any:
    """The next message of a batch that ``unpacker`` reads, unpacked alone, or the DecodeError
    it gets. Raises when its end cannot be found."""
    start = unpacker.tell()
    unpacker.skip()  # builds nothing: neither str (UTF-8) nor map keys are looked at
    item = view[start:unpacker.tell()]
    try:
        return msgpack.unpackb(item, raw=False, strict_map_key=True, ext_hook=_ext)
    except Exception as exc:
        return _failure(item, exc)


def _read_id(raw: bytes | memoryview) -> str | None:
    """The id to answer a frame that failed to unpack whole with: its top-level ``id``, "" for
    a batch (whose own id is ignored), None when it cannot be read."""
    msg_id, type_tag = _id_and_type(raw)
    if type_tag == "batch":
        return ""
    return msg_id if type(msg_id) is str else None


def _id_and_type(raw: bytes | memoryview) -> tuple[Any, Any]:
    """The top-level ``id`` and ``type`` of a map frame, reading the keys and skipping every
    other value unbuilt (no map is made, whatever its keys); (None, None) when its top level
    cannot be read through before its type is known, as it might then be a batch."""
    msg_id = type_tag = None
    typed = False  # the type's value was reached
    view = memoryview(raw)
    try:
        unpacker = msgpack.Unpacker(raw=False, ext_hook=_ext, max_buffer_size=max(len(view), 1))
        unpacker.feed(view)
        for _ in range(unpacker.read_map_header()):
            if _is_str(view[unpacker.tell()]):
                key = unpacker.unpack()
            else:  # skipped unbuilt: a map or array key may hold keys msgpack refuses to build
                unpacker.skip()
                key = None
            count = _array_length(view, unpacker.tell()) if key == "messages" else None
            if key == "id":
                msg_id = unpacker.unpack()
            elif key == "type":
                typed = True
                if _is_str(view[unpacker.tell()]):
                    type_tag = unpacker.unpack()
                else:  # no type at all (a map of int keys, say): skipped unbuilt, no batch
                    unpacker.skip()
            elif count is not None and count <= MAX_BATCH_APART:
                unpacker.read_array_header()
                for _ in range(count):  # one by one: each message may nest as deep as a frame
                    unpacker.skip()
            else:
                unpacker.skip()
    except Exception:
        # Read part-way. What was read stands once the type's value was reached (a map that
        # names its type twice, which PROTOCOL 3 forbids, may be taken for the first one):
        # a frame whose type is, or may be, "batch" is answered without an id.
        if not typed:
            return None, None
    return msg_id, type_tag


def _is_str(head: int) -> bool:
    """Whether a msgpack value starting with the byte ``head`` is a str."""
    return 0xA0 <= head <= 0xBF or 0xD9 <= head <= 0xDB


def _check_header(header: Any) -> None:
    if type(header) is not dict:
        if type(header) is DecodeError:  # a message of a batch that could not be unpacked
            raise header
        raise DecodeError("bad_message", f"header must be a map, got {type(header).__name__}")
    msg_id = header.get("id")
    if list(map(type, header)).count(str) != len(header):  # a bin key names no field
        raise DecodeError("bad_field", "a map has a key that is not a str", msg_id if type(msg_id) is str else None)
    if type(msg_id) is not str:
        raise DecodeError("bad_field", "field 'id' must be a string")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 and 1.0 == 1 are not versions
        raise DecodeError(
            "version_mismatch", f"protocol version {header.get('v')!r} != {PROTOCOL_VERSION}", msg_id
        )


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_HEADER_BYTES,
           accept: frozenset[str] | None = None) -> Message:
    """Decode ``(header, *buffers)`` into a message; extra buffers are checked by the caller.

    A frame is anything with the buffer protocol: bytes, memoryview, zmq.Frame. ``accept``: the
    type tags the receiver takes (None: all); another known type is ``unknown_type`` before its
    fields are read.
    """
    if not frames:
        raise DecodeError("bad_frame", "empty message")
    return _from_header(decode_header(frames[0], max_bytes), accept)


def _from_header(header: dict[str, Any], accept: frozenset[str] | None = None) -> Message:
    """The message a checked header map (see ``_check_header``) describes."""
    msg_id = header["id"]
    type_tag = header.get("type")
    cls = MESSAGE_CLASSES.get(type_tag) if type(type_tag) is str else None
    if cls is None:
        raise DecodeError("unknown_type", f"unknown message type {type_tag!r}", msg_id)
    if accept is not None and type_tag not in accept:
        raise DecodeError("unknown_type", f"this socket does not take {type_tag!r} messages",
                          "" if cls is Batch else msg_id)
    try:  # (free in Python 3.11 when nothing is raised)
        spec = _SPECS.get(cls) or _spec(cls)
        if spec.decode_fast is not None:
            msg = spec.decode_fast(header, msg_id)
            if msg is not None:
                return msg
        # Anything else goes the field-by-field way, which names the field at fault.
        values: dict[str, Any] = {"id": msg_id}
        answer_id = "" if cls is Batch else msg_id  # a batch's own id is ignored, even in an error about it
        for name, types, contents, required in spec.fields:
            value = header.get(name, _MISSING)
            if value is _MISSING:
                if required:
                    raise DecodeError("bad_field", f"{type_tag}: missing field '{name}'", answer_id)
                continue
            # An empty container (or None) has no contents to check.
            if type(value) not in types:
                raise DecodeError(
                    "bad_field", f"{type_tag}: field '{name}' has wrong type {type(value).__name__}", answer_id
                )
            if contents is not None and value and not contents(value):
                raise DecodeError("bad_field", f"{type_tag}: field '{name}' holds an element of the wrong type",
                                  answer_id)
            values[name] = value
        return _build(spec, values, type_tag, msg_id)
    except DecodeError as exc:
        exc.type_tag = type_tag
        raise


def _build(spec: _Spec, values: dict[str, Any], type_tag: str, msg_id: str) -> Message:
    try:
        for name in spec.nested:
            if name in values:
                values[name] = SamplingParams.from_wire(values[name])
        return spec.cls(**values)
    except (ValueError, TypeError) as exc:
        raise DecodeError("bad_field", f"{type_tag}: {exc}", msg_id) from None


# ------------------------------------------------------------------------------ batches
# A batch frame is the map {"v": 1, "type": "batch", "id": "", "messages": [...]}, built from
# messages already encoded: the map's fixed start, an array header, then their bytes as they
# are (msgpack concatenates). No message is packed twice.
_BATCH_START = b"".join(msgpack.packb(x) for x in ("v", PROTOCOL_VERSION, "type", "batch", "id", "", "messages"))
_BATCH_START = b"\x84" + _BATCH_START  # a fixmap of 4 pairs


def batch_frame(encoded: Sequence[bytes]) -> bytes:
    """One frame carrying several encoded messages (``encode`` output, in order) as a batch."""
    n = len(encoded)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return b"".join((_BATCH_START, head, *encoded))


def unbatch(batch: Batch, accept: frozenset[str] | None = None) -> list[Message | DecodeError]:
    """The messages of a batch, in order, each decoded and checked on its own: one bad message
    is a DecodeError in its place and costs the others nothing. ``accept`` as for ``decode``."""
    out: list[Message | DecodeError] = []
    for item in batch.messages:
        try:
            _check_header(item)
            if item.get("type") == "batch":
                raise DecodeError("bad_message", "a batch may not hold a batch", item["id"])
            out.append(_from_header(item, accept))
        except DecodeError as exc:
            out.append(exc)
    return out


def error_for(exc: DecodeError) -> Error:
    """The ``error`` message answering a frame that failed to decode."""
    return Error(id=exc.msg_id or "", code=exc.code, message=str(exc))
