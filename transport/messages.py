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
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

__all__ = [
    "PROTOCOL_VERSION",
    "MsgType",
    "FinishReason",
    "SamplingParams",
    "Message",
    "Generate",
    "Abort",
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
    "MESSAGE_CLASSES",
    "CONTROL_OPS",
]

PROTOCOL_VERSION = 1


class MsgType(str, enum.Enum):
    """The ``type`` tag of every message."""

    # client -> supervisor, and supervisor -> worker
    GENERATE = "generate"
    ABORT = "abort"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one request; the ``sampling`` map of ``generate``."""

    max_tokens: int = 16
    """Most tokens to generate (>= 0)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) means no limit."""
    seed: int | None = None
    """Per-request seed for reproducible sampling."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these tokens (the token is included)."""
    ignore_eos: bool = False
    """Keep generating past the engine's EOS token."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1, got {self.top_k}")

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
        if not isinstance(data, dict):
            raise ValueError("sampling must be a map")
        values: dict[str, Any] = {}
        for name, check in _SAMPLING_CHECKS.items():
            if name in data:
                value = data[name]
                if not check(value):
                    raise ValueError(f"sampling.{name}: wrong type {type(value).__name__}")
                values[name] = value
        return cls(**values)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A deep copy with some fields changed; the original is never touched."""
        # The only mutable field is the stop list; copying it makes this a deep copy.
        values = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        values["stop_token_ids"] = list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)


# --------------------------------------------------------------------------- field checks
# Each annotation used by a wire field maps to a predicate. msgpack gives ints for whole
# floats sent by some clients, so float fields accept ints; bools are never ints here.


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_float(v: Any) -> bool:
    return type(v) in (int, float)


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_bool(v: Any) -> bool:
    return type(v) is bool


def _list_of(pred: Any) -> Any:
    return lambda v: type(v) is list and all(pred(x) for x in v)


def _optional(pred: Any) -> Any:
    return lambda v: v is None or pred(v)


def _is_map(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str for k in v)


CHECKS: dict[str, Any] = {
    "str": _is_str,
    "int": _is_int,
    "float": _is_float,
    "bool": _is_bool,
    "str | None": _optional(_is_str),
    "int | None": _optional(_is_int),
    "bool | None": _optional(_is_bool),
    "list[int]": _list_of(_is_int),
    "list[str]": _list_of(_is_str),
    "list[float] | None": _optional(_list_of(_is_float)),
    "dict[str, Any]": _is_map,
    "dict[str, float]": lambda v: _is_map(v) and all(_is_float(x) for x in v.values()),
    "list[dict[str, Any]]": _list_of(_is_map),
    "SamplingParams": _is_map,
}

_SAMPLING_CHECKS = {
    "max_tokens": _is_int,
    "temperature": _is_float,
    "top_p": _is_float,
    "top_k": _is_int,
    "seed": _optional(_is_int),
    "stop_token_ids": _list_of(_is_int),
    "ignore_eos": _is_bool,
    "logprobs": _is_bool,
}


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


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
    """How often the request was interrupted and resumed."""
    worker: str = ""
    """Worker that produced the last segment."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: 'queue' (until dispatch), 'first_token', 'total'."""


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


MESSAGE_CLASSES: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (
        Generate,
        Abort,
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
    )
}
