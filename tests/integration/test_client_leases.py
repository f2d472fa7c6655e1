"""Leases on the client socket (PROTOCOL.md 4.1 ``hello``, "Leases"): a client that says
``hello`` with ``lease_s`` and then goes silent for that long has its requests aborted by the
fleet, so a client process killed before it could close leaves nothing running. Real
supervisor, real echo workers, real client processes killed with SIGKILL, raw ZeroMQ clients
written from PROTOCOL.md, and RemoteClient."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor, SyncClient
from rollfleet.transport import codec
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import RolloutError
from rollfleet.transport.messages import Error, Hello, Reply, SamplingParams

from ..helpers import stand_in_fleet, wait_for
from .test_client_batches import RawClient, generate

pytestmark = pytest.mark.usefixtures("no_leaks")

LONG = 100_000  # tokens: at 20 tokens/s a request that runs for the whole test unless aborted

CLIENT = textwrap.dedent("""
    import asyncio, sys
    from rollfleet.actors import RemoteClient
    from rollfleet.transport.messages import SamplingParams

    async def main():
        lease = None if sys.argv[2] == "none" else float(sys.argv[2])
        client = RemoteClient(sys.argv[1], lease_s=lease)
        calls = [asyncio.create_task(client.generate(f"r{i}", [1], SamplingParams(max_tokens=100_000)))
                 for i in range(3)]
        await asyncio.sleep(0.3)
        print("sent", flush=True)
        await asyncio.sleep(3600)  # killed before this ends, never closed

    asyncio.run(main())
""")


def echo_fleet() -> Supervisor:
    return Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 20}))


async def start_client(address: str, lease: str, tmp_path) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, address, lease], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.stdout is not None
    assert (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)).strip() == "sent"
    return proc


async def test_a_client_process_killed_with_a_lease_leaves_nothing_running_one_without_a_lease_does(tmp_path):
    async with echo_fleet() as sup:
        leased = await start_client(sup.frontend_address, "2.0", tmp_path)
        try:
            assert await wait_for(lambda: len(sup.table) == 3, 10)
            await asyncio.sleep(4.5)  # over two leases: its keep-alive hellos hold it
            assert len(sup.table) == 3 and (await sup.stats(engines=False))["num_leases"] == 1
        finally:
            leased.kill()
            leased.wait()
        assert await wait_for(lambda: len(sup.table) == 0, 15)  # lease_s + a check, then aborted
        stats = await sup.stats(engines=False)
        assert stats["num_leases"] == 0 and stats["num_leases_expired"] == 1
        assert sup.counters["aborted"] == 3 and sup.counters["completed"] == 0

        # The same client without a lease: the fleet cannot tell that it is gone (PROTOCOL.md 1).
        plain = await start_client(sup.frontend_address, "none", tmp_path)
        plain.kill()
        plain.wait()
        assert await wait_for(lambda: len(sup.table) == 3, 10)
        await asyncio.sleep(2.5)
        assert len(sup.table) == 3 and (await sup.stats(engines=False))["num_leases_expired"] == 1
        for entry in list(sup.table):
            sup.abort(entry.origin, entry.request_id)


async def test_a_remote_client_keeps_its_lease_while_its_requests_run_for_many_leases():
    async with echo_fleet() as sup:
        async with RemoteClient(sup.frontend_address, lease_s=1.0) as client:
            # 60 tokens at 20 tokens/s: 3 s, three leases; the keep-alive hellos renew it
            result = await client.generate("long", [3], SamplingParams(max_tokens=60))
            assert result.finish_reason == "length" and len(result.token_ids) == 60
            stats = await client.stats()
            assert stats["num_leases"] == 1 and stats["num_leases_expired"] == 0
            await asyncio.sleep(1.5)  # idle: still held
            assert (await client.stats())["num_leases_expired"] == 0


async def test_a_remote_client_dropped_without_close_is_collected_its_sockets_closed_and_its_lease_runs_out():
    # The loop's readers held the client: it was never collected while the loop ran, its two
    # sockets stayed open, and its keep-alive renewed the lease for as long as the process lived.
    import gc
    import weakref

    async with echo_fleet() as sup:
        async with RemoteClient(sup.frontend_address) as probe:
            await probe.stats()  # its own connection up before the count
            fds = len(os.listdir("/proc/self/fd"))

            async def use_and_drop() -> weakref.ref:
                client = RemoteClient(sup.frontend_address, lease_s=1.0)
                result = await client.generate("used", [3], SamplingParams(max_tokens=2))
                assert result.token_ids == echo_tokens([3], 2)
                return weakref.ref(client)

            dropped = [await use_and_drop() for _ in range(5)]
            gc.collect()
            assert [ref() for ref in dropped] == [None] * 5
            # Each used client held its sockets' fds and its TCP connection's, on both ends (closed
            # by ZeroMQ's I/O thread, in a moment).
            assert await wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds, 10)
            deadline = time.monotonic() + 10
            while (stats := await probe.stats())["num_leases"] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert stats["num_leases"] == 0 and stats["num_leases_expired"] == 5


async def test_a_remote_client_whose_loop_was_held_past_its_lease_gets_its_requests_aborted_then_a_new_lease():
    # The fleet runs on a loop of its own, which goes on while this one is held.
    with SyncClient(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 20})) as fleet:
        async with RemoteClient(fleet.frontend_address, lease_s=1.0) as client:
            call = asyncio.create_task(client.generate("long", [1], SamplingParams(max_tokens=LONG)))
            assert await wait_for(lambda: fleet.stats()["num_inflight"] == 1, 10)
            time.sleep(3.5)  # this loop is held: no keep-alive goes out
            result = await asyncio.wait_for(call, 10)
            assert result.finish_reason == "abort" and 0 < len(result.token_ids) < LONG
            assert fleet.stats()["num_leases_expired"] == 1
            # the next keep-alive takes a new lease (lease_s / 3 later)
            assert await wait_for(lambda: fleet.stats()["num_leases"] == 1, 10)


async def test_hello_with_lease_s_over_the_wire_aborts_a_silent_clients_requests_and_a_plain_hello_drops_it():
    async with echo_fleet() as sup:
        raw = RawClient(sup.frontend_address)
        try:
            await raw.send(msgpack.packb({"v": 1, "type": "hello", "id": "h1", "lease_s": 0.5}))
            assert (await raw.answers({"h1"}))["h1"]["data"] == {"batch": False, "max_message_bytes": 64 << 20,
                                                                  "lease_s": 0.5}
            await raw.send(generate("r1", [1], LONG))
            # Silent from now on, still connected: the abort's result reaches it.
            t0 = time.monotonic()
            result = (await raw.answers({"r1"}, timeout=20))["r1"]
            assert result["type"] == "result" and result["finish_reason"] == "abort"
            assert 0.5 <= time.monotonic() - t0 < 15
            stats = await sup.stats(engines=False)
            assert stats["num_leases"] == 0 and stats["num_leases_expired"] == 1

            # A bad lease_s is refused, and takes no lease.
            for i, bad in enumerate([0, -1.0, "30", True, math.nan, math.inf, 86_401, [1]]):
                await raw.send(msgpack.packb({"v": 1, "type": "hello", "id": f"bad{i}", "lease_s": bad}))
                answer = (await raw.answers({f"bad{i}"}))[f"bad{i}"]
                assert answer["type"] == "error" and answer["code"] == "bad_field", (bad, answer)
                assert "lease_s" in answer["message"]
            assert (await sup.stats(engines=False))["num_leases"] == 0

            # A hello without lease_s drops the lease the one before took.
            await raw.send(codec.encode(Hello(id="h2", batch=False, lease_s=0.5)))
            await raw.send(codec.encode(Hello(id="h3", batch=False)))
            answers = await raw.answers({"h2", "h3"})
            assert answers["h2"]["data"]["lease_s"] == 0.5 and "lease_s" not in answers["h3"]["data"]
            await raw.send(generate("r2", [1], LONG))
            assert await wait_for(lambda: len(sup.table) == 1, 10)
            await asyncio.sleep(2.0)
            assert len(sup.table) == 1 and (await sup.stats(engines=False))["num_leases_expired"] == 1
            assert sup.abort(next(iter(sup.table)).origin, "r2")
        finally:
            raw.close()


async def test_any_frame_of_the_client_renews_its_lease_a_bad_one_included():
    async with echo_fleet() as sup:
        raw = RawClient(sup.frontend_address)
        try:
            await raw.send(codec.encode(Hello(id="h", lease_s=1.5)))
            await raw.answers({"h"})
            await raw.send(generate("r", [1], LONG))
            assert await wait_for(lambda: len(sup.table) == 1, 10)
            for i in range(10):  # 3 s of frames the fleet cannot read, 0.3 s apart
                await raw.send(b"\xc1")
                await asyncio.sleep(0.3)
            assert len(sup.table) == 1 and (await sup.stats(engines=False))["num_leases_expired"] == 0
            result = (await raw.answers({"r"}, timeout=20))["r"]  # then silence
            assert result["finish_reason"] == "abort"
        finally:
            raw.close()


def test_a_remote_client_refuses_a_lease_the_fleet_would_refuse():
    for bad in (0, -1, math.nan, math.inf, 86_401, True, "30"):
        with pytest.raises(ValueError, match="lease_s"):
            RemoteClient("tcp://127.0.0.1:9", lease_s=bad)  # type: ignore[arg-type]


async def test_a_remote_client_says_so_when_the_fleet_holds_no_lease(caplog):
    # A fleet from before leases answers hello without the key (it ignores the field).
    hellos: list[float] = []

    def answer(frame: bytes) -> bytes:
        msg = codec.decode([frame])
        if isinstance(msg, Hello):
            hellos.append(time.monotonic())
            return codec.encode(Reply(id=msg.id, data={"batch": False}))
        # (a generate)
        return codec.encode(Error(id=msg.id, code="engine_error", message="no engine here", request_id=msg.id))

    async with stand_in_fleet(answer) as address:
        with caplog.at_level(logging.WARNING, logger="rollfleet"):
            async with RemoteClient(address, lease_s=0.3) as client:
                with pytest.raises(RolloutError, match="no engine here"):  # after its hello
                    await client.generate("g", [1], SamplingParams(max_tokens=1))
                await asyncio.sleep(1.0)  # three keep-alives' time: none goes to a fleet that holds no lease
        assert len(hellos) == 1
        assert any("holds no lease" in r.getMessage() for r in caplog.records)
