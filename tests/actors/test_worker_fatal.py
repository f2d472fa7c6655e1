"""A worker whose engine dies, in this process: it tells the supervisor once, then answers
nothing more, and the requests the engine died under get no error (they resume elsewhere).
An engine dying in a weight update is fatal too, though the receiver wraps its EngineDead."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq

from rollfleet.actors.worker import EngineWorker
from rollfleet.engines.base import Engine, EngineDead, EngineOutput
from rollfleet.transport import codec
from rollfleet.transport.aio import LoopSocket
from rollfleet.transport.messages import (
    Batch, Chunk, Error, Generate, Reply, SamplingParams, Stats, WeightsBegin, WeightsBucket, WorkerExit,
)

from ..helpers import wait_for

_ADDRS = itertools.count()


class Peer:
    """The supervisor's end of a real socket pair: a ROUTER, with the worker's DEALER connected
    to it and driven by the worker's own LoopSocket. What the worker sends is decoded here,
    batches opened, in the order it came."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        addr = f"inproc://worker-fatal-{next(_ADDRS)}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(addr)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, b"w0-0")
        self.dealer.connect(addr)
        self.messages: list = []

    def send(self, msg, *buffers: bytes) -> None:
        self.router.send_multipart([b"w0-0", codec.encode(msg), *buffers])

    def read(self) -> list:
        while self.router.poll(0):
            _, *frames = self.router.recv_multipart()
            msg = codec.decode(frames)
            self.messages.extend(codec.unbatch(msg) if isinstance(msg, Batch) else [msg])
        return self.messages

    async def settled(self) -> list:
        """Everything the worker sent until now: what it posts leaves at the end of a loop turn."""
        await asyncio.sleep(0.05)
        return self.read()

    def of(self, kind) -> list:
        return [m for m in self.read() if isinstance(m, kind)]


@pytest.fixture
def make_worker():
    """make_worker(engine) -> (worker, peer): an EngineWorker with ``engine`` on a real socket."""
    made = []

    def make(engine: Engine) -> tuple[EngineWorker, Peer]:
        worker = EngineWorker({"worker_id": "w0-0", "engine": engine.name, "heartbeat_interval_s": 0.01,
                               "report_interval_s": 60})
        worker.engine = engine
        peer = Peer()
        worker._sock = LoopSocket(peer.dealer, worker._on_frames, copy=False)
        made.append((worker, peer))
        return worker, peer

    yield make
    for worker, peer in made:
        worker._sock.close()
        peer.router.close(linger=0)
        peer.ctx.term()


class DyingEngine(Engine):
    """Makes one token per request, then waits until ``die`` fails every request at once, as
    the torch engine does when its thread dies."""

    name = "dying"

    def __init__(self) -> None:
        super().__init__()
        self.dead = False
        self.started = 0
        self._died = asyncio.Event()

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_ids, params):
        yield EngineOutput([7])
        self.started += 1
        await self._died.wait()
        raise EngineDead("engine thread died: RuntimeError('boom')")

    async def abort(self, request_id: str) -> None:
        return None

    def die(self) -> None:
        self.dead = True
        self._died.set()


async def test_requests_the_engine_died_under_get_no_error_and_the_worker_exits_once(make_worker):
    engine = DyingEngine()
    worker, peer = make_worker(engine)
    for rid in ("a", "b"):
        peer.send(Generate(id=rid, prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=10)))
    assert await wait_for(lambda: engine.started == 2)
    engine.die()
    assert await wait_for(lambda: not worker._tasks)
    sent = await peer.settled()
    assert peer.of(Error) == []  # both resume elsewhere once the worker is gone
    (exit_msg,) = peer.of(WorkerExit)
    assert exit_msg.fatal and "boom" in exit_msg.reason
    assert worker._stop.is_set() and worker._exit_code == 4
    # Their tokens were reported before the exit (the report interval had not come), so a
    # resume goes on after them.
    assert {c.id: c.token_ids for c in peer.of(Chunk)} == {"a": [7], "b": [7]}
    assert sent.index(exit_msg) > max(sent.index(c) for c in peer.of(Chunk))


async def test_an_exiting_worker_answers_nothing(make_worker):
    engine = DyingEngine()
    worker, peer = make_worker(engine)
    peer.send(Stats(id="s0"))  # answered while it serves
    assert await wait_for(lambda: [m.id for m in peer.of(Reply)] == ["s0"])
    engine.dead = True
    await worker._fatal("engine died")
    before = len(await peer.settled())
    peer.send(Stats(id="s1"))
    peer.send(Generate(id="late", prompt_ids=[1], sampling=SamplingParams()))
    assert len(await peer.settled()) == before and not worker._tasks
    await worker._fatal("a second reason")
    await peer.settled()
    assert len(peer.of(WorkerExit)) == 1 and peer.of(WorkerExit)[0].reason == "engine died"


async def test_an_engine_that_died_with_nothing_running_is_found_at_a_heartbeat(make_worker):
    engine = DyingEngine()
    worker, peer = make_worker(engine)
    heartbeats = asyncio.create_task(worker._heartbeat_loop())
    await asyncio.sleep(0.05)
    assert not worker._stop.is_set()
    engine.dead = True
    await asyncio.wait_for(heartbeats, 5)
    await peer.settled()
    (exit_msg,) = peer.of(WorkerExit)
    assert exit_msg.fatal and "dying engine is dead" in exit_msg.reason
    assert worker._stop.is_set() and worker._exit_code == 4


class ReloadKills(Engine):
    """Loses its model in every weight load, and says so only by raising EngineDead (no
    ``dead`` flag)."""

    name = "reload-kills"

    async def start(self) -> None:
        return None

    def generate(self, request_id, prompt_ids, params):  # pragma: no cover - not used here
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    def capabilities(self) -> set[str]:
        return {"load_weights"}

    async def load_weights(self, weights) -> None:
        list(weights)
        raise EngineDead("reload failed half-way: the model is lost")


async def test_an_engine_that_dies_loading_weights_makes_the_worker_exit_and_the_error_says_why(make_worker):
    worker, peer = make_worker(ReloadKills())
    peer.send(WeightsBegin(id="u1.begin", version=1, transport="zmq", bucket_bytes=16, buffers=[{"size": 16}]))
    assert await wait_for(lambda: [m.id for m in peer.of(Reply)] == ["u1.begin"])
    entry = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
    peer.send(WeightsBucket(id="u1.b0", index=0, buffer=0, tensors=[entry]), bytes(16))
    assert await wait_for(lambda: peer.of(WorkerExit))
    await peer.settled()
    (error,) = peer.of(Error)
    assert error.id == "u1.b0" and error.code == "weights_failed"
    assert "EngineDead: reload failed half-way" in error.message  # the receiver's EngineFailed names it
    (exit_msg,) = peer.of(WorkerExit)
    assert exit_msg.fatal and "engine died loading weights" in exit_msg.reason
    assert worker._stop.is_set() and worker._exit_code == 4
    worker._receiver.close()
