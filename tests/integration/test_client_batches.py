"""Batches on the client socket: a client that says ``hello`` with ``batch`` gets its answers
several to a frame; any client may send its requests so; one that never says ``hello`` never
receives a batch. Real supervisor, real echo workers, raw ZeroMQ clients written from
PROTOCOL.md, and RemoteClient."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor, SyncClient
from rollfleet.actors import supervisor as supervisor_module
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import DuplicateRequest, FleetClosed, RequestTimeout
from rollfleet.transport import codec
from rollfleet.transport.messages import Control, Generate, Hello, SamplingParams

from ..helpers import stand_in_fleet, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")


def fleet(num_workers: int = 2) -> Supervisor:
    return Supervisor(FleetConfig(engine="echo", num_workers=num_workers, engine_options={"tokens_per_s": 0}))


def generate(rid: str, prompt: list[int], max_tokens: int) -> bytes:
    return codec.encode(Generate(id=rid, prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens)))


class RawClient:
    """A DEALER that keeps every frame it receives, decoded by plain msgpack."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.frames: list[dict] = []  # every frame's map, as received

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    async def send(self, frame: bytes) -> None:
        await self.sock.send(frame)

    async def answers(self, want: set[str], timeout: float = 20.0) -> dict[str, dict]:
        """Receive until a final answer (result or error) came for every id in ``want``; batches
        are opened. Returns id -> that final answer."""
        got: dict[str, dict] = {}
        while not want <= got.keys():
            frame = msgpack.unpackb(await asyncio.wait_for(self.sock.recv(), timeout), raw=False)
            self.frames.append(frame)
            for msg in frame["messages"] if frame["type"] == "batch" else [frame]:
                if msg["type"] in ("result", "error", "reply"):
                    got[msg["id"]] = msg
        return got


async def test_hello_with_batch_packs_answers_and_takes_batches_one_bad_message_costs_the_others_nothing():
    async with fleet() as sup:
        raw = RawClient(sup.frontend_address)
        try:
            await raw.send(codec.encode(Hello(id="h1", batch=True)))
            hello = (await raw.answers({"h1"}))["h1"]
            assert hello["type"] == "reply" and hello["data"] == {"batch": True, "max_message_bytes": 64 << 20}

            # 200 requests in 4 batch frames; one bad request and one nested batch among them.
            ids = [f"r{i}" for i in range(200)]
            items = [generate(rid, [i % 50 + 1, 7], 3) for i, rid in enumerate(ids)]
            items[17] = msgpack.packb({"v": 1, "type": "generate", "id": "bad", "prompt_ids": "x"})
            items[90] = msgpack.packb({"v": 1, "type": "batch", "id": "nested", "messages": []})
            for start in range(0, 100, 50):  # as rollfleet writes a batch: its messages' bytes spliced in
                await raw.send(codec.batch_frame(items[start:start + 50]))
            for start in range(100, 200, 50):  # as any msgpack library writes the map of PROTOCOL.md 4.3
                messages = [msgpack.unpackb(item, raw=False) for item in items[start:start + 50]]
                await raw.send(msgpack.packb({"v": 1, "type": "batch", "id": "", "messages": messages}))
            good = [rid for i, rid in enumerate(ids) if i not in (17, 90)]
            got = await raw.answers(set(good) | {"bad", "nested"})
            for i, rid in enumerate(ids):
                if i in (17, 90):
                    continue
                assert got[rid]["type"] == "result", got[rid]
                assert got[rid]["token_ids"] == echo_tokens([i % 50 + 1, 7], 3)
            assert got["bad"]["type"] == "error" and got["bad"]["code"] == "bad_field"
            assert got["nested"]["type"] == "error" and got["nested"]["code"] == "bad_message"
            # 199 answers and a hello reply came in fewer frames than messages: some were batches
            assert any(f["type"] == "batch" for f in raw.frames)
            assert len(raw.frames) < 200
            assert sup.counters["completed"] == 198

            # more than a client's batch may hold: refused whole, and nothing in it runs
            big = [generate(f"big{i}", [1], 1) for i in range(1025)]
            await raw.send(codec.batch_frame(big))
            refused = (await raw.answers({""}))[""]
            assert refused["type"] == "error" and refused["code"] == "too_large"
            await raw.send(codec.batch_frame(big[:1024]))  # the most it may hold
            got = await raw.answers({f"big{i}" for i in range(1024)})
            assert all(got[f"big{i}"]["type"] == "result" for i in range(1024))
            assert sup.counters["completed"] == 198 + 1024
        finally:
            raw.close()


async def test_a_client_that_never_said_hello_never_receives_a_batch_but_may_send_them():
    async with fleet() as sup:
        raw = RawClient(sup.frontend_address)
        other = RawClient(sup.frontend_address)
        try:
            await other.send(codec.encode(Hello(id="h", batch=True)))  # another client's hello is not this one's
            await other.answers({"h"})
            ids = [f"p{i}" for i in range(300)]
            for i, rid in enumerate(ids[:150]):
                await raw.send(generate(rid, [i + 1], 2))
            # its batches are taken all the same (as from a client the fleet forgot after a restart)
            for start in range(150, 300, 50):
                await raw.send(codec.batch_frame([generate(rid, [i + 1], 2)
                                                  for i, rid in enumerate(ids) if start <= i < start + 50]))
            got = await raw.answers(set(ids))
            assert all(got[rid]["token_ids"] == echo_tokens([i + 1], 2) for i, rid in enumerate(ids))
            assert [f["type"] for f in raw.frames] == ["result"] * 300
            raw.frames.clear()

            # a hello of the wrong shape is bad input like any other
            await raw.send(msgpack.packb({"v": 1, "type": "hello", "id": "hx", "batch": "yes"}))
            bad = (await raw.answers({"hx"}))["hx"]
            assert bad["type"] == "error" and bad["code"] == "bad_field"
            # hello without batch: the answer says no, and answers still come one to a frame
            await raw.send(codec.encode(Hello(id="h0", batch=False)))
            assert (await raw.answers({"h0"}))["h0"]["data"] == {"batch": False, "max_message_bytes": 64 << 20}
            await raw.send(codec.batch_frame([generate(f"after{i}", [i + 1], 1) for i in range(40)]))
            await raw.answers({f"after{i}" for i in range(40)})
            assert {f["type"] for f in raw.frames} == {"error", "reply", "result"}
            assert sup.counters["completed"] == 340
        finally:
            raw.close()
            other.close()



async def test_the_fleet_remembers_a_bounded_number_of_batch_clients_the_oldest_gets_single_frames(monkeypatch):
    monkeypatch.setattr(supervisor_module, "MAX_BATCH_CLIENTS", 2)  # 65,536 in use: too many sockets for a test
    async with fleet() as sup:
        clients = [RawClient(sup.frontend_address) for _ in range(3)]
        try:
            for k, raw in enumerate(clients):  # in this order: the first is the oldest
                await raw.send(codec.encode(Hello(id=f"h{k}", batch=True)))
                assert (await raw.answers({f"h{k}"}))[f"h{k}"]["data"] == {"batch": True, "max_message_bytes": 64 << 20}
            assert len(sup._batch_clients) == 2
            for k, raw in enumerate(clients):
                raw.frames.clear()
                ids = [f"c{k}-{i}" for i in range(200)]
                for start in range(0, 200, 50):
                    await raw.send(codec.batch_frame([generate(rid, [i + 1], 1) for i, rid in enumerate(ids)
                                                      if start <= i < start + 50]))
                got = await raw.answers(set(ids))
                assert all(got[rid]["token_ids"] == echo_tokens([i + 1], 1) for i, rid in enumerate(ids))
            assert [f["type"] for f in clients[0].frames] == ["result"] * 200  # forgotten: one to a frame
            assert all(any(f["type"] == "batch" for f in raw.frames) for raw in clients[1:])
        finally:
            for raw in clients:
                raw.close()

async def test_remote_client_says_hello_then_floods_streams_and_calls_over_batches():
    async with fleet() as sup:
        async with RemoteClient(sup.frontend_address) as client:
            assert await client.generate("first", [3], SamplingParams(max_tokens=2)) is not None
            assert client._batch is True  # the fleet answered its hello: batches both ways
            results = await asyncio.gather(*(client.generate(f"f{i}", [i + 1, 2], SamplingParams(max_tokens=4))
                                             for i in range(500)))
            assert [r.token_ids for r in results] == [echo_tokens([i + 1, 2], 4) for i in range(500)]
            streamed = [c async for c in client.stream("s", [9], SamplingParams(max_tokens=5))]
            assert streamed[-1].token_ids == echo_tokens([9], 5)
            assert (await client.stats())["num_workers"] == 2
        assert sup.counters["completed"] == 502


async def test_a_batch_client_that_goes_away_costs_the_fleet_nothing():
    async with Supervisor(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 200})) as sup:
        raw = RawClient(sup.frontend_address)
        await raw.send(codec.encode(Hello(id="h", batch=True)))
        await raw.answers({"h"})
        await raw.send(codec.batch_frame([generate(f"gone{i}", [i + 1], 4) for i in range(40)]))
        # in the fleet before the socket closes (closing at once drops what it has not sent)
        assert await wait_for(lambda: len(sup.table) + sup.counters["completed"] == 40, 10)
        raw.close()  # its answers have nowhere to go: EHOSTUNREACH on the supervisor's side
        deadline = asyncio.get_running_loop().time() + 20
        while sup.counters["completed"] < 40 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert sup.counters["completed"] == 40
        async with RemoteClient(sup.frontend_address) as client:
            result = await client.generate("after", [5], SamplingParams(max_tokens=3))
            assert result.token_ids == echo_tokens([5], 3)


async def test_remote_client_talks_to_a_fleet_without_hello_one_message_to_a_frame():
    """The other side is a stand-in for a fleet from before ``hello``: a ROUTER that answers
    hello, and any batch, with error unknown_type, and echoes each generate with a result."""
    seen: list[str] = []

    def answer(frame: bytes) -> bytes:
        msg = msgpack.unpackb(frame, raw=False)
        seen.append(msg["type"])
        if msg["type"] == "generate":
            return msgpack.packb({"v": 1, "type": "result", "id": msg["id"], "token_ids": msg["prompt_ids"],
                                  "finish_reason": "length"})
        return msgpack.packb({"v": 1, "type": "error", "id": msg["id"], "code": "unknown_type",
                              "message": f"clients may not send {msg['type']!r}"})

    async with stand_in_fleet(answer) as address:
        async with RemoteClient(address) as client:
            results = await asyncio.gather(*(client.generate(f"g{i}", [i], SamplingParams(max_tokens=1))
                                             for i in range(100)))
            assert [r.token_ids for r in results] == [[i] for i in range(100)]
        assert seen == ["hello"] + ["generate"] * 100  # no batch was ever sent


async def test_remote_client_reads_an_answer_larger_than_the_codecs_default_header_limit():
    """A stand-in fleet (a ROUTER) answers a generate with a result of 6 million tokens, some
    18 MB: more than codec.DEFAULT_MAX_HEADER_BYTES, well within the socket's message size."""
    tokens = [30000 + i % 1000 for i in range(6_000_000)]  # 3 bytes each in msgpack
    sizes: list[int] = []

    def answer(frame: bytes) -> bytes:
        msg = msgpack.unpackb(frame, raw=False)
        if msg["type"] == "hello":
            return msgpack.packb({"v": 1, "type": "reply", "id": msg["id"], "data": {"batch": False}})
        reply = msgpack.packb({"v": 1, "type": "result", "id": msg["id"], "token_ids": tokens,
                               "finish_reason": "length"})
        sizes.append(len(reply))
        return reply

    async with stand_in_fleet(answer) as address:
        async with RemoteClient(address) as client:
            result = await client.generate("long", [1], SamplingParams(max_tokens=6_000_000), timeout=60)
            assert result.token_ids == tokens
    assert len(sizes) == 1 and sizes[0] > codec.DEFAULT_MAX_HEADER_BYTES

async def test_remote_client_keeps_working_when_the_fleet_restarts_and_forgets_its_hello():
    with socket.socket() as probe:  # a free port both fleets bind in turn
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 0},
                         frontend_addr=f"tcp://127.0.0.1:{port}")
    async with RemoteClient(f"tcp://127.0.0.1:{port}") as client:
        async with Supervisor(config):
            first = await asyncio.gather(*(client.generate(f"a{i}", [i + 1], SamplingParams(max_tokens=2), timeout=20)
                                           for i in range(100)))
            assert [r.token_ids for r in first] == [echo_tokens([i + 1], 2) for i in range(100)]
            assert client._batch is True
        async with Supervisor(config):  # a new fleet on the same address: it never heard this client's hello
            again = await asyncio.gather(*(client.generate(f"b{i}", [i + 1], SamplingParams(max_tokens=2), timeout=20)
                                           for i in range(100)))
            assert [r.token_ids for r in again] == [echo_tokens([i + 1], 2) for i in range(100)]


async def test_closing_a_remote_client_ends_its_waiting_calls_with_fleet_closed():
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 20})) as sup:
        client = RemoteClient(sup.frontend_address)
        await client.generate("warm", [1], SamplingParams(max_tokens=1))  # hello done
        waiting = [asyncio.create_task(client.generate(f"long{i}", [1], SamplingParams(max_tokens=1000)))
                   for i in range(3)]
        async def consume() -> None:
            async for _ in client.stream("s", [2], SamplingParams(max_tokens=1000)):
                pass

        streaming = asyncio.create_task(consume())
        assert await wait_for(lambda: len(sup.table) == 4, 10)  # all four reached the fleet
        await client.close()
        for task in [*waiting, streaming]:
            with pytest.raises(FleetClosed):
                await asyncio.wait_for(task, 5)
        with pytest.raises(FleetClosed):
            await client.generate("after", [1], SamplingParams(max_tokens=1))
        # and the requests themselves were aborted: nothing could read their answers any more
        assert await wait_for(lambda: len(sup.table) == 0, 10)
        assert sup.counters["aborted"] == 4 and sup.counters["completed"] == 1  # the warm-up


async def test_closing_a_remote_client_aborts_its_own_requests_only_even_one_cancelled_just_before():
    async with Supervisor(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 20})) as sup:
        other = RemoteClient(sup.frontend_address)
        local = sup.client()
        client = RemoteClient(sup.frontend_address)
        params = SamplingParams(max_tokens=100_000)
        theirs = [asyncio.create_task(other.generate("same-id", [1], params)),
                  asyncio.create_task(local.generate("same-id", [1], params))]
        mine = [asyncio.create_task(client.generate("same-id", [1], params)),
                asyncio.create_task(client.generate("cancelled", [1], params))]
        assert await wait_for(lambda: len(sup.table) == 4, 10)
        mine[1].cancel()  # its abort is posted; close() comes in the same loop iteration
        await asyncio.gather(client.close(), client.close())  # the second waits for the first
        assert await wait_for(lambda: len(sup.table) == 2, 10)
        assert all(not t.done() for t in theirs)  # the other clients' requests run on
        assert sorted(e.origin == "local" for e in sup.table) == [False, True]
        with pytest.raises(FleetClosed):
            await mine[0]
        assert await other.abort("same-id") and await local.abort("same-id")
        assert [r.finish_reason for r in await asyncio.gather(*theirs)] == ["abort", "abort"]
        await other.close()


async def test_closing_a_remote_client_waits_at_most_close_abort_s_for_a_fleet_that_stopped_answering(monkeypatch):
    from rollfleet.actors import client as client_module
    from rollfleet.transport.messages import Reply

    monkeypatch.setattr(client_module, "CLOSE_ABORT_S", 0.3)
    seen: list[str] = []

    def answer(frame: bytes) -> bytes | None:  # answers hello, then reads and answers nothing more
        msg = codec.decode([frame])
        seen.append(msg.TYPE.value)
        return codec.encode(Reply(id=msg.id, data={"batch": False})) if isinstance(msg, Hello) else None

    async with stand_in_fleet(answer) as address:
        client = RemoteClient(address)
        waiting = asyncio.create_task(client.generate("g", [1], SamplingParams(max_tokens=1)))
        assert await wait_for(lambda: "generate" in seen, 10)
        t0 = time.monotonic()
        await client.close()
        assert time.monotonic() - t0 < 5  # its abort_all went unanswered: 0.3 s, not call_timeout_s (60 s)
        assert await wait_for(lambda: "abort_all" in seen, 5)
        with pytest.raises(FleetClosed):
            await waiting


async def test_closing_a_remote_client_before_its_hello_is_answered_ends_its_calls_with_fleet_closed():
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 0})) as sup:
        client = RemoteClient(sup.frontend_address)
        first = asyncio.create_task(client.generate("first", [1], SamplingParams(max_tokens=1)))
        aborting = asyncio.create_task(client.abort("first"))
        await asyncio.sleep(0)  # both wait for the hello the first one sent
        await client.close()
        # Not CancelledError: nobody cancelled these callers' tasks.
        for task in (first, aborting):
            with pytest.raises(FleetClosed):
                await asyncio.wait_for(task, 5)
            assert not task.cancelled()


async def test_a_remote_request_given_up_on_keeps_its_id_until_its_answer_is_in():
    # Its answers still come after the abort: a new request under the same id took them for its
    # own (here the result the fleet sent before it read the abort, still unread when the new
    # request went out).
    class Slow(RemoteClient):
        def on_cancel(self, request_id: str) -> None:
            time.sleep(1.0)  # this loop is held: the request ends on the fleet, its answer unread

    # The fleet runs on a loop of its own, which goes on meanwhile.
    with SyncClient(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 20})) as fleet:
        async with Slow(fleet.frontend_address) as client:
            await client.generate("warm", [1], SamplingParams(max_tokens=1))  # hello done
            with pytest.raises(RequestTimeout):
                await client.generate("x", [1], SamplingParams(max_tokens=2), timeout=0.02)
            with pytest.raises(DuplicateRequest):
                await client.generate("x", [7], SamplingParams(max_tokens=3))
            # Once the answer of the one given up on is in, the id is free again.
            assert await wait_for(lambda: fleet.stats()["num_inflight"] == 0, 10)
            await asyncio.sleep(0.1)
            result = await client.generate("x", [7], SamplingParams(max_tokens=3))
            assert result.token_ids == echo_tokens([7], 3) and result.finish_reason == "length"


async def test_remote_calls_in_flight_end_with_fleet_closed_when_the_fleet_is_killed(tmp_path):
    # A SIGKILLed fleet sends no error: the client hears the disconnect and ends what waits on
    # it (it waited for request_timeout_s, an hour by default).
    ready = tmp_path / "ready"
    serve = subprocess.Popen([sys.executable, "-m", "rollfleet", "serve", "--engine", "echo", "--tokens-per-s", "20",
                              "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        assert await wait_for(ready.exists, 60)
        address = ready.read_text().strip()
        async with RemoteClient(address) as client:
            assert (await client.generate("warm", [1], SamplingParams(max_tokens=1))).token_ids
            waiting = asyncio.create_task(client.generate("long", [1], SamplingParams(max_tokens=1000)))
            await asyncio.sleep(0.2)
            serve.kill()
            with pytest.raises(FleetClosed, match="lost the connection"):
                await asyncio.wait_for(waiting, 10)
    finally:
        serve.kill()
        serve.wait()


def test_a_remote_client_dropped_without_close_does_not_hang_the_collector(tmp_path):
    # Collected in one cycle with its sockets, a context of its own blocked gc in term().
    script = tmp_path / "drop.py"
    script.write_text(textwrap.dedent("""
        import asyncio, gc
        from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
        from rollfleet.transport.messages import SamplingParams

        async def main():
            async with Supervisor(FleetConfig(engine="echo", num_workers=1)) as sup:
                client = RemoteClient(sup.frontend_address)
                await client.generate("a", [1], SamplingParams(max_tokens=2))  # never closed

        asyncio.run(main())
        gc.collect()
        print("collected")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0 and "collected" in out.stdout, out.stderr[-2000:]


async def test_a_remote_client_keeps_to_the_fleets_message_limit_and_refuses_what_cannot_fit():
    # With a small client message limit a request over it was refused by the fleet under the
    # id "" (it could not be read), which the client could not match: the call waited forever.
    # Batches of requests that each fit could pass it together in the same way.
    from rollfleet.errors import InvalidRequest

    config = FleetConfig(engine="echo", num_workers=2, max_client_message_bytes=2048)
    async with Supervisor(config) as sup:
        async with RemoteClient(sup.frontend_address, request_timeout_s=30) as remote:
            with pytest.raises(InvalidRequest) as info:
                await asyncio.wait_for(remote.generate("big", [1000] * 1000, SamplingParams(max_tokens=1)), 10)
            assert info.value.code == "too_large" and "2048" in str(info.value)
            # calls too: refused before they go, instead of waiting out call_timeout_s
            for call in (lambda: remote.abort("x" * 4000), lambda: remote.abort_all("s" * 4000),
                         lambda: remote.control("start_profile", trace_dir="d" * 4000)):
                with pytest.raises(InvalidRequest) as info:
                    await asyncio.wait_for(call(), 5)
                assert info.value.code == "too_large"
            prompts = [[1000 + i] * 100 for i in range(64)]  # ~300 bytes each: 64 of them in one turn
            results = await asyncio.wait_for(
                remote.generate_batch(prompts, SamplingParams(max_tokens=2)), 30)
            assert [r.token_ids for r in results] == [echo_tokens(p, 2) for p in prompts]
            assert sup._drops.counts.get("bad_client_frame", 0) == 0


async def test_an_abort_made_while_the_first_hello_is_on_its_way_does_not_overtake_its_request():
    from rollfleet.errors import RequestTimeout  # noqa: F401  (what the overtaken request ended with)

    async with Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 50})) as sup:
        async with RemoteClient(sup.frontend_address, request_timeout_s=10) as remote:
            task = asyncio.create_task(remote.generate("r1", [1], SamplingParams(max_tokens=1000)))
            await asyncio.sleep(0)  # r1 now waits for the client's first hello
            assert await asyncio.wait_for(remote.abort("r1"), 5) is True
            result = await asyncio.wait_for(task, 5)
            assert result.finish_reason == "abort"


async def test_a_remote_batch_whose_hello_fails_tries_it_once_and_each_prompt_fails_with_it():
    # A fleet that never answers the hello: concurrent generate calls share the one hello and
    # its failure; a batch with return_exceptions tried a new one for each prompt in turn (40
    # prompts: 40 call timeouts, a batch of 10k against a dead address hung for days).
    seen: list[str] = []

    def answer(frame: bytes) -> None:  # reads, and answers nothing
        seen.append(msgpack.unpackb(frame, raw=False)["type"])

    async with stand_in_fleet(answer) as address:
        async with RemoteClient(address, call_timeout_s=0.5) as client:
            kept = await asyncio.wait_for(client.generate_batch([[i + 1] for i in range(40)], return_exceptions=True),
                                          15)
            assert len(kept) == 40 and all(isinstance(k, RequestTimeout) for k in kept)
            with pytest.raises(RequestTimeout, match="hello"):
                await asyncio.wait_for(client.generate_batch([[1], [2]]), 15)
        await asyncio.sleep(0.3)  # anything the closed client still sent has come
        assert seen == ["hello", "hello"]  # one for each batch, and nothing else was sent


async def test_a_remote_batch_cancelled_before_its_hello_failed_leaves_no_task_exception_unretrieved(caplog):
    # The hello failed after its only caller had gone: "Task exception was never retrieved"
    # was logged when the client was collected.
    gc.collect()  # what earlier tests left for the collector is logged now, not below
    caplog.clear()
    async with stand_in_fleet(lambda frame: None) as address:  # a fleet that answers nothing
        for call in ("generate_batch", "generate"):
            client = RemoteClient(address, call_timeout_s=0.2)
            task = asyncio.create_task(client.generate_batch([[1], [2]]) if call == "generate_batch"
                                       else client.generate("g", [1]))
            assert await wait_for(lambda: client._hello is not None, 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            hello = client._hello
            assert await wait_for(hello.done, 5) and not hello.cancelled()  # it failed (nobody asks it why)
            await client.close()
            del client, task, hello
            gc.collect()
        assert "never retrieved" not in caplog.text


async def test_dropped_frames_count_an_oversized_batch_with_an_unpackable_message_as_a_bad_frame_not_an_unknown_op():
    # PROTOCOL.md 6.5: a batch of over 1,024 messages that holds one msgpack cannot unpack is
    # refused with that message's error and counts under bad_client_frame, not
    # client_batch_too_large; an unknown control op is answered unknown_op and counted nowhere.
    async with fleet(1) as sup:
        raw = RawClient(sup.frontend_address)
        try:
            unpackable = b"\x83\xa1v\x01\xa4type\xa8generate\xa2id\xa2\xff\xfe"  # its id is not UTF-8
            await raw.send(codec.batch_frame([generate(f"u{i}", [1], 1) for i in range(1025)] + [unpackable]))
            refused = (await raw.answers({""}))[""]
            assert refused["type"] == "error" and refused["code"] == "bad_frame", refused
            await raw.send(codec.encode(Control(id="op", op="no_such_op")))
            answer = (await raw.answers({"op"}))["op"]
            assert answer["type"] == "error" and answer["code"] == "unknown_op", answer
            dropped = (await sup.stats(engines=False))["dropped_frames"]
            assert dropped.get("bad_client_frame") == 1 and "client_batch_too_large" not in dropped, dropped
            assert sup.counters["completed"] == 0  # nothing of the refused batch ran
        finally:
            raw.close()
