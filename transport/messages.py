"""Every message that crosses a rollfleet socket, in one module.

Each message is a frozen dataclass. On the wire it is one msgpack map with string keys:
``{"v": PROTOCOL_VERSION, "type": <MsgType value>, "id": <correlation id>, ...fields}``,
optionally followed by raw binary frames (see ``transport.codec``). Field order in a class
is the order in PROTOCOL.md. New fields go at the end with a default and a comment, so older
peers keep decoding (unknown keys are ignored by the decoder).

``SamplingParams`` is the nested ``sampling`` map of a ``generate`` message.
"""

from __future__ import annotations

import enum
import itertools
import numbers
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, ClassVar

from ..fielddoc import document_fields

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_LEASE_S",
    "MsgType",
    "FinishReason",
    "SamplingParams",
    "Message",
    "Generate",
    "Abort",
    "AbortAll",
    "Stats",
    "Control",
    "Chunk",
    "Result",
    "Reply",
    "Error",
    "Register",
    "Heartbeat",
    "WorkerExit",
    "Shutdown",
    "WeightsBegin",
    "WeightsBucket",
    "WeightsEnd",
    "Batch",
    "Hello",
    "MESSAGE_CLASSES",
    "CONTROL_OPS",
    "CLIENT_TYPES",
    "check_control_args",
]

PROTOCOL_VERSION = 1

MAX_LEASE_S = 86_400.0
"""The longest lease a client may ask for in its ``hello`` (a day)."""


class MsgType(str, enum.Enum):
    """The ``type`` tag of every message."""

    # client -> supervisor, and supervisor -> worker
    GENERATE = "generate"
    ABORT = "abort"
    # client -> supervisor only: abort every request of this client (of one session)
    ABORT_ALL = "abort_all"
    STATS = "stats"
    CONTROL = "control"
    # answers (supervisor -> client, worker -> supervisor)
    CHUNK = "chunk"
    RESULT = "result"
    REPLY = "reply"
    ERROR = "error"
    # worker -> supervisor
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    WORKER_EXIT = "worker_exit"  # sentinel: the worker is about to die, and why
    # supervisor -> worker
    SHUTDOWN = "shutdown"
    WEIGHTS_BEGIN = "weights_begin"
    WEIGHTS_BUCKET = "weights_bucket"
    WEIGHTS_END = "weights_end"
    # worker <-> supervisor either way, client -> supervisor, and supervisor -> client after a
    # hello: several messages in one frame
    BATCH = "batch"
    # client -> supervisor, optional: what the client can take
    HELLO = "hello"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token (or EOS) was produced
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by a caller, or interrupted and not resumed


# Operations of a ``control`` message. Engines that lack one answer with error "unsupported".
CONTROL_OPS = (
    "sleep",
    "wake_up",
    "clear_kv_cache",
    "start_profile",
    "stop_profile",
    "pause",
    "resume",
)

# What a client may send the supervisor's frontend; any other type is answered unknown_type.
CLIENT_TYPES = frozenset({"generate", "abort", "abort_all", "stats", "control", "hello", "batch"})

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_TWO_63 = float(1 << 63)  # compared exactly: an int below it fits in 64 bits, and NaN and inf fail


def check_control_args(op: str, args: dict[str, Any]) -> None:
    """Raise ValueError when ``args`` are not what ``op`` takes (PROTOCOL.md 4.1)."""
    if op == "sleep":
        level = args.get("level", 1)
        if type(level) is not int or level not in (1, 2):
            raise ValueError(f"sleep: args.level must be the int 1 or 2, got {level!r}")
    elif op == "start_profile":
        trace_dir = args.get("trace_dir")
        if type(trace_dir) is not str or not trace_dir:
            raise ValueError("start_profile needs args.trace_dir (a directory path)")


@document_fields
@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one request; the ``sampling`` map of ``generate``."""

    max_tokens: int = 16
    """Most tokens to generate (>= 0). A model's engine also stops where prompt and output
    fill its context (finish_reason 'length' then too)."""
    temperature: float = 1.0
    """Below 1e-5 (0 included) means greedy, as in vLLM."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) means no limit."""
    seed: int | None = None
    """Per-request seed for reproducible sampling. A resumed request goes on with a seed derived
    from this one and the number of tokens it had (``actors.supervisor.resume_seed``), so after the
    point where it was interrupted it differs from an uninterrupted run (PROTOCOL.md 4.1). Without
    one, each worker of a fleet draws from a source of its own."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these tokens (the token is included)."""
    ignore_eos: bool = False
    """Keep generating past the engine's EOS token."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""

    def __post_init__(self) -> None:
        if type(self.stop_token_ids) is tuple:
            _set(self, "stop_token_ids", list(self.stop_token_ids))
        # The wire's types (PROTOCOL.md 4.1): what a decoded map has already been checked for.
        # Other numbers (numpy's scalars above all) become the plain int or float they stand for,
        # so that what is sent is plain msgpack.
        for name, types, contents in _SAMPLING_SPEC:
            value = getattr(self, name)
            if type(value) not in types:
                value = _plain(value, types)
                if type(value) not in types:
                    hint = " (True returns each chosen token's log-probability, as vLLM's logprobs=0)" \
                        if name == "logprobs" else ""
                    raise TypeError(f"{name} must be {_TYPE_NAMES[name]}, got {value!r}{hint}")
                _set(self, name, value)
            if contents is not None and value and not contents(value):
                value = [_plain(x, _INT) for x in value]
                if not contents(value):
                    raise TypeError(f"{name} must be {_TYPE_NAMES[name]}, got {getattr(self, name)!r}")
                _set(self, name, value)
        self._check_ranges()

    def _check_ranges(self) -> None:
        if not 0 <= self.max_tokens <= _INT64_MAX:
            raise ValueError(f"max_tokens must be >= 0 (and fit in 64 bits), got {self.max_tokens}")
        if not 0 <= self.temperature < _TWO_63:
            raise ValueError(f"temperature must be a number >= 0 and below 2**63, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= _INT64_MAX:
            raise ValueError(f"top_k must be >= -1 (and fit in 64 bits), got {self.top_k}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        stop = self.stop_token_ids
        if stop and not (_INT64_MIN <= min(stop) and max(stop) <= _INT64_MAX):
            raise ValueError("stop_token_ids must fit in signed 64-bit integers")

    def to_wire(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "SamplingParams":
        """Validate a ``sampling`` map; raises ValueError on bad input. Unknown keys are ignored."""
        if type(data) is not dict:
            raise ValueError("sampling must be a map")
        # Fast path, as in codec.decode: every value has a type a valid map may have.
        found = tuple(map(data.get, _SAMPLING_FIELDS))
        if tuple(map(type, found)) in _SAMPLING_KINDS and (not found[_STOP] or _all_ints(found[_STOP])):
            if cls is not SamplingParams:
                return cls(**dict(zip(_SAMPLING_FIELDS, found)))
            params = _new(SamplingParams)
            for set_field, value in zip(_SAMPLING_SETTERS, found):
                set_field(params, value)
            params._check_ranges()  # the types were checked above
            return params
        values: dict[str, Any] = {}
        for name, types, contents in _SAMPLING_SPEC:
            value = data.get(name, _MISSING)
            if value is _MISSING:
                continue
            if type(value) not in types:
                raise ValueError(f"sampling.{name}: wrong type {type(value).__name__}")
            if contents is not None and value and not contents(value):
                raise ValueError(f"sampling.{name}: holds an element of the wrong type")
            values[name] = value
        return cls(**values)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A deep copy with some fields changed; the original is never touched."""
        if not changes:
            # The hot case (a private copy per request). self was validated when it was
            # built, so the copy skips __init__; the stop list is the only mutable field.
            copy = _new(SamplingParams)
            for set_field, value in zip(_SAMPLING_SETTERS, _sampling_values(self)):
                set_field(copy, value)
            _set(copy, "stop_token_ids", list(self.stop_token_ids))
            return copy
        values = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        values["stop_token_ids"] = list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)


_new = object.__new__
_set = object.__setattr__  # how a frozen dataclass sets its own fields


# --------------------------------------------------------------------------- field checks
# Each annotation used by a wire field maps to (the exact types accepted, a check of the
# contents or None). msgpack gives ints for whole floats sent by some clients, so float
# fields accept ints; bools are never ints here. Exact type tests (not isinstance) keep
# bools out of ints, and are what a decoder of untrusted input can afford per element:
# list(map(type, v)) runs in C, ~6 ns a token.

_MISSING: Any = object()
_NONE = type(None)
_INT = frozenset({int})


def _plain(value: Any, types: frozenset[type]) -> Any:
    """``value`` as the plain int (or float) that ``types`` take, when it is a number of another
    type, e.g. numpy's int64 or float32; else ``value`` itself. A bool is never taken for a
    number (numpy's bool is no numbers.Integral either)."""
    if type(value) is bool:
        return value
    if int in types and isinstance(value, numbers.Integral):
        return int(value)
    if float in types and isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_ints(values: list[Any]) -> list[int] | None:
    """``values`` as plain ints when each is an integer of some type (numpy's int64, say: a
    list built from an array's elements), else None. For the error path of checks that take
    plain ints only."""
    out = [_plain(v, _INT) for v in values]
    return out if _all_ints(out) else None


def _all_ints(v: list[Any]) -> bool:
    return list(map(type, v)).count(int) == len(v)


def _all_strs(v: list[Any]) -> bool:
    return list(map(type, v)).count(str) == len(v)


def _all_floats(v: list[Any] | None) -> bool:
    if v is None:
        return True
    kinds = list(map(type, v))
    return kinds.count(float) + kinds.count(int) == len(v)


def _str_keys(v: dict[Any, Any]) -> bool:
    return list(map(type, v)).count(str) == len(v)


def _float_values(v: dict[Any, Any]) -> bool:
    if len(v) > 8:
        return _str_keys(v) and _all_floats(list(v.values()))
    # A result's timings (a few keys, on every result): a plain loop takes a fifth of the
    # time the two lists above do at this size.
    for key, value in v.items():
        if type(key) is not str or (type(value) is not float and type(value) is not int):
            return False
    return True


def _all_maps(v: list[Any]) -> bool:
    return all(type(x) is dict and _str_keys(x) for x in v)


WIRE_TYPES: dict[str, tuple[frozenset[type], Any]] = {
    "str": (frozenset({str}), None),
    "int": (frozenset({int}), None),
    "float": (frozenset({int, float}), None),
    "bool": (frozenset({bool}), None),
    "str | None": (frozenset({str, _NONE}), None),
    "int | None": (frozenset({int, _NONE}), None),
    "bool | None": (frozenset({bool, _NONE}), None),
    "float | None": (frozenset({int, float, _NONE}), None),
    "list[int]": (frozenset({list}), _all_ints),
    "list[str]": (frozenset({list}), _all_strs),
    "list[float] | None": (frozenset({list, _NONE}), _all_floats),
    "dict[str, Any]": (frozenset({dict}), _str_keys),
    "dict[str, float]": (frozenset({dict}), _float_values),
    "list[dict[str, Any]]": (frozenset({list}), _all_maps),
    "list[Any]": (frozenset({list}), None),  # contents checked by whoever unpacks them
    "SamplingParams": (frozenset({dict}), _str_keys),
}


def _predicate(types: frozenset[type], contents: Any) -> Any:
    return lambda v: type(v) in types and (contents is None or contents(v))


# The same checks as one predicate per annotation.
CHECKS: dict[str, Any] = {annotation: _predicate(*spec) for annotation, spec in WIRE_TYPES.items()}

_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
_sampling_values = attrgetter(*_SAMPLING_FIELDS)
# What object.__setattr__ calls for each field, minus the lookup (see codec._Spec.setters).
_SAMPLING_SETTERS = tuple(getattr(SamplingParams, name).__set__ for name in _SAMPLING_FIELDS)
_SAMPLING_SPEC = tuple((f.name, *WIRE_TYPES[str(f.type)]) for f in fields(SamplingParams))
# Every tuple of value types a valid sampling map can have; an absent key reads as None,
# which only seed accepts, and its default is None.
_SAMPLING_KINDS = frozenset(itertools.product(*(types for _, types, _ in _SAMPLING_SPEC)))
_STOP = _SAMPLING_FIELDS.index("stop_token_ids")
_TYPE_PHRASES = {"int": "an int", "float": "a number", "int | None": "an int or None", "list[int]": "a list of ints",
                 "bool": "a bool"}
_TYPE_NAMES = {f.name: _TYPE_PHRASES[str(f.type)] for f in fields(SamplingParams)}  # for SamplingParams' errors


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of all wire messages: a type tag (class attribute) and a correlation id."""

    TYPE: ClassVar[MsgType]
    id: str
    """Correlation id. Answers carry the id of the message they answer."""


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate(Message):
    """Start a generation. ``id`` is the request id; all answers carry it."""

    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    prompt_ids: list[int]
    """Prompt token ids (token-in)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    """Send a ``chunk`` for new tokens as they are produced, before the ``result``."""
    session_id: str | None = None
    """Requests with the same session id go to the same worker when possible."""
    resume: bool | None = None
    """Resume after interruption (weight update, dead worker); None: the fleet's default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """Abort the request ``request_id``; answered by ``reply`` (or error unknown_request)."""

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortAll(Message):
    """Abort every request this client has in flight, or only those of ``session_id``;
    answered by ``reply`` with ``data: {"request_ids": [the ids aborted]}``."""

    TYPE: ClassVar[MsgType] = MsgType.ABORT_ALL
    session_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats(Message):
    """Ask for fleet (or, to a worker, engine) statistics; answered by ``reply``."""

    TYPE: ClassVar[MsgType] = MsgType.STATS


@dataclass(frozen=True, slots=True, kw_only=True)
class Control(Message):
    """A fleet-wide operation, one of CONTROL_OPS; answered by ``reply``."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    op: str
    args: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk(Message):
    """New tokens of a running request (only the tokens since the previous chunk)."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    token_ids: list[int]
    logprobs: list[float] | None = None
    weight_version: int = 0
    """Version of the weights that produced these tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Result(Message):
    """The end of a request: every generated token, not only those after the last chunk."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    token_ids: list[int]
    finish_reason: str
    """One of FinishReason."""
    logprobs: list[float] | None = None
    weight_versions: list[int] = field(default_factory=list)
    """Weight version of each segment, in order (one entry per attempt that produced tokens)."""
    num_preemptions: int = 0
    """How often the request was interrupted (weight update, dead worker) to be resumed."""
    worker: str = ""
    """Worker that produced the last segment."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: 'queue' (until dispatch), 'first_token', 'total', 'worker' (on workers, summed
    over attempts). From a worker: 'worker' alone, this attempt's."""
    # Added after the others: a peer that does not know it decodes the rest as before.
    weight_version_starts: list[int] = field(default_factory=list)
    """Index in ``token_ids`` of each segment's first token, beside ``weight_versions``: segment i
    made ``token_ids[starts[i]:starts[i + 1]]``. From the supervisor; a worker leaves it empty."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply(Message):
    """Success answer to abort, stats, control, register and weights messages."""

    TYPE: ClassVar[MsgType] = MsgType.REPLY
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """Failure answer; ``code`` is one of the codes in PROTOCOL.md ('bad_message', ...)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str
    message: str = ""
    request_id: str | None = None


# --------------------------------------------------------------------------- worker <-> supervisor


@dataclass(frozen=True, slots=True, kw_only=True)
class Register(Message):
    """First message of a worker; the supervisor answers ``reply``."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    worker_id: str
    pid: int
    engine: str
    device: str = "cpu"
    capabilities: list[str] = field(default_factory=list)
    weight_version: int = 0
    host: str = ""
    batch: bool = False
    """The worker accepts ``batch`` messages (the supervisor then packs what it sends)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    num_inflight: int = 0
    num_tokens: int = 0
    """Tokens generated since the worker started."""
    weight_version: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerExit(Message):
    """Sent by a worker just before it exits on its own (fatal engine error, shutdown)."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_EXIT
    reason: str
    fatal: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsBegin(Message):
    """Open a weight update. Buffers are shared once here, not per bucket."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_BEGIN
    version: int
    transport: str
    """'shm', 'cuda_ipc' or 'collective'."""
    bucket_bytes: int
    buffers: list[dict[str, Any]] = field(default_factory=list)
    """Per buffer, transport specific: shm {'name', 'size'}; cuda_ipc {'handle': bytes, ...}."""
    options: dict[str, Any] = field(default_factory=dict)
    """Transport/engine extras, e.g. collective rendezvous, lora adapter name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsBucket(Message):
    """One filled bucket: which buffer holds it and where each tensor lies in it."""

    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_BUCKET
    index: int
    buffer: int
    tensors: list[dict[str, Any]]
    """Each {'name', 'dtype', 'shape', 'offset', 'nbytes'} plus, for a tensor split across
    buckets, {'part_offset', 'total_nbytes'}."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsEnd(Message):
    TYPE: ClassVar[MsgType] = MsgType.WEIGHTS_END
    version: int
    commit: bool = True
    """False aborts the update: the engine drops what it received."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch(Message):
    """Several messages for one peer in one frame, in the order they were sent: between a
    worker and its supervisor, from a client to the supervisor, and back to a client that said
    ``hello`` with ``batch``. ``codec.unbatch`` checks and decodes each one on its own."""

    TYPE: ClassVar[MsgType] = MsgType.BATCH
    messages: list[Any]
    """Each a complete message map (its own ``v``, ``type`` and ``id``); never a batch, never
    a message with buffer frames. In a decoded batch, a message that msgpack could not unpack
    is the ``codec.DecodeError`` it got, which ``codec.unbatch`` gives in its place."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """A client says what it can take (optional, any time); answered by ``reply`` with
    ``data: {"batch": bool, "max_message_bytes": int}`` (whether batches now flow both ways on
    this connection, and the largest header the supervisor reads from a client), plus
    ``"lease_s"`` when it asked for a lease."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    batch: bool = False
    """The client decodes ``batch`` messages: the supervisor may then pack what it sends it."""
    lease_s: float | None = None
    """Hold a lease: when the supervisor hears nothing from this client for this long, it
    aborts the client's requests (a client process that was killed leaves none running).
    None: no lease (and a lease held before is dropped)."""

    def __post_init__(self) -> None:
        lease = self.lease_s
        if lease is not None and (type(lease) not in (int, float) or not 0 < lease <= MAX_LEASE_S):
            raise ValueError(f"field 'lease_s' must be a number of seconds > 0 and <= {MAX_LEASE_S:g}, or None; "
                             f"got {lease!r}")


MESSAGE_CLASSES: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (
        Generate,
        Abort,
        AbortAll,
        Stats,
        Control,
        Chunk,
        Result,
        Reply,
        Error,
        Register,
        Heartbeat,
        WorkerExit,
        Shutdown,
        WeightsBegin,
        WeightsBucket,
        WeightsEnd,
        Batch,
        Hello,
    )
}
