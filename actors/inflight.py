"""The table of requests in flight: what the fleet remembers about each one.

Only state: no I/O, no policy. An entry lives from submission until its result, abort,
error or cancellation, and is then removed; nothing else holds requests.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import DuplicateRequest
from ..transport.messages import SamplingParams

__all__ = ["State", "Entry", "InflightTable"]


class State(str, enum.Enum):
    PENDING = "pending"  # waiting for a worker
    RUNNING = "running"  # on a worker
    INTERRUPTED = "interrupted"  # asked to stop for a weight update; will be resumed
    ABORTING = "aborting"  # a caller asked to abort; waiting for the worker's final answer


@dataclass(slots=True, eq=False)
class Entry:
    origin: str
    """Who asked: 'local' for in-process clients, else the frontend peer's identity (hex)."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    """A private copy: the caller's object is never touched."""
    sink: Callable[[Any], None]
    """Receives Chunk / Result / Error messages for the caller."""
    stream: bool = False
    session_id: str | None = None
    resume: bool = True
    state: State = State.PENDING
    inner_id: str | None = None
    worker_id: str | None = None
    last_worker: str = ""
    """The worker it was last dispatched to, kept after it leaves it: the result's ``worker``."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    segment_start: int = 0
    """len(token_ids) when the current attempt was dispatched."""
    versions: list[int] = field(default_factory=list)
    """Weight version of each segment that produced tokens."""
    version_starts: list[int] = field(default_factory=list)
    """Beside ``versions``: the index in token_ids of each such segment's first token."""
    segment_version: int | None = None
    num_preemptions: int = 0
    num_attempts: int = 0
    t_created: float = field(default_factory=time.monotonic)
    t_dispatched: float | None = None
    t_first_token: float | None = None
    t_worker: float | None = None
    """Seconds on workers, summed over attempts (the 'worker' timing their results report)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.origin, self.request_id)

    def begin_segment(self, version: int) -> None:
        """The current attempt made its first tokens, under weights ``version``."""
        self.segment_version = version
        self.versions.append(version)
        self.version_starts.append(self.segment_start)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.token_ids)


class InflightTable:
    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Entry] = {}
        self._by_inner: dict[str, Entry] = {}
        self._next_inner = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._by_key.values()))

    def add(self, entry: Entry) -> None:
        if entry.key in self._by_key:
            raise DuplicateRequest(f"request {entry.request_id!r} is already in flight", request_id=entry.request_id)
        self._by_key[entry.key] = entry

    def get(self, origin: str, request_id: str) -> Entry | None:
        return self._by_key.get((origin, request_id))

    def by_inner(self, inner_id: str) -> Entry | None:
        return self._by_inner.get(inner_id)

    def bind(self, entry: Entry, worker_id: str) -> str:
        """Record that ``entry`` now runs on ``worker_id``; returns its new inner id."""
        self.unbind(entry)
        self._next_inner += 1
        inner = f"{self._next_inner:x}"
        entry.inner_id = inner
        entry.worker_id = entry.last_worker = worker_id
        entry.state = State.RUNNING
        entry.segment_start = len(entry.token_ids)
        entry.segment_version = None
        entry.num_attempts += 1
        self._by_inner[inner] = entry
        return inner

    def unbind(self, entry: Entry) -> None:
        if entry.inner_id is not None:
            self._by_inner.pop(entry.inner_id, None)
        entry.inner_id = None
        entry.worker_id = None

    def remove(self, entry: Entry) -> None:
        self.unbind(entry)
        self._by_key.pop(entry.key, None)

    def on_worker(self, worker_id: str) -> list[Entry]:
        return [e for e in self._by_key.values() if e.worker_id == worker_id]

    @property
    def num_inner(self) -> int:
        return len(self._by_inner)
