"""The supervisor's view of one worker: its process, state, and pending calls."""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import FleetClosed, RequestTimeout, WorkerLost, from_code
from ..transport.aio import wait_within
from ..transport.messages import Message
from .process import WorkerProcess

__all__ = ["WorkerState", "WorkerHandle", "RemoteProcess"]

_call_ids = itertools.count(1)


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"


class WorkerHandle:
    """One incarnation of a worker. A restart creates a new handle with a new id."""

    def __init__(self, *, index: int, generation: int, device: str, proc: "WorkerProcess | RemoteProcess",
                 send: Callable[["WorkerHandle", Message], None]):
        self.index = index
        self.generation = generation
        self.worker_id = proc.worker_id
        self.identity = self.worker_id.encode()
        self.device = device
        self.proc = proc
        self.state = WorkerState.STARTING
        self.registered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.engine = ""
        self.batched = False  # the worker accepts batch messages (its register said so)
        self.host = ""
        self.pid = proc.pid
        self.capabilities: list[str] = []
        self.weight_version = 0
        # Holds the weights it started with, as no update (nor catch-up) has reached it: what it
        # serves then is not the fleet's, whatever the version numbers say (an update may be
        # labelled 0 too).
        self.initial_weights = True
        self.num_tokens = 0
        self.last_heartbeat = time.monotonic()
        self.last_error = ""  # why this incarnation failed or is being ended; "" while it is fine
        self.earlier_error = ""  # why the slot's worker before it ended: shown until this one has its own
        self.started_at = time.monotonic()
        self.ended_at = 0.0  # when it was found dead
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._send = send
        self._last_descendant_scan = 0.0

    @property
    def alive(self) -> bool:
        return self.state is not WorkerState.DEAD

    # ---- request/reply calls (control, stats, weights). Implements weights' WorkerLink.
    def next_call_id(self) -> str:
        return f"c{next(_call_ids)}"

    async def call(self, msg: Message, timeout: float | None = None, buffers: list[Any] | None = None) -> dict[str, Any]:
        """Send ``msg`` and wait for its reply's data. Raises the wire error as a RolloutError,
        WorkerLost if the worker dies first, RequestTimeout after ``timeout`` seconds."""
        if not self.alive:
            raise WorkerLost(f"worker {self.worker_id} is dead")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut
        try:
            if buffers:
                self._send(self, msg, buffers)
            else:
                self._send(self, msg)
            return await wait_within(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"worker {self.worker_id} did not answer {msg.TYPE.value} in {timeout}s") from None
        finally:
            self._pending.pop(msg.id, None)

    def resolve(self, call_id: str, data: dict[str, Any] | None, error: tuple[str, str] | None = None) -> bool:
        fut = self._pending.get(call_id)
        if fut is None or fut.done():
            return False
        if error is not None:
            fut.set_exception(from_code(error[0], f"worker {self.worker_id}: {error[1]}"))
        else:
            fut.set_result(data or {})
        return True

    def fail_calls(self, reason: str, *, closing: bool = False) -> None:
        """End the calls waiting for this worker: WorkerLost, or FleetClosed when ``closing``
        (the fleet shuts down)."""
        for fut in self._pending.values():
            if not fut.done():
                if closing:
                    fut.set_exception(FleetClosed(f"the fleet shut down before worker {self.worker_id} answered"))
                else:
                    fut.set_exception(WorkerLost(f"worker {self.worker_id} died: {reason}"))
        self._pending.clear()

    def on_heartbeat(self, weight_version: int, num_tokens: int) -> None:
        now = time.monotonic()
        self.last_heartbeat = now
        self.weight_version = weight_version
        self.num_tokens = num_tokens
        if now - self._last_descendant_scan > 5.0:
            self._last_descendant_scan = now
            self.proc.remember_descendants()

    def describe(self, num_inflight: int, restarts: int) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "index": self.index,
            "state": self.state.value,
            "pid": self.pid,
            "device": self.device,
            "host": self.host,
            "engine": self.engine,
            "capabilities": list(self.capabilities),
            "num_inflight": num_inflight,
            "num_tokens": self.num_tokens,
            "weight_version": self.weight_version,
            "restarts": restarts,
            "last_error": self.last_error or self.earlier_error,
        }


class RemoteProcess:
    """The process of a worker on another node, as far as the supervisor can know it.

    It stands where a WorkerProcess stands for a local worker, with the same methods, but
    the supervisor neither spawned it nor can signal it: its node agent does both (and
    restarts it). ``terminate`` and ``kill`` ask it to stop with a Shutdown message and
    count it gone at once; it is also gone when it reports WorkerExit, misses heartbeats or
    becomes unreachable (``lost``). The monitor loop then takes the usual death path.
    """

    remote = True
    pidfd = None  # nothing to watch: the monitor loop polls alive()

    def __init__(self, worker_id: str, pid: int, host: str, stop: Callable[[], None]):
        self.worker_id = worker_id
        self.pid = pid
        self.host = host
        self._stop = stop
        self._gone = False

    def alive(self) -> bool:
        return not self._gone

    @property
    def returncode(self) -> int | None:
        return None  # exit codes stay on the worker's node

    def lost(self) -> None:
        self._gone = True

    def terminate(self) -> None:
        if not self._gone:
            self._gone = True
            try:
                self._stop()
            except Exception:  # unreachable already: nothing more to do from here
                pass

    def kill(self) -> None:
        self.terminate()

    def close(self) -> None:
        pass

    def remember_descendants(self) -> None:
        pass

    def stderr_tail(self) -> str:
        return f"(the output of remote worker {self.worker_id} is in its node agent's log on {self.host})"


class RestartTracker:
    """Restart times of one worker slot, for the sliding-window policy."""

    def __init__(self) -> None:
        self.times: deque[float] = deque()
        self.total = 0

    def recent(self, window_s: float) -> int:
        now = time.monotonic()
        while self.times and now - self.times[0] > window_s:
            self.times.popleft()
        return len(self.times)

    def record(self) -> None:
        self.times.append(time.monotonic())
        self.total += 1
