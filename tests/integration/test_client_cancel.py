"""A RemoteClient's caller cancelled in the very loop iteration its answer lands, or its
request goes out, gets the cancel, as with any other timing: the call raises CancelledError,
and a request sent meanwhile is stopped on the fleet. (With ``asyncio.wait_for`` before Python
3.12 the call returned instead, as if never cancelled, and a request ran on to its end.) Real
supervisor, real echo workers; the cancel is made from RemoteClient's own hooks."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.transport.messages import Reply, SamplingParams

from ..helpers import wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")


def fleet(tokens_per_s: float = 0) -> Supervisor:
    return Supervisor(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": tokens_per_s}))


class CancellingClient(RemoteClient):
    """Cancels ``target`` in the callback that answers a call, or right after a request is posted."""

    target: asyncio.Task | None = None
    on: str = ""
    completions_left = 0  # with on == "complete": cancel at the last of these

    def _on_message(self, msg):  # type: ignore[no-untyped-def]
        super()._on_message(msg)
        if self.on == "reply" and isinstance(msg, Reply) and self.target is not None:
            self.target.cancel()

    def _start(self, *args):  # type: ignore[no-untyped-def]
        super()._start(*args)
        if self.on == "sent" and self.target is not None:
            self.target.cancel()

    def on_complete(self, result):  # type: ignore[no-untyped-def]
        if self.on == "complete" and self.target is not None:
            self.completions_left -= 1
            if self.completions_left == 0:
                self.target.cancel()  # then the batch's last slot is filled, in this callback


async def test_a_call_cancelled_as_its_reply_lands_raises_the_cancel():
    async with fleet() as sup:
        client = CancellingClient(sup.frontend_address)
        await client.stats()  # hello done
        task = asyncio.ensure_future(client.stats())
        client.target, client.on = task, "reply"
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        client.on = ""
        assert "num_completed" in await client.stats()  # the client goes on working
        await client.close()


async def test_a_first_generate_cancelled_as_it_goes_out_after_hello_is_aborted_on_the_fleet():
    async with fleet(tokens_per_s=20) as sup:
        client = CancellingClient(sup.frontend_address)
        task = asyncio.ensure_future(client.generate("g", [1, 2], SamplingParams(max_tokens=100_000)))
        client.target, client.on = task, "sent"  # the generate waits for hello, then sends
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # not left to run its 100,000 tokens
        client.on = ""
        assert await wait_for(lambda: sup.counters["aborted"] == 1 and len(sup.table) == 0, 10)
        assert sup.counters["completed"] == 0
        await client.close()


async def test_a_batch_cancelled_as_its_last_result_lands_raises_the_cancel():
    async with fleet() as sup:
        client = CancellingClient(sup.frontend_address)
        await client.stats()  # hello done
        task = asyncio.ensure_future(client.generate_batch([[1], [2], [3]], SamplingParams(max_tokens=2)))
        client.target, client.on, client.completions_left = task, "complete", 3
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        client.on = ""
        assert await wait_for(lambda: len(sup.table) == 0, 10)
        assert len(await client.generate_batch([[4]], SamplingParams(max_tokens=2))) == 1
        await client.close()
