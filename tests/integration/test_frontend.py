"""The client socket against bad input, as a client written from PROTOCOL.md sees it: a real
supervisor with echo workers, raw ZeroMQ DEALERs, frames built byte by byte where no msgpack
library would write them."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest
import zmq
import zmq.asyncio

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.engines.echo import echo_tokens
from rollfleet.transport import codec
from rollfleet.transport.messages import Generate, SamplingParams

from ..helpers import wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")

LOGGER = "rollfleet.actors.supervisor"
NOT_UTF8 = b"\x83\xa1v\x01\xa4type\xa5stats\xa2id\xa2\xff\xfe"  # {"v": 1, "type": "stats", "id": <not UTF-8>}


def fleet() -> Supervisor:
    return Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 0}))


def generate(rid: str, prompt: list[int], max_tokens: int) -> bytes:
    return codec.encode(Generate(id=rid, prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens)))


def batch(*members: bytes, batch_id: str = "B", version: int = 1) -> bytes:
    """A batch frame around messages given as bytes, any bytes."""
    head = b"".join(map(msgpack.packb, ("v", version, "type", "batch", "id", batch_id, "messages")))
    return b"\x84" + head + bytes((0x90 | len(members),)) + b"".join(members)


class Dealer:
    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    async def answers(self, n: int, timeout: float = 20.0) -> list[dict]:
        """The next ``n`` final answers (reply, result or error), in the order they came."""
        got: list[dict] = []
        while len(got) < n:
            msg = msgpack.unpackb(await asyncio.wait_for(self.sock.recv(), timeout), raw=False)
            if msg["type"] in ("reply", "result", "error"):
                got.append(msg)
        return got

    async def silent(self, seconds: float) -> bool:
        return not await self.sock.poll(int(seconds * 1000))


async def test_a_bad_message_in_a_client_batch_is_answered_under_its_own_id_and_the_others_run():
    async with fleet() as sup:
        client = Dealer(sup.frontend_address)
        try:
            await client.sock.send(batch(
                msgpack.packb({"v": 1, "type": "stats", "id": "m1", 7: 1}),
                msgpack.packb({"v": 1, "type": "abort", "id": "m2", "request_id": "zz"}),
                generate("ok1", [1, 2], 3),
                msgpack.packb({"v": 1, "type": "generate", "id": "g1", "prompt_ids": [1], "sampling": {7: 1}}),
                NOT_UTF8,
                msgpack.packb({"v": 1, "type": "abort_all", "id": "s1", "added_later": {None: 1}}),
                generate("ok2", [3], 2),
            ))
            got = {(a["id"], a["type"], a.get("code")) for a in await client.answers(7)}
            assert got == {("m1", "error", "bad_field"), ("m2", "error", "unknown_request"), ("ok1", "result", None),
                           ("g1", "error", "bad_field"), ("", "error", "bad_frame"), ("s1", "error", "bad_field"),
                           ("ok2", "result", None)}
            assert sup.counters["completed"] == 2 and sup._drops.counts["bad_client_frame"] == 4
            # the valid requests ran as they would alone
            await client.sock.send(batch(msgpack.packb({"v": 1, "type": "stats", "id": "x", 7: 1}),
                                         generate("ok3", [1, 2], 3)))
            second = await client.answers(2)
            assert second[1]["id"] == "ok3" and second[1]["token_ids"] == echo_tokens([1, 2], 3)
        finally:
            client.close()


async def test_an_error_about_a_client_batch_itself_carries_the_empty_id_and_nothing_in_it_runs():
    async with fleet() as sup:
        client = Dealer(sup.frontend_address)
        try:
            inside = generate("r", [1], 1)
            cases = [  # (frame, code): one error each, under ""
                (msgpack.packb({"v": 1, "type": "batch", "id": "B", b"k": 1,
                                "messages": [msgpack.unpackb(inside)]}), "bad_field"),
                (batch(inside, batch_id="b12", version=2), "version_mismatch"),
                (msgpack.packb({"v": 1, "type": "batch", "id": "B", 7: 1, "messages": [msgpack.unpackb(inside)]}),
                 "bad_field"),
                # its id is ignored, but a header has one, a str (PROTOCOL.md 3)
                (msgpack.packb({"v": 1, "type": "batch", "messages": [msgpack.unpackb(inside)]}), "bad_field"),
                (msgpack.packb({"v": 1, "type": "batch", "id": None, "messages": [msgpack.unpackb(inside)]}),
                 "bad_field"),
                (msgpack.packb({"v": 1, "type": "batch", "id": 7, "messages": [msgpack.unpackb(inside)]}), "bad_field"),
            ]
            for frame, code in cases:
                await client.sock.send(frame)
                (answer,) = await client.answers(1)
                assert (answer["type"], answer["id"], answer["code"]) == ("error", "", code), answer
            assert await client.silent(0.3)
            assert sup.counters["completed"] == 0
        finally:
            client.close()


async def test_bad_client_input_is_logged_at_warning_a_few_lines_then_a_count(caplog):
    # `rollfleet serve` logs at WARNING by default: bad input must show there, but no flood of it
    caplog.set_level(logging.WARNING, logger="rollfleet")

    def lines(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]

    async with fleet() as sup:
        client = Dealer(sup.frontend_address)
        try:
            await client.sock.send(msgpack.packb({"v": 1, "type": "generate", "id": "bad0", "prompt_ids": "x"}))
            await client.answers(1)
            (first,) = lines("bad client message")
            assert first.levelno == logging.WARNING and "prompt_ids" in first.getMessage()
            for i in range(1, 50):
                await client.sock.send(b"\xc1")
            await client.answers(49)
            assert len(lines("bad client message")) == 5  # LogLimiter's burst
            assert await wait_for(lambda: lines("more bad_client_frame events"), timeout=15)
            (count,) = lines("more bad_client_frame events")
            assert count.levelno == logging.WARNING and count.getMessage().startswith("45 more")
            assert sup._drops.counts["bad_client_frame"] == 50
        finally:
            client.close()


async def test_a_second_client_under_an_identity_in_use_is_never_read():
    # PROTOCOL.md 1: no ZMQ_ROUTER_HANDOVER on the client socket
    async with fleet() as sup:
        first = Dealer(sup.frontend_address, identity=b"same")
        second = None
        try:
            await first.sock.send(generate("a", [1], 1))
            assert (await first.answers(1))[0]["type"] == "result"  # connected before the second one is made
            second = Dealer(sup.frontend_address, identity=b"same")
            await second.sock.send(generate("b", [1], 1))
            assert await second.silent(1.0) and await first.silent(0.1)
            first.close()
            await second.sock.send(generate("c", [1], 1))
            assert await second.silent(1.0)
            assert sup.counters["completed"] == 1
        finally:
            for dealer in (first, second):
                if dealer is not None and not dealer.sock.closed:
                    dealer.close()


async def test_a_client_that_reconnects_under_its_own_identity_gets_its_old_requests_answers_and_can_abort_them():
    # 100 tokens/s: "long" runs for 20 s unless aborted, "short" ends 1 s after it starts, once
    # the client is connected again (an answer sent while no connection has the identity is lost).
    config = FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 100})
    async with Supervisor(config) as sup:
        first = Dealer(sup.frontend_address, b"me")
        await first.sock.send(generate("long", [1], 2000))
        await first.sock.send(generate("short", [2], 100))
        assert await wait_for(lambda: len(sup.table) == 2, 10)
        first.close()
        second = None
        for _ in range(50):  # the old connection is seen gone within a moment: until then, unread
            second = Dealer(sup.frontend_address, b"me")
            await second.sock.send(msgpack.packb({"v": 1, "type": "stats", "id": "s"}))
            if await second.sock.poll(200):
                break
            second.close()
            second = None
        assert second is not None, "the identity was never read again after its connection closed"
        try:
            await second.sock.send(msgpack.packb({"v": 1, "type": "abort", "id": "a", "request_id": "long"}))
            got = {m["id"]: m for m in await second.answers(4)}  # stats, abort, both results
            assert got["s"]["type"] == "reply" and got["a"]["type"] == "reply"
            assert got["short"]["type"] == "result"
            assert got["short"]["token_ids"] == echo_tokens([2], 100)
            assert got["long"]["type"] == "result" and got["long"]["finish_reason"] == "abort"
            assert got["long"]["token_ids"] == echo_tokens([1], len(got["long"]["token_ids"]))
            assert len(sup.table) == 0
        finally:
            second.close()
