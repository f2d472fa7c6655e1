"""LoopSocket over real ZeroMQ sockets: posted messages go out in order, batched per peer."""

import asyncio
import time

import msgpack
import pytest
import zmq

from rollfleet.transport import aio, codec
from rollfleet.transport.aio import LoopSocket
from rollfleet.transport.messages import Batch, Chunk, Stats

from ..helpers import wait_until


@pytest.fixture
def pair(tmp_path):
    """A ROUTER (driven by LoopSocket in the test) and a plain DEALER peer named b'peer'."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/t.sock"
    router.bind(addr)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(addr)
    dealer.send(b"hello")
    assert router.poll(5000)
    assert router.recv_multipart() == [b"peer", b"hello"]
    yield router, dealer
    dealer.close()
    router.close()
    ctx.term()


def received(dealer, expect, timeout=2.0):
    """The messages at the dealer, each as its list of decoded messages: up to `timeout` seconds
    for `expect` decoded messages in all, then whatever else comes within 50 ms (a test that sees
    more than it expects fails on it)."""
    out = []

    def read() -> bool:
        while dealer.poll(0):
            msg = codec.decode([dealer.recv()])
            out.append(codec.unbatch(msg) if isinstance(msg, Batch) else [msg])
        return sum(map(len, out)) >= expect

    wait_until(read, timeout)
    dealer.poll(50)
    read()
    return out


async def test_the_first_post_goes_at_once_and_the_rest_of_the_iteration_as_one_batch(pair):
    router, dealer = pair
    lsock = LoopSocket(router, lambda frames: None)
    msgs = [Chunk(id=f"r{i}", token_ids=[i]) for i in range(10)]
    for m in msgs:
        lsock.post(b"peer", codec.encode(m))
    assert dealer.poll(2000)  # the first, before the loop iteration ends
    assert codec.decode([dealer.recv()]) == msgs[0]
    assert not dealer.poll(50)  # the others wait for it
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert received(dealer, len(msgs) - 1) == [msgs[1:]]
    # A new iteration: its first message goes alone again.
    lsock.post(b"peer", codec.encode(Stats(id="s1")))
    assert dealer.poll(2000)
    assert msgpack.unpackb(dealer.recv())["type"] == "stats"
    lsock.close()


async def test_batches_are_cut_by_count_and_by_bytes(pair):
    router, dealer = pair
    lsock = LoopSocket(router, lambda frames: None)
    msgs = [Chunk(id=f"r{i}", token_ids=[i]) for i in range(1 + aio.BATCH_COUNT * 2 + 3)]
    for m in msgs:
        lsock.post(b"peer", codec.encode(m))
    await asyncio.sleep(0.01)
    got = received(dealer, len(msgs))
    assert [len(b) for b in got] == [1, aio.BATCH_COUNT, aio.BATCH_COUNT, 3]
    assert [m for b in got for m in b] == msgs

    lsock.batch_bytes = 3000  # (aio.BATCH_BYTES by default)
    big = [Chunk(id=f"b{i}", token_ids=list(range(1000, 1500))) for i in range(5)]  # ~1.5 kB each
    for m in big:
        lsock.post(b"peer", codec.encode(m))
    await asyncio.sleep(0.01)
    got = received(dealer, len(big))
    assert [len(b) for b in got] == [1, 1, 1, 1, 1] and [b[0] for b in got] == big
    lsock.close()


async def test_send_goes_after_what_was_posted_and_close_flushes(pair):
    router, dealer = pair
    lsock = LoopSocket(router, lambda frames: None)
    lsock.post(b"peer", codec.encode(Stats(id="zeroth")))  # goes at once
    assert dealer.poll(2000)
    assert msgpack.unpackb(dealer.recv())["id"] == "zeroth"
    lsock.post(b"peer", codec.encode(Stats(id="first")))
    lsock.send([b"peer", codec.encode(Stats(id="second")), b"bulk"])
    lsock.post(b"peer", codec.encode(Stats(id="third")))
    lsock.close(linger=1000)  # before any loop iteration: close sends it
    assert dealer.poll(2000)
    assert msgpack.unpackb(dealer.recv())["id"] == "first"
    assert dealer.poll(2000)
    frames = dealer.recv_multipart()
    assert msgpack.unpackb(frames[0])["id"] == "second" and frames[1] == b"bulk"
    assert dealer.poll(2000)
    assert msgpack.unpackb(dealer.recv())["id"] == "third"


async def test_a_post_to_a_gone_peer_reaches_the_error_callback_and_others_still_go(pair):
    router, dealer = pair
    errors = []
    lsock = LoopSocket(router, lambda frames: None, on_post_error=lambda route, exc: errors.append((route, exc.errno)))
    for i in range(3):  # at once, then batched
        lsock.post(b"nobody", codec.encode(Stats(id=f"lost{i}")))
        lsock.post(b"peer", codec.encode(Stats(id=f"kept{i}")))
    await asyncio.sleep(0.01)
    assert errors == [(b"nobody", zmq.EHOSTUNREACH)] * 2
    assert received(dealer, 3) == [[Stats(id="kept0")], [Stats(id="kept1"), Stats(id="kept2")]]
    lsock.close()


async def test_input_that_came_during_a_failed_send_is_still_read(pair):
    # A send that fails (EHOSTUNREACH: the peer is gone) processes the socket's events as a good
    # one does, so the fd's edge for a message that arrived meanwhile is gone: the socket must
    # look for input after it, or that message waits for the next unrelated wake-up.
    router, dealer = pair
    got = []
    lsock = LoopSocket(router, got.append)
    await asyncio.sleep(0.01)
    dealer.send(b"meanwhile")
    deadline = time.monotonic() + 5
    while not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # it arrived; the loop has not run
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(zmq.ZMQError):
        lsock.send([b"nobody", b"x"])
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got == [[b"peer", b"meanwhile"]]
    lsock.close()


# ---- wait_within: asyncio.wait_for whose caller's cancel is never lost


async def test_wait_within_raises_a_cancel_that_lands_in_the_iteration_its_future_finishes():
    # Before Python 3.12, asyncio.wait_for returns the result here and the cancel is lost.
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    task = asyncio.ensure_future(aio.wait_within(fut, 30))
    await asyncio.sleep(0)  # the task waits on fut

    def answer_then_cancel() -> None:
        fut.set_result("late")
        task.cancel()

    loop.call_soon(answer_then_cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_within_gives_the_result_and_waits_without_limit_for_none():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_later(0.05, fut.set_result, 7)
    assert await aio.wait_within(fut, None) == 7

    async def work() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert await aio.wait_within(work(), 5) == "done"


async def test_wait_within_times_out_and_cancels_what_it_waited_for():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    with pytest.raises(asyncio.TimeoutError):
        await aio.wait_within(fut, 0.05)
    assert fut.cancelled()
    finished = []

    async def slow() -> None:
        await asyncio.sleep(0.2)
        finished.append(True)

    with pytest.raises(asyncio.TimeoutError):
        await aio.wait_within(slow(), 0)  # nothing left: it times out, not after the sleep
    await asyncio.sleep(0.3)
    assert finished == []  # stopped, not left running


async def test_a_cancel_of_the_caller_reaches_what_wait_within_waits_for():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    task = asyncio.ensure_future(aio.wait_within(fut, 30))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):  # a cancel, not taken for the timeout
        await task
    assert fut.cancelled()
