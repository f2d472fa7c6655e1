"""The core runtime with real worker processes and real sockets, on the echo engine."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket as socket_module
import subprocess
import sys
import textwrap
import time
import tracemalloc

import msgpack
import numpy as np
import psutil
import pytest
import torch
import zmq
import zmq.asyncio

from rollfleet.actors import FleetConfig, LLMClient, RemoteClient, Supervisor
from rollfleet.actors.process import device_env
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import DuplicateRequest, FleetClosed, InvalidRequest, RequestTimeout, WorkerLost, WorkerStartError
from rollfleet.transport import codec
from rollfleet.transport.messages import Generate, SamplingParams

from ..helpers import wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")


expected_tokens = echo_tokens  # the other echo test modules import it from here


def fleet(num_workers=2, **kw):
    options = kw.pop("engine_options", {})
    return Supervisor(FleetConfig(engine="echo", num_workers=num_workers, engine_options=options, **kw))


async def test_spawn_register_shutdown_leaves_no_process_or_socket_file():
    sup = fleet(3)
    await sup.start()
    pids = [h.pid for h in sup.workers.values()]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    assert os.stat(sup.private_dir).st_mode & 0o777 == 0o700
    assert any(name.endswith(".sock") for name in os.listdir(sup.private_dir))
    result = await sup.client().generate("r", [5], SamplingParams(max_tokens=3))
    assert result.token_ids == expected_tokens([5], 3)
    await sup.shutdown()
    await sup.shutdown()  # idempotent
    assert not os.path.exists(sup.private_dir)
    client = sup.client()
    for call in (lambda: client.generate("after", [1]), lambda: client.abort("r"), client.abort_all, client.stats,
                 lambda: client.control("clear_kv_cache")):
        with pytest.raises(FleetClosed):
            await call()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    with pytest.raises(FleetClosed, match="starts only once: make a new one"):
        async with sup:
            pass


async def test_worker_that_fails_to_start_raises_with_its_output():
    sup = fleet(1, engine_options={"fail_start": True}, restart=None)
    with pytest.raises(WorkerStartError) as info:
        await sup.start()
    assert "fail_start" in str(info.value)
    assert not os.path.exists(sup.private_dir)


async def test_generate_and_stream_are_deterministic_and_agree():
    async with fleet(2) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=20, logprobs=True)
        result = await client.generate("g", [7, 8], params)
        chunks, final = [], None
        async for item in client.stream("s", [7, 8], params):
            if hasattr(item, "finish_reason"):
                final = item
            else:
                chunks.extend(item.token_ids)
        assert result.token_ids == expected_tokens([7, 8], 20) == chunks == final.token_ids
        assert result.finish_reason == "length" and len(result.logprobs) == 20
        assert result.weight_versions == [0] and result.worker.startswith("w")


async def test_stop_token_ends_generation():
    async with fleet(1) as sup:
        toks = expected_tokens([3], 10)
        result = await sup.client().generate("s", [3], SamplingParams(max_tokens=10, stop_token_ids=[toks[4]]))
        assert result.token_ids == toks[:5] and result.finish_reason == "stop"


async def test_a_result_says_how_long_it_spent_on_its_worker_and_the_rest_is_the_fleets():
    # 20 tokens at 100 tokens/s: at least 0.2 s inside the worker, whatever the fleet adds.
    async with fleet(1, engine_options={"tokens_per_s": 100}) as sup:
        local = await sup.client().generate("t", [3], SamplingParams(max_tokens=20))
        async with RemoteClient(sup.frontend_address) as remote:
            outside = await remote.generate("t", [3], SamplingParams(max_tokens=20))
        for r in (local, outside):
            t = r.timings
            assert set(t) == {"total", "queue", "first_token", "worker"}
            assert 0.2 <= t["worker"] <= t["total"] - t["queue"]
        refused = await sup.client().generate("z", [3], SamplingParams(max_tokens=0))
        assert 0.0 <= refused.timings["worker"] <= refused.timings["total"]  # no token, still an attempt on a worker


async def test_a_first_token_is_dated_by_its_worker_not_by_the_report_that_brings_it():
    # 10 tokens at 20 tokens/s: the first is made about 0.05 s in, the last about 0.5 s. With a
    # report every 5 s, no chunk comes before the result: first_token is the worker's own timing
    # (it was the result's arrival, about 'total', when only the reports dated it).
    async with fleet(1, engine_options={"tokens_per_s": 20}, report_interval_s=5.0) as sup:
        local = await sup.client().generate("f", [3], SamplingParams(max_tokens=10))
        async with RemoteClient(sup.frontend_address) as remote:
            outside = await remote.generate("f", [3], SamplingParams(max_tokens=10))
        for r in (local, outside):
            t = r.timings
            assert r.token_ids == expected_tokens([3], 10) and t["total"] >= 0.45
            assert t["queue"] <= t["first_token"] < t["total"] - 0.3, t


async def test_worker_nice_lowers_the_workers_priority_below_the_supervisors_and_they_serve():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    async with fleet(2, worker_nice=5) as sup:
        for h in sup.workers.values():
            assert os.getpriority(os.PRIO_PROCESS, h.pid) == min(base + 5, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the supervisor's own is untouched
        r = await sup.client().generate("n", [3], SamplingParams(max_tokens=4))
        assert r.token_ids == expected_tokens([3], 4)
    for bad in (-1, 20, 2.5, True):
        with pytest.raises(ValueError, match="worker_nice"):
            FleetConfig(engine="echo", worker_nice=bad)


async def test_one_sampling_params_reused_with_its_stop_list_changed_in_place_stops_each_request_at_its_own():
    # The fleet copies a SamplingParams once while the same object comes back unchanged (a
    # rollout step's requests share one); a stop list changed in place between requests is a
    # change, and each request stops at the list it came with.
    async with fleet(1) as sup:
        client = sup.client()
        toks = expected_tokens([3], 20)
        params = SamplingParams(max_tokens=20, stop_token_ids=[toks[4]], temperature=0)
        first = await client.generate("s1", [3], params)
        params.stop_token_ids[:] = [toks[9]]
        second = await client.generate("s2", [3], params)
        params.stop_token_ids.clear()
        third, fourth = await client.generate_batch([[3], [3]], params)
        assert first.token_ids == toks[:5] and second.token_ids == toks[:10]
        assert third.token_ids == fourth.token_ids == toks and third.finish_reason == "length"
        assert first.finish_reason == second.finish_reason == "stop"


async def test_abort_one_of_many_leaves_others_untouched():
    async with fleet(2, engine_options={"tokens_per_s": 200}) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=100)  # 0.5 s each
        tasks = {i: asyncio.create_task(client.generate(f"r{i}", [i + 1], params)) for i in range(8)}
        await asyncio.sleep(0.05)
        assert await client.abort("r3")
        assert not await client.abort("nope")
        results = {i: await t for i, t in tasks.items()}
        aborted = results.pop(3)
        assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 100
        assert aborted.token_ids == expected_tokens([4], len(aborted.token_ids))
        for i, r in results.items():
            assert r.finish_reason == "length" and r.token_ids == expected_tokens([i + 1], 100)
        assert len(sup.table) == 0


@pytest.mark.parametrize("session", ["", "s"])
async def test_a_session_stays_on_one_worker_the_empty_name_too(session):
    async with fleet(2, engine_options={"tokens_per_s": 200}) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=20)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], params, session_id=session)) for i in range(8)]
        # all 8 in flight at once: least-loaded routing alone would split them 4/4
        assert await wait_for(lambda: sum(e.worker_id is not None for e in sup.table) == 8)
        assert len({e.worker_id for e in sup.table}) == 1
        assert len({(await t).worker for t in tasks}) == 1
        # without a session they spread
        tasks = [asyncio.create_task(client.generate(f"n{i}", [i + 1], params)) for i in range(8)]
        assert len({(await t).worker for t in tasks}) == 2


async def test_a_session_keeps_its_worker_across_other_requests_and_no_other_request_is_pinned_by_its_id():
    # Raw DEALERs, as a client written from PROTOCOL.md. Deterministic routing: ties go to the
    # worker that registered first (w0-0 or w1-0, whichever came up first).
    async with fleet(2, engine_options={"tokens_per_s": 200}, deterministic_routing=True, max_sticky=4) as sup:
        ctx = zmq.asyncio.Context()
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (a, b):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(sup.frontend_address)

        async def ask(sock, rid, max_tokens=1, **fields):
            await sock.send(msgpack.packb({"v": 1, "type": "generate", "id": rid, "prompt_ids": [1],
                                           "sampling": {"max_tokens": max_tokens}, **fields}))

        async def end_of(sock, rid):
            while True:
                msg = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 20), raw=False)
                if msg["id"] == rid and msg["type"] in ("result", "error"):
                    assert msg["type"] == "result", msg
                    return msg

        try:
            await ask(a, "busy", max_tokens=10_000)  # keeps the first worker loaded: the session goes to the other
            assert await wait_for(lambda: sup.table.num_inner == 1)
            first = next(iter(sup.table)).worker_id
            other = ({"w0-0", "w1-0"} - {first}).pop()
            await ask(a, "s1", session_id="S")
            assert (await end_of(a, "s1"))["worker"] == other
            # Client b reuses a's id "busy": an unrelated request, placed by load, not on the first.
            await ask(b, "busy")
            assert (await end_of(b, "busy"))["worker"] == other
            for i in range(10):  # more requests without a session than the fleet keeps sessions
                await ask(b, f"n{i}")
                await end_of(b, f"n{i}")
            await a.send(msgpack.packb({"v": 1, "type": "abort", "id": "x", "request_id": "busy"}))
            assert (await end_of(a, "busy"))["finish_reason"] == "abort"
            # Both workers idle (a tie goes to the first): the session still goes back to its worker.
            await ask(a, "s2", session_id="S")
            assert (await end_of(a, "s2"))["worker"] == other
        finally:
            ctx.destroy(0)


async def test_abort_all_of_a_session_then_the_rest_with_partial_output_and_other_clients_untouched():
    # 2 workers that run 2 requests at once each: of 8 requests some run, some wait in the
    # fleet; both kinds are aborted. A RemoteClient's requests are another client's.
    async with fleet(2, engine_options={"tokens_per_s": 100, "max_running": 2}) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=60)
        tasks = {i: asyncio.create_task(client.generate(f"r{i}", [i + 1], params, session_id=f"s{i % 2}"))
                 for i in range(8)}
        async with RemoteClient(sup.frontend_address) as remote:
            theirs = asyncio.create_task(remote.generate("r1", [50], SamplingParams(max_tokens=30), session_id="s1"))
            await asyncio.sleep(0.1)
            with pytest.raises(InvalidRequest):
                await client.abort_all(session_id=1)
            assert await client.abort_all(session_id="nobody") == []
            assert sorted(await client.abort_all(session_id="s1")) == ["r1", "r3", "r5", "r7"]
            for i in (1, 3, 5, 7):
                r = await tasks.pop(i)
                assert r.finish_reason == "abort" and len(r.token_ids) < 60
                assert r.token_ids == expected_tokens([i + 1], len(r.token_ids))
            assert sorted(await client.abort_all()) == ["r0", "r2", "r4", "r6"]
            for i, task in tasks.items():
                r = await task
                assert r.finish_reason == "abort" and r.token_ids == expected_tokens([i + 1], len(r.token_ids))
            assert await client.abort_all() == []
            r = await theirs  # the other client's "r1" of session "s1" ran to its end
            assert r.finish_reason == "length" and r.token_ids == expected_tokens([50], 30)
            # The same over the frontend: only that client's own requests.
            mine = asyncio.create_task(client.generate("k", [9], SamplingParams(max_tokens=60)))
            remote_tasks = [asyncio.create_task(remote.generate(f"q{i}", [i + 1], params)) for i in range(3)]
            await asyncio.sleep(0.1)
            assert sorted(await remote.abort_all()) == ["q0", "q1", "q2"]
            for i, task in enumerate(remote_tasks):
                r = await task
                assert r.finish_reason == "abort" and r.token_ids == expected_tokens([i + 1], len(r.token_ids))
            assert (await mine).finish_reason == "length"
        assert len(sup.table) == 0


async def test_abort_all_twice_names_a_request_whose_abort_is_under_way_and_it_ends_once():
    # PROTOCOL.md 6.3: a running request stays in flight until its worker has stopped it, so a
    # second abort_all before then names it again; it still ends with one result.
    async with fleet(1, engine_options={"tokens_per_s": 50}) as sup:
        client = sup.client()
        task = asyncio.create_task(client.generate("r", [4], SamplingParams(max_tokens=1000)))
        assert await wait_for(lambda: any(e.worker_id is not None for e in sup.table), 10.0)
        first = await client.abort_all()  # (the in-process client's calls run at once: no answer between them)
        second = await client.abort_all()
        assert first == second == ["r"]
        r = await task
        assert r.finish_reason == "abort" and r.token_ids == expected_tokens([4], len(r.token_ids))
        assert await client.abort_all() == []
        stats = await sup.stats()
        assert stats["num_aborted"] == 1 and stats["num_completed"] == 0
        assert len(sup.table) == 0


def slow_reader(ctx, address: str):
    """A raw client whose receive side holds little, so what it does not read backs up to the fleet."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    return sock


async def stall(sup, sock) -> None:
    """Send 20 endless streamed requests and read nothing, until the fleet has cancelled them all."""
    for i in range(20):
        await sock.send(msgpack.packb({"v": 1, "type": "generate", "id": f"s{i}", "prompt_ids": [i + 1],
                                       "sampling": {"max_tokens": 10_000_000}, "stream": True}))
    assert await wait_for(lambda: sup._drops.counts.get("slow_client", 0) > 0, 30.0)
    assert await wait_for(lambda: len(sup.table) == 0, 10.0)


async def test_a_client_that_stops_reading_loses_its_requests_and_others_are_served():
    # A raw client sends streamed requests and reads nothing: once client_send_hwm messages
    # wait for it, the fleet cancels its requests instead of queueing without end.
    async with fleet(2, client_send_hwm=200, engine_options={"tokens_per_s": 0}) as sup:
        ctx = zmq.asyncio.Context()
        slow = slow_reader(ctx, sup.frontend_address)
        try:
            await stall(sup, slow)
            stats = await sup.stats()
            assert stats["dropped_frames"]["slow_client"] >= 1 and stats["num_cancelled"] == 20
            async with RemoteClient(sup.frontend_address) as other:
                r = await other.generate("o", [3], SamplingParams(max_tokens=5))
                assert r.token_ids == expected_tokens([3], 5)
            # What was queued still arrives once the client reads: chunks, no terminal message.
            got = []
            while await slow.poll(200):
                got.append(msgpack.unpackb(await slow.recv()))
            assert got and all(m["type"] == "chunk" for m in got)
            await slow.send(msgpack.packb({"v": 1, "type": "generate", "id": "again", "prompt_ids": [4],
                                           "sampling": {"max_tokens": 3}}))
            answer = msgpack.unpackb(await asyncio.wait_for(slow.recv(), 10))
            assert answer["type"] == "result" and answer["token_ids"] == expected_tokens([4], 3)
        finally:
            slow.close(linger=0)
            ctx.term()


async def test_a_client_that_said_hello_with_batch_still_gets_batches_after_it_stalled():
    # Stalling (answers dropped for want of room) is not being gone: the fleet keeps the
    # client's hello, so what it drops it drops a batch frame at a time, and once the client
    # reads again its answers come in batches as before.
    async with fleet(2, client_send_hwm=50, engine_options={"tokens_per_s": 0}) as sup:
        ctx = zmq.asyncio.Context()
        slow = slow_reader(ctx, sup.frontend_address)
        try:
            await slow.send(msgpack.packb({"v": 1, "type": "hello", "id": "h", "batch": True}))
            assert msgpack.unpackb(await asyncio.wait_for(slow.recv(), 10))["data"]["batch"] is True
            await stall(sup, slow)
            while await slow.poll(200):  # what was queued before
                await slow.recv()
            requests = [{"v": 1, "type": "generate", "id": f"b{i}", "prompt_ids": [i + 1],
                         "sampling": {"max_tokens": 2}} for i in range(200)]
            await slow.send(msgpack.packb({"v": 1, "type": "batch", "id": "", "messages": requests}))
            results, frames = {}, []
            while len(results) < len(requests):
                # 200 answers as single frames overflow client_send_hwm (50) and are dropped
                assert await slow.poll(15_000), f"{len(results)} results came, in frames {frames}"
                frame = msgpack.unpackb(await slow.recv())
                frames.append(frame["type"])
                for m in frame["messages"] if frame["type"] == "batch" else [frame]:
                    assert m["type"] == "result", m
                    results[m["id"]] = m["token_ids"]
            assert results == {f"b{i}": expected_tokens([i + 1], 2) for i in range(200)}
            assert "batch" in frames, frames  # 200 answers in 200 frames: the hello was forgotten
        finally:
            slow.close(linger=0)
            ctx.term()


async def test_a_client_header_over_the_limit_is_refused_without_decoding():
    async with fleet(1, max_client_message_bytes=1 << 20) as sup:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(sup.frontend_address)
        try:
            big = msgpack.packb({"v": 1, "type": "generate", "id": "big", "prompt_ids": [7] * (1 << 20)})
            await sock.send(big)
            answer = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            assert (answer["type"], answer["code"], answer["id"]) == ("error", "too_large", "")
            await sock.send(msgpack.packb({"v": 1, "type": "generate", "id": "ok", "prompt_ids": [7] * 1000,
                                           "sampling": {"max_tokens": 2}}))
            answer = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            assert answer["type"] == "result" and answer["token_ids"] == expected_tokens([7] * 1000, 2)
        finally:
            sock.close(linger=0)
            ctx.term()


async def test_hello_never_promises_more_than_the_socket_takes():
    # A client limit above the socket limit (here the default 64 MiB over a 64 KiB socket):
    # ZeroMQ drops the client that sends such a frame, unanswered. hello says what is read.
    async with fleet(1, max_message_bytes=1 << 16) as sup:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sup.frontend_address)
        try:
            await sock.send(msgpack.packb({"v": 1, "type": "hello", "id": "h"}))
            answer = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            limit = answer["data"]["max_message_bytes"]
            assert limit == 1 << 16, answer
            # a generate of exactly that many bytes is read and served
            frame = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt_ids": [7], "sampling": {"max_tokens": 1},
                                   "pad": ""})
            frame = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt_ids": [7], "sampling": {"max_tokens": 1},
                                   "pad": "x" * (limit - len(frame) - 2)})
            assert len(frame) == limit
            await sock.send(frame)
            answer = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            assert answer["type"] == "result" and answer["token_ids"] == expected_tokens([7], 1)
        finally:
            ctx.destroy(0)


async def test_generate_batch_ids_that_are_no_str_are_invalid_requests_even_unhashable_ones():
    async with fleet(1) as sup:
        client = sup.client()
        for ids in (["a", ["b"]], [{"x": 1}, "c"], ["d", 5]):
            with pytest.raises(InvalidRequest) as info:  # a list among them was a TypeError of set()
                await client.generate_batch([[1], [2]], SamplingParams(max_tokens=1), request_ids=ids)
            assert info.value.code == "bad_field"
        with pytest.raises(DuplicateRequest):
            await client.generate_batch([[1], [2]], SamplingParams(max_tokens=1), request_ids=["e", "e"])
        assert (await sup.stats())["num_inflight"] == 0


async def test_a_timeout_that_is_no_number_of_seconds_and_an_abort_of_no_str_id_are_invalid_requests():
    async with fleet(1) as sup:
        client = sup.client()
        for timeout in (float("nan"), "1", -1, True):  # NaN timed out at random or never; "1" was a TypeError
            for call in (lambda: client.generate("t", [1], SamplingParams(max_tokens=1), timeout=timeout),
                         lambda: client.generate_batch([[1]], SamplingParams(max_tokens=1), timeout=timeout),
                         lambda: anext(aiter(client.stream("s", [1], SamplingParams(max_tokens=1), timeout=timeout)))):
                with pytest.raises(InvalidRequest, match="timeout") as info:
                    await call()
                assert info.value.code == "bad_field"
        with pytest.raises(InvalidRequest):  # it was False, as for an id not in flight
            await client.abort(5)
        assert (await sup.stats())["num_inflight"] == 0
    answers = await client.generate_batch([[1], [2]], request_ids=["a", "b"], return_exceptions=True)
    assert [type(a) for a in answers] == [FleetClosed, FleetClosed]
    assert [a.request_id for a in answers] == ["a", "b"]  # each slot names its request


async def test_a_prompt_the_engine_cannot_take_is_the_clients_error_and_the_worker_serves_on():
    async with fleet(1) as sup:
        client = sup.client()
        for prompt in ([], [-1], [32000], [1, 2**63 - 1]):
            with pytest.raises(InvalidRequest) as info:
                await client.generate(f"bad{len(prompt)}{prompt[-1] if prompt else ''}", prompt, SamplingParams(max_tokens=2))
            assert info.value.code == "bad_field"
        r = await client.generate("good", [31999], SamplingParams(max_tokens=2))
        assert r.token_ids == expected_tokens([31999], 2)
        assert [w["restarts"] for w in (await sup.stats())["workers"]] == [0]


async def test_a_remote_client_used_from_another_event_loop_refuses_before_sending():
    async with fleet(1) as sup:
        async with RemoteClient(sup.frontend_address) as remote:
            assert (await remote.generate("a", [1], SamplingParams(max_tokens=2))).token_ids == expected_tokens([1], 2)
            errors = []

            def elsewhere():
                for call in (remote.generate("b", [1], SamplingParams(max_tokens=2)), remote.stats()):
                    try:
                        asyncio.run(call)
                    except RuntimeError as exc:
                        errors.append(str(exc))

            await asyncio.to_thread(elsewhere)
            assert len(errors) == 2 and all("one client per event loop" in e for e in errors)
            await asyncio.sleep(0.1)
            assert (await remote.stats())["num_completed"] == 1  # "b" was never sent


async def test_duplicate_request_id_is_refused():
    async with fleet(1, engine_options={"tokens_per_s": 100}) as sup:
        client = sup.client()
        first = asyncio.create_task(client.generate("same", [1], SamplingParams(max_tokens=20)))
        await asyncio.sleep(0.02)
        with pytest.raises(DuplicateRequest):
            await client.generate("same", [1], SamplingParams(max_tokens=2))
        assert len((await first).token_ids) == 20


async def test_cancellation_reaches_the_worker():
    async with fleet(1, engine_options={"tokens_per_s": 50}) as sup:
        client = sup.client()
        with pytest.raises(RequestTimeout):
            await client.generate("slow", [1], SamplingParams(max_tokens=1000), timeout=0.2)
        task = asyncio.create_task(client.generate("slow2", [1], SamplingParams(max_tokens=1000)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(sup.table) == 0

        async def engine_idle():
            stats = await sup.stats()
            return all(w["engine_stats"]["num_running"] == 0 for w in stats["workers"])

        assert await wait_for(engine_idle, 3.0)
        assert sup.counters["cancelled"] == 2


async def test_a_stream_past_its_timeout_ends_with_request_timeout_and_stops_on_its_worker():
    # 1000 tokens at 200/s take 5 s; the stream has 1 s. It yields the chunks made until then,
    # then raises; the request stops on its worker. Local and through the frontend. A stream
    # whose answer comes in time is not hurt by its timer.
    async with fleet(1, engine_options={"tokens_per_s": 200}, report_interval_s=0.05) as sup:
        async with RemoteClient(sup.frontend_address) as remote:
            for client in (sup.client(), remote):
                chunks = []
                t0 = time.monotonic()
                with pytest.raises(RequestTimeout, match="timed out after 1.0s"):
                    async for item in client.stream("s", [1], SamplingParams(max_tokens=1000), timeout=1.0):
                        chunks.append(item)
                assert 1.0 <= time.monotonic() - t0 < 10.0
                assert chunks and sum(len(c.token_ids) for c in chunks) < 1000
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)
                items = [item async for item in client.stream("quick", [1], SamplingParams(max_tokens=5), timeout=5)]
                assert items[-1].token_ids == expected_tokens([1], 5)
        # The local one is cancelled in the fleet; the remote client sends an abort.
        assert (sup.counters["cancelled"], sup.counters["aborted"], sup.counters["completed"]) == (1, 1, 2)


async def test_closing_a_stream_aborts_its_request_before_aclose_returns():
    async with fleet(1, engine_options={"tokens_per_s": 200}) as sup:
        client = sup.client()
        stream = client.stream("local-s", [1], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        await stream.aclose()
        assert len(sup.table) == 0  # at once: not when the collector finalizes an inner generator
        async with RemoteClient(sup.frontend_address) as remote:
            stream = remote.stream("remote-s", [1], SamplingParams(max_tokens=1000))
            await stream.__anext__()
            await stream.aclose()
        # The client closed right after aclose(): the abort went out before it did.
        assert await wait_for(lambda: len(sup.table) == 0, 3.0)
        # 1000 tokens at 200/s would take 5 s: both ended early, by the client's cancel and abort.
        assert sup.counters["cancelled"] == 1 and sup.counters["aborted"] == 1
        assert sup.counters["completed"] == 0


async def test_hooks_are_called():
    class Recording(LLMClient):
        def __init__(self, sup):
            super().__init__(sup)
            self.events = []

        def on_dispatch(self, rid):
            self.events.append(("dispatch", rid))

        def on_complete(self, result):
            self.events.append(("complete", result.request_id))

        def on_cancel(self, rid):
            self.events.append(("cancel", rid))

    async with fleet(1, engine_options={"tokens_per_s": 50}) as sup:
        client = Recording(sup)
        await client.generate("a", [1], SamplingParams(max_tokens=2))
        with pytest.raises(RequestTimeout):
            await client.generate("b", [1], SamplingParams(max_tokens=100), timeout=0.05)
        assert client.events == [("dispatch", "a"), ("complete", "a"), ("dispatch", "b"), ("cancel", "b")]


async def test_sigkill_of_a_worker_fails_its_requests_with_a_typed_error():
    async with fleet(2, engine_options={"tokens_per_s": 100}, resume=False, deterministic_routing=True) as sup:
        client = sup.client()
        tasks = [asyncio.create_task(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=60)))
                 for i in range(6)]
        await asyncio.sleep(0.1)
        victim = sup.slots[0]
        on_victim = {e.request_id for e in sup.table.on_worker(victim.worker_id)}
        assert on_victim
        os.kill(victim.pid, signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for i, out in enumerate(outcomes):
            if f"r{i}" in on_victim:
                assert isinstance(out, WorkerLost), out
            else:
                assert out.token_ids == expected_tokens([i + 1], 60)
        assert len(sup.table) == 0
        # The fleet keeps serving, and the dead worker is restarted.
        assert (await client.generate("after", [2], SamplingParams(max_tokens=3))).token_ids == expected_tokens([2], 3)
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10.0)
        stats = await sup.stats()
        assert stats["workers"][0]["restarts"] == 1
        assert "code -9" in stats["workers"][0]["last_error"]
        # The restarted worker's own death is told by its own exit, not by its predecessor's.
        second = sup.slots[0]
        os.kill(second.pid, signal.SIGTERM)
        assert await wait_for(lambda: sup.slots[0] is not second and sup.slots[0].state.value == "ready", 10.0)
        assert "code -9" not in second.last_error
        assert (await sup.stats())["workers"][0]["last_error"] == second.last_error


async def test_hung_worker_is_detected_by_missed_heartbeats():
    async with fleet(2, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as sup:
        victim = sup.slots[1]
        os.kill(victim.pid, signal.SIGSTOP)
        assert await wait_for(lambda: victim.worker_id not in sup.workers, 5.0)
        assert "heartbeat" in victim.last_error
        assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
        assert await wait_for(lambda: len(sup.ready_workers()) == 2, 10.0)


SUPERVISOR_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from rollfleet.actors import Supervisor, FleetConfig
    async def main():
        sup = Supervisor(FleetConfig(engine="echo", num_workers=2))
        await sup.start()
        print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
        await asyncio.sleep(60)
    asyncio.run(main())
""")


def test_sigkill_of_the_supervisor_takes_the_workers_and_their_socket_directory_down():
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        private_dir, pids = line[0], [int(p) for p in line[1:]]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.kill()
        proc.wait()
        # At once on an idle machine; 10 s leaves room for a busy one.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and (any(psutil.pid_exists(p) for p in pids) or os.path.exists(private_dir)):
            time.sleep(0.05)
        assert not any(psutil.pid_exists(p) for p in pids)
        assert not os.path.exists(private_dir), "socket directory left behind"
    finally:
        proc.kill()


async def test_100k_requests_leave_the_table_empty_and_memory_flat():
    async with fleet(2, max_sticky=1000) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=1)
        sem = asyncio.Semaphore(256)

        async def one(i):
            async with sem:
                await client.generate(f"r{i}", [i % 100 + 1], params)

        async def batch(start, n):
            await asyncio.gather(*(one(i) for i in range(start, start + n)))

        tracemalloc.start()
        await batch(0, 10_000)  # warm-up: fills the sticky LRU and every free list
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for start in range(10_000, 100_000, 10_000):
            await batch(start, 10_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert len(sup.table) == 0 and sup.table.num_inner == 0 and not sup._per_origin
        assert sup.counters["completed"] == 100_000
        # 90k requests after warm-up: anything kept per request would show as megabytes.
        assert grown < 2 * 1024 * 1024, f"memory grew by {grown} bytes"


async def test_remote_client_over_the_frontend_socket():
    async with fleet(2, engine_options={"tokens_per_s": 200}) as sup:
        async with RemoteClient(sup.frontend_address) as remote:
            result = await remote.generate("x", [9], SamplingParams(max_tokens=5))
            assert result.token_ids == expected_tokens([9], 5)
            streamed = []
            async for item in remote.stream("y", [9], {"max_tokens": 6}):
                if not hasattr(item, "finish_reason"):
                    streamed.extend(item.token_ids)
            assert streamed == expected_tokens([9], 6)
            long = asyncio.create_task(remote.generate("z", [1], SamplingParams(max_tokens=500)))
            await asyncio.sleep(0.05)
            assert await remote.abort("z")
            assert (await long).finish_reason == "abort"
            assert not await remote.abort("never-sent")
            stats = await remote.stats()
            assert stats["num_workers"] == 2 and len(stats["workers"]) == 2


async def test_frontend_answers_bad_input_with_typed_errors_and_keeps_serving(tmp_path):
    async with fleet(1, engine_options={"tokens_per_s": 100}) as sup:
        client = sup.client()
        running = asyncio.create_task(client.generate("keep", [4], SamplingParams(max_tokens=30)))
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(sup.frontend_address)
        try:
            gen = {"v": 1, "type": "generate", "prompt_ids": [1]}
            sleep = {"v": 1, "type": "control", "op": "sleep"}
            cases = [  # (frames, code, the id the error answers with)
                ([b"\xc1\xc1"], "bad_frame", ""),
                ([msgpack.packb({"v": 1, "type": "nope", "id": "1"})], "unknown_type", "1"),
                ([msgpack.packb({"v": 1, "type": "generate", "id": "2", "prompt_ids": "x"})], "bad_field", "2"),
                ([msgpack.packb({"v": 1, "type": "heartbeat", "id": "3"})], "unknown_type", "3"),
                ([msgpack.packb({"v": 1, "type": "abort", "id": "4", "request_id": "ghost"})], "unknown_request", "4"),
                ([msgpack.packb({"v": 1, "type": "control", "id": "5", "op": "reboot"})], "unknown_op", "5"),
                # a bad request inside a batch is answered like a bad frame of its own
                ([codec.batch_frame([msgpack.packb({"v": 1, "type": "generate", "id": "6", "prompt_ids": "x"})])],
                 "bad_field", "6"),
                # types only workers send: refused as such, not for their missing fields
                ([msgpack.packb({"v": 1, "type": "register", "id": "7"})], "unknown_type", "7"),
                ([msgpack.packb({"v": 1, "type": "result", "id": "8"})], "unknown_type", "8"),
                ([codec.batch_frame([msgpack.packb({"v": 1, "type": "weights_end", "id": "8b"})])], "unknown_type", "8b"),
                # a map key that is not a str: the message's id is still read back
                ([msgpack.packb({**gen, "id": "9", "sampling": {1: 2}})], "bad_field", "9"),
                ([msgpack.packb({**gen, "id": ""})], "bad_field", ""),  # a request needs a name
                ([msgpack.packb({**gen, "id": "10", "sampling": {"temperature": float("nan")}})], "bad_field", "10"),
                ([msgpack.packb({**gen, "id": "11", "sampling": {"max_tokens": 2**64 - 1}})], "bad_field", "11"),
                ([msgpack.packb({**sleep, "id": "12", "args": {"level": "2"}})], "bad_field", "12"),
                ([msgpack.packb({**sleep, "id": "13", "args": {"level": 3}})], "bad_field", "13"),
                ([msgpack.packb({**sleep, "id": "14", "args": {"level": True}})], "bad_field", "14"),
                ([msgpack.packb({"v": 1, "type": "control", "id": "15", "op": "start_profile"})], "bad_field", "15"),
                # a batch that cannot be read is refused whole; a batch's own id is ignored
                ([msgpack.packb({"v": 1, "type": "batch", "id": "16"})], "bad_field", ""),
                ([msgpack.packb({"v": 1, "type": "batch", "id": "17", "messages": "x"})], "bad_field", ""),
                # an engine without profiling: refused, and the trace directory is not made
                ([msgpack.packb({"v": 1, "type": "control", "id": "18", "op": "start_profile",
                                 "args": {"trace_dir": str(tmp_path / "trace")}})], "unsupported", "18"),
            ]
            for frames, code, msg_id in cases:
                await sock.send_multipart(frames)
                reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 5))
                assert reply["type"] == "error" and reply["code"] == code and reply["id"] == msg_id, reply
        finally:
            sock.close(0)
            ctx.term()
        assert (await running).token_ids == expected_tokens([4], 30)
        assert sup.counters["completed"] == 1  # "keep" alone: none of the bad requests ran
        assert not (tmp_path / "trace").exists()


async def test_logprobs_asked_for_come_as_a_list_even_without_tokens():
    async with fleet(1, engine_options={"tokens_per_s": 2}) as sup:
        client = sup.client()
        none = await client.generate("n", [1], SamplingParams(max_tokens=0, logprobs=True))
        assert none.token_ids == [] and none.logprobs == []
        assert (await client.generate("p", [1], SamplingParams(max_tokens=0))).logprobs is None
        slow = asyncio.create_task(client.generate("s", [1], SamplingParams(max_tokens=50, logprobs=True)))
        assert await wait_for(lambda: getattr(sup.table.get("local", "s"), "inner_id", None) is not None)
        assert await client.abort("s")  # the first token is 0.5 s away
        aborted = await slow
        assert aborted.finish_reason == "abort" and aborted.token_ids == [] and aborted.logprobs == []
        some = await client.generate("t", [1], SamplingParams(max_tokens=2, logprobs=True))
        assert len(some.token_ids) == len(some.logprobs) == 2


async def test_clients_refuse_bad_arguments_with_invalid_request_before_sending():
    async with fleet(1) as sup:
        async with RemoteClient(sup.frontend_address, call_timeout_s=5) as remote:
            for client in (sup.client(), remote):
                for args in ((123, [1]), ("", [1]), ("p", "abc"), ("s", [1], {"max_tokens": -1}),
                             ("t", [1], {"temperature": "hot"}), ("u", [1], [("max_tokens", 2)]),
                             ("v", [1], {"max_new_tokens": 4}),  # a typo would silently take the default
                             ("w", [True]), ("x", [[1, 2]]), ("y", torch.tensor([[1]])), ("z", [np.float32(1)]),
                             ("big", [np.int64(1), 2**70])):
                    with pytest.raises(InvalidRequest) as info:
                        await asyncio.wait_for(client.generate(*args), 5)  # a bad id once hung a RemoteClient
                    assert info.value.code == "bad_field", (client, args)
                    with pytest.raises(InvalidRequest):
                        async for _ in client.stream(*args):
                            pass
                assert (await client.generate("ok", [1], {"max_tokens": 2})).token_ids == expected_tokens([1], 2)
                # a tensor or an array of token ids is taken as its list
                for prompt in (np.array([1]), torch.tensor([1])):
                    assert (await client.generate("ok", prompt, {"max_tokens": 2})).token_ids == expected_tokens([1], 2)
                # numpy's numbers, in a list or in a dict of sampling parameters, as the plain ones
                r = await client.generate("ok", [np.int64(1)], {"max_tokens": np.int64(2), "top_p": np.float32(0.5)})
                assert r.token_ids == expected_tokens([1], 2)
                assert client is remote or len(sup.table) == 0  # nothing refused stayed in flight
            # control answers in one shape from both: {worker id: reply data}
            assert await remote.control("clear_kv_cache") == await sup.client().control("clear_kv_cache")
            assert list(await remote.control("clear_kv_cache")) == [h.worker_id for h in sup.ready_workers()]
        assert sup.counters["completed"] == 8

def test_device_env_is_safe_and_maps_visible_devices():
    assert device_env("cpu", {}) == {}
    assert device_env("cuda:1", {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert device_env("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,5"}) == {"CUDA_VISIBLE_DEVICES": "5"}
    assert device_env("npu:0", {}) == {"ASCEND_RT_VISIBLE_DEVICES": "0"}
    assert device_env("cuda", {"CUDA_VISIBLE_DEVICES": ""}) == {"CUDA_VISIBLE_DEVICES": "0"}


async def test_generate_batch_of_both_clients_keeps_prompt_order_and_checks_before_sending():
    async with fleet(2, engine_options={"tokens_per_s": 100}) as sup:
        prompts = [[i + 1, i + 2] for i in range(6)]
        lengths = [i + 1 for i in range(6)]
        async with RemoteClient(sup.frontend_address) as remote:
            for client in (sup.client(), remote):
                # one SamplingParams for all, one per prompt (dicts too), prompts from a generator
                same = await client.generate_batch(prompts, SamplingParams(max_tokens=3))
                assert [r.token_ids for r in same] == [expected_tokens(p, 3) for p in prompts]
                assert len({r.request_id for r in same}) == 6
                each = await client.generate_batch((p for p in prompts), [{"max_tokens": n} for n in lengths])
                assert await asyncio.wait_for(client.generate_batch([]), 5) == []
                assert [r.token_ids for r in each] == [expected_tokens(p, n) for p, n in zip(prompts, lengths)]
                # bad arguments start nothing
                for args, kwargs, error in (
                    ((prompts, [SamplingParams()] * 5), {}, InvalidRequest),
                    ((prompts[:2],), {"request_ids": ["a"]}, InvalidRequest),
                    ((prompts[:2],), {"request_ids": ["a", "a"]}, DuplicateRequest),
                    ((prompts[:2],), {"request_ids": ["a", ""]}, InvalidRequest),
                    ((prompts[:2],), {"request_ids": "ab"}, InvalidRequest),  # not the ids "a" and "b"
                    (([[1], "text"],), {}, InvalidRequest),
                    ((prompts[:2], {"max_new_tokens": 3}), {}, InvalidRequest),
                    (([1, 2, 3],), {}, InvalidRequest),  # one prompt given flat, not a list of prompts
                    ((prompts[:2],), {"session_id": 5}, InvalidRequest),
                ):
                    with pytest.raises(error):
                        await client.generate_batch(*args, **kwargs)
                    assert len(sup.table) == 0
                # a failure: raised once the others are stopped, or kept in its slot
                bad = [[1], [2], [10**6], [3]]
                with pytest.raises(InvalidRequest):
                    await client.generate_batch(bad, SamplingParams(max_tokens=1000))
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)
                kept = await client.generate_batch(bad, SamplingParams(max_tokens=2), return_exceptions=True)
                assert isinstance(kept[2], InvalidRequest)
                assert [r.token_ids for i, r in enumerate(kept) if i != 2] == [expected_tokens(p, 2) for p in
                                                                            (bad[0], bad[1], bad[3])]
                # a batch whose caller gives up leaves nothing running
                task = asyncio.create_task(client.generate_batch(prompts, SamplingParams(max_tokens=1000)))
                assert await wait_for(lambda: len(sup.table) == 6, 3.0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)


class _Hooks:
    """Records the client hooks a batch calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatched, self.completed, self.cancelled = [], [], []

    def on_dispatch(self, request_id):
        self.dispatched.append(request_id)

    def on_complete(self, result):
        self.completed.append(result.request_id)

    def on_cancel(self, request_id):
        self.cancelled.append(request_id)


def with_hooks(hooks, client_class):
    """``client_class`` (LLMClient or RemoteClient) with the hooks of ``hooks`` mixed in."""
    return type(f"{hooks.__name__}{client_class.__name__}", (hooks, client_class), {})


async def test_generate_batch_sends_nothing_after_a_refused_prompt_and_calls_each_hook_once():
    async with fleet(2, engine_options={"tokens_per_s": 100}) as sup:
        async with with_hooks(_Hooks, RemoteClient)(sup.frontend_address) as remote:
            for client in (with_hooks(_Hooks, LLMClient)(sup), remote):
                ids = ["a", "b", "c", "d"]
                bad = [[1], [2], ["x"], [3]]  # the third is refused (in-process: as it is sent)
                with pytest.raises(InvalidRequest) as info:
                    await client.generate_batch(bad, SamplingParams(max_tokens=1000), request_ids=ids)
                assert info.value.request_id == "c"
                if client is remote:  # refused by the fleet, after the last one went too: all stopped
                    assert client.dispatched == ids and sorted(client.cancelled) == ["a", "b", "d"]
                else:  # refused as it was sent: the two before it were stopped, the last never went
                    assert client.dispatched == ["a", "b"] and sorted(client.cancelled) == ["a", "b"]
                assert client.completed == []
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)
                client.dispatched.clear(), client.cancelled.clear()
                ids = ["e", "f", "g", "h"]  # (a RemoteClient keeps ids given up on until their answers are in)
                kept = await client.generate_batch(bad, SamplingParams(max_tokens=2), request_ids=ids,
                                                   return_exceptions=True)
                assert isinstance(kept[2], InvalidRequest)
                assert [r.request_id for i, r in enumerate(kept) if i != 2] == ["e", "f", "h"]
                assert sorted(client.completed) == ["e", "f", "h"]  # as they came
                assert client.dispatched == (ids if client is remote else ["e", "f", "h"])
                assert client.cancelled == []
                # a timeout: every request not finished is stopped, and each slot says so
                client.dispatched.clear(), client.completed.clear()
                slow = await client.generate_batch([[1], [2]], [SamplingParams(max_tokens=1),
                                                                 SamplingParams(max_tokens=1000)],
                                                   request_ids=["t1", "t2"], timeout=1.0, return_exceptions=True)
                assert slow[0].token_ids == expected_tokens([1], 1)
                assert isinstance(slow[1], RequestTimeout) and slow[1].request_id == "t2"
                assert client.completed == ["t1"] and client.cancelled == ["t2"]
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)


class _EnoughSamples(_Hooks):
    """An abort policy on the hooks: once two results are in, what is left of the batch stops;
    a result from prompt [13] makes the hook fail."""

    def on_complete(self, result):
        super().on_complete(result)
        if len(self.completed) == 2:
            asyncio.get_running_loop().create_task(self.abort_all())
        if result.token_ids[:1] == expected_tokens([13], 1):
            raise ValueError("hook failed")


async def test_generate_batch_calls_on_complete_as_each_result_comes_as_generate_does():
    # It was called for the whole batch once the last request was over: a policy built on it
    # (README: abort the rest of a step once it has enough samples) never stopped anything.
    async with fleet(2, engine_options={"tokens_per_s": 100}) as sup:
        async with with_hooks(_EnoughSamples, RemoteClient)(sup.frontend_address) as remote:
            for client in (with_hooks(_EnoughSamples, LLMClient)(sup), remote):
                params = [SamplingParams(max_tokens=2)] * 2 + [SamplingParams(max_tokens=1000)] * 4
                results = await client.generate_batch([[i + 1] for i in range(6)], params)
                assert [r.finish_reason for r in results] == ["length"] * 2 + ["abort"] * 4
                assert all(len(r.token_ids) < 1000 for r in results[2:])
                assert sorted(client.completed) == sorted(r.request_id for r in results)
                assert client.cancelled == []
                # a hook that fails fails its request, as it does generate
                client.completed.clear()
                kept = await client.generate_batch([[12], [13]], SamplingParams(max_tokens=2), return_exceptions=True)
                assert kept[0].token_ids == expected_tokens([12], 2) and isinstance(kept[1], ValueError)
                assert await wait_for(lambda: len(sup.table) == 0, 3.0)


async def test_a_remote_client_with_no_fleet_at_its_address_says_so_at_its_timeout():
    with socket_module.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    async with RemoteClient(address, call_timeout_s=0.5) as remote:
        for call in (lambda: remote.generate("a", [1]), remote.stats):
            with pytest.raises(RequestTimeout, match="no connection to a fleet at " + address):
                await call()


async def test_the_in_process_clients_of_a_fleet_are_one_client_to_it():
    async with fleet(1, engine_options={"tokens_per_s": 50}) as sup:
        first, second = sup.client(), sup.client()
        running = asyncio.create_task(first.generate("x", [1], SamplingParams(max_tokens=200)))
        assert await wait_for(lambda: sup.table.get("local", "x") is not None, 5.0)
        with pytest.raises(DuplicateRequest):
            await second.generate("x", [2], SamplingParams(max_tokens=2))
        assert await second.abort_all() == ["x"]
        assert (await running).finish_reason == "abort"


async def test_a_remote_calls_own_timeout_bounds_its_wait_for_the_hello():
    # The first request waits for the client's hello, itself bounded by call_timeout_s (60 s
    # here): the request's own timeout, or request_timeout_s, still ends the call in time.
    with socket_module.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"

    async def first_item(stream):  # type: ignore[no-untyped-def]
        async for item in stream:
            return item

    async with RemoteClient(address, call_timeout_s=60, request_timeout_s=0.5) as remote:
        calls = [lambda: remote.generate("a", [1], timeout=0.5), lambda: remote.generate("b", [1]),
                 lambda: first_item(remote.stream("c", [1], timeout=0.5)),
                 lambda: remote.generate_batch([[1], [2]], timeout=0.5)]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(RequestTimeout, match="waiting for the fleet to answer hello"):
                await asyncio.wait_for(call(), 20)
            assert time.monotonic() - started < 15
        kept = await remote.generate_batch([[1], [2]], timeout=0.5, return_exceptions=True)
        assert [type(r) for r in kept] == [RequestTimeout, RequestTimeout]


async def test_a_remote_generate_batch_times_out_at_its_deadline_counted_from_the_call_hello_included():
    # The wait for the fleet's hello takes part of the timeout; the results get what is left of
    # it, not a whole timeout again (the call then took the hello's wait plus the timeout).
    with socket_module.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    async with RemoteClient(address) as remote:
        started = time.monotonic()
        call = asyncio.create_task(remote.generate_batch([[1], [2]], SamplingParams(max_tokens=10**6), timeout=8))
        await asyncio.sleep(6)  # no fleet yet: the call waits for its hello
        async with fleet(1, frontend_addr=address, engine_options={"tokens_per_s": 5}):
            with pytest.raises(RequestTimeout) as caught:
                await asyncio.wait_for(call, 30)
            elapsed = time.monotonic() - started
    assert "hello" not in str(caught.value), caught.value  # the requests were sent, and then timed out
    assert 7.5 < elapsed < 12.5, elapsed  # 8 s from the call; not 6 s of hello + 8


async def test_a_relative_ipc_frontend_path_is_said_as_an_absolute_one_that_reaches_it_from_anywhere(tmp_path,
                                                                                                   monkeypatch):
    from rollfleet.actors import RemoteClient

    monkeypatch.chdir(tmp_path)
    async with Supervisor(FleetConfig(engine="echo", num_workers=1, frontend_addr="ipc://front.sock")) as sup:
        assert sup.frontend_address == f"ipc://{tmp_path / 'front.sock'}"
        monkeypatch.chdir("/")  # a client elsewhere: the address still names the file
        async with RemoteClient(sup.frontend_address) as client:
            assert (await client.generate("r", [3], SamplingParams(max_tokens=2))).token_ids == expected_tokens([3], 2)
    assert not (tmp_path / "front.sock").exists()


async def test_shutdown_removes_the_socket_files_before_it_waits_for_the_workers(tmp_path):
    # A job manager's SIGTERM then SIGKILL can end the supervisor while its workers take their
    # grace period: the socket files must be gone by then, not only at the very end.
    front = tmp_path / "front.sock"
    sup = Supervisor(FleetConfig(engine="echo", num_workers=2, frontend_addr=f"ipc://{front}"))
    await sup.start()
    workers_sock = os.path.join(sup.private_dir, "workers.sock")
    assert front.exists() and os.path.exists(workers_sock)
    held = next(iter(sup.workers.values())).pid
    # One worker is held stopped, so that it is certainly still running when the files are
    # checked (on a loaded machine both could otherwise take their shutdown message and exit
    # before this task runs again).
    os.kill(held, signal.SIGSTOP)
    try:
        task = asyncio.create_task(sup.shutdown())
        await asyncio.sleep(0)  # shutdown has begun: the workers were told
        assert psutil.Process(held).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        assert not front.exists() and not os.path.exists(workers_sock)
    finally:
        os.kill(held, signal.SIGCONT)
    await task
    assert not os.path.exists(sup.private_dir)


def test_a_started_fleet_collected_without_shutdown_kills_its_workers_and_does_not_hang():
    # Started, never shut down, its loop ended: collecting it used to block for good in the
    # ZeroMQ context's term() (its sockets still open), with its workers running on.
    script = textwrap.dedent("""
        import asyncio, gc, os, time
        import psutil
        from rollfleet.actors import FleetConfig, Supervisor

        async def main():
            sup = Supervisor(FleetConfig(engine="echo", num_workers=2))
            await sup.start()
            return sup.private_dir, [h.pid for h in sup.workers.values()]

        private, pids = asyncio.run(main())
        gc.collect()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
            time.sleep(0.05)
        print(any(psutil.pid_exists(p) for p in pids), os.path.exists(private), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
    assert "collected without shutdown()" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_a_hangup_of_the_whole_process_group_leaves_nothing_behind(tmp_path, sig):
    # A training script with no handler for SIGHUP (its terminal closed) or SIGQUIT dies at
    # once, and so, by default, would its workers, without cleaning up after it.
    front = tmp_path / "front.sock"
    script = textwrap.dedent(f"""
        import asyncio, resource, signal
        from rollfleet.actors import FleetConfig, Supervisor

        signal.signal({int(sig)}, signal.SIG_DFL)  # as a terminal's job has it (this run may be nohup's)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGQUIT's core dump: slow, and not wanted here

        async def main():
            async with Supervisor(FleetConfig(engine="echo", num_workers=2, frontend_addr="ipc://{front}")) as sup:
                print(sup.private_dir, *[h.pid for h in sup.workers.values()], flush=True)
                await asyncio.sleep(60)

        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        private, *pids = proc.stdout.readline().split()
        workers = [psutil.Process(int(p)) for p in pids]
        os.killpg(proc.pid, sig)
        assert proc.wait(30) == -sig
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert not os.path.exists(private) and not front.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workers_of_a_job_that_ignores_sighup_keep_ignoring_it():
    # Started under nohup (SIGHUP ignored, and inherited so): a closed terminal stops nothing.
    script = textwrap.dedent("""
        import asyncio, logging, os, signal, time
        from rollfleet.actors import FleetConfig, Supervisor

        signal.signal(signal.SIGHUP, signal.SIG_IGN)

        async def main():
            async with Supervisor(FleetConfig(engine="echo", num_workers=1)) as sup:
                first = sup.slots[0]
                os.kill(first.pid, signal.SIGHUP)
                await asyncio.sleep(1.5)  # past a worker's SIGTERM_GRACE_S
                print(sup.slots[0] is first and first.alive, (await sup.stats())["workers"][0]["restarts"], flush=True)

        asyncio.run(main())
        # a never-started fleet collected says nothing of workers
        Supervisor(FleetConfig(engine="echo"))
        import gc; gc.collect()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "0"], out.stdout + out.stderr
    assert "collected without shutdown" not in out.stderr


async def test_a_client_flooding_stats_is_answered_overloaded_past_64_waiting_calls_and_other_clients_are_not():
    # Each stats call asks every worker; with no bound, one client sending them as fast as it
    # could held other clients' requests back by seconds. A stopped worker keeps each call
    # waiting (ENGINE_STATS_TIMEOUT_S), so the flood's calls pile up as they would under load.
    from rollfleet.actors.supervisor import MAX_CALLS_PER_CLIENT

    async with fleet(2, heartbeat_timeout_s=120.0) as sup:
        stopped = psutil.Process(sup.slots[0].pid)
        ctx = zmq.asyncio.Context()
        flood, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (flood, other):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(sup.frontend_address)

        async def answers(sock, count):
            return [msgpack.unpackb(await asyncio.wait_for(sock.recv(), 30), raw=False) for _ in range(count)]

        stopped.suspend()
        try:
            for i in range(MAX_CALLS_PER_CLIENT + 36):
                await flood.send(msgpack.packb({"v": 1, "type": "stats", "id": f"s{i}"}))
            refused = await answers(flood, 36)  # at once: the 64 first wait for the stopped worker
            assert {(m["type"], m["code"]) for m in refused} == {("error", "overloaded")}
            assert sorted(int(m["id"][1:]) for m in refused) == list(range(MAX_CALLS_PER_CLIENT, MAX_CALLS_PER_CLIENT + 36))
            # hello, abort_all and abort count toward no limit (PROTOCOL.md section 7): the same
            # client, its 64 calls still waiting, has them answered at once.
            for header in ({"type": "hello", "id": "h"}, {"type": "abort_all", "id": "aa"},
                           {"type": "abort", "id": "a", "request_id": "nothing"}):
                await flood.send(msgpack.packb({"v": 1, **header}))
            quick = {m["id"]: m for m in await answers(flood, 3)}
            assert quick["h"]["type"] == "reply" and quick["h"]["data"]["batch"] is False
            assert quick["aa"]["type"] == "reply" and quick["aa"]["data"] == {"request_ids": []}
            assert (quick["a"]["type"], quick["a"]["code"]) == ("error", "unknown_request")
            # Another client's calls are counted apart: not refused.
            await other.send(msgpack.packb({"v": 1, "type": "stats", "id": "mine"}))
            assert [(m["id"], m["type"]) for m in await answers(other, 1)] == [("mine", "reply")]
            waited = await answers(flood, MAX_CALLS_PER_CLIENT)
            assert sorted(int(m["id"][1:]) for m in waited) == list(range(MAX_CALLS_PER_CLIENT))
            assert {m["type"] for m in waited} == {"reply"}
        finally:
            stopped.resume()
        await flood.send(msgpack.packb({"v": 1, "type": "stats", "id": "again"}))  # its calls are counted down
        await flood.send(msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": [5],
                                        "sampling": {"max_tokens": 3}}))
        done = {m["id"]: m for m in await answers(flood, 2)}
        assert done["again"]["type"] == "reply" and done["g"]["token_ids"] == echo_tokens([5], 3)
        assert sup._client_calls == {}
        ctx.destroy(0)
