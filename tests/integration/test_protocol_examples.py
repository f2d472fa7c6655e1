"""PROTOCOL.md section 10 shows the bytes of a real exchange: this replays them against a real
supervisor with an echo worker, so that the page cannot drift from what the fleet sends.

The hex blocks are read from the page itself, in the order it gives them: the streamed request
r1, its three chunks and its result; the smallest valid request r2; the malformed request r3 and
its error; the abort x1 of an unknown request and its error. Answers must match byte for byte,
except the values of a result's timings (they differ from run to run): there the keys, their
order and the encoded length must match.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.transport import codec
from rollfleet.transport.messages import Generate, SamplingParams

pytestmark = pytest.mark.usefixtures("no_leaks")

PROTOCOL = Path(__file__).resolve().parents[2] / "PROTOCOL.md"
HEX_BLOCK = re.compile(r"```\n((?:[0-9a-f]+\n)+)```")


def section_10_blocks() -> list[bytes]:
    text = PROTOCOL.read_text()
    start = text.index("The bytes of a real exchange")
    end = text.index("Two complete clients written from this page", start)
    return [bytes.fromhex("".join(block.split())) for block in HEX_BLOCK.findall(text[start:end])]


def unpack(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False)


def without_timing_values(frame: bytes) -> dict:
    msg = unpack(frame)
    msg["timings"] = list(msg["timings"])  # the keys, in wire order
    return msg


def test_the_page_holds_the_blocks_this_test_reads():
    blocks = section_10_blocks()
    assert len(blocks) == 10
    assert [unpack(b)["type"] for b in blocks] == ["generate", "chunk", "chunk", "chunk", "result",
                                                   "generate", "generate", "error", "abort", "error"]


def test_the_documented_request_is_what_the_python_codec_writes():
    request = section_10_blocks()[0]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    assert codec.encode(Generate(id="r1", prompt_ids=[1, 2, 3], sampling=params, stream=True)) == request


async def test_a_real_fleet_answers_the_documented_requests_with_the_documented_bytes():
    (r1, chunk1, chunk2, chunk3, result1, r2, r3, error3, x1, error9) = section_10_blocks()
    config = FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 0})
    async with Supervisor(config) as sup:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sup.frontend_address)
        try:
            async def next_frame() -> bytes:
                return await asyncio.wait_for(sock.recv(), 20)

            await sock.send(r1)
            got = [await next_frame() for _ in range(4)]
            assert got[:3] == [chunk1, chunk2, chunk3]
            assert without_timing_values(got[3]) == without_timing_values(result1)
            assert len(got[3]) == len(result1)  # every float is written in 9 bytes

            await sock.send(r2)
            result2 = unpack(await next_frame())
            assert (result2["type"], result2["id"], len(result2["token_ids"])) == ("result", "r2", 2)

            await sock.send(r3)
            assert await next_frame() == error3
            await sock.send(x1)
            assert await next_frame() == error9
        finally:
            sock.close(0)
            ctx.term()
