"""The receiver answers started buckets in order, as soon as their GPU work is done.

``GpuWork`` stands in for a torch.cuda.Event (query/synchronize, the two calls the receiver
makes); everything else is the real WeightReceiver."""

import asyncio

import pytest

from rollfleet.errors import EngineFailed
from rollfleet.weights import WeightReceiver

from weights_harness import StoreEngine

from ..helpers import wait_for


class GpuWork:
    """Stand-in for a torch.cuda.Event: done when ``ready`` is set, or raising ``error``."""

    def __init__(self) -> None:
        self.ready = False
        self.error: Exception | None = None

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.ready

    def synchronize(self) -> None:
        return None


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_buckets_are_answered_in_order_once_their_work_is_done():
    receiver = WeightReceiver(StoreEngine())
    answered = []
    first, second = GpuWork(), GpuWork()
    receiver.watch(first, lambda exc: answered.append(("first", exc)))
    receiver.watch(second, lambda exc: answered.append(("second", exc)))
    receiver.watch(None, lambda exc: answered.append(("done already", exc)))  # waits its turn
    second.ready = True
    await turns()
    assert answered == []  # the first is not done: nothing overtakes it
    first.ready = True
    assert await wait_for(lambda: len(answered) == 3)  # past FINISH_POLL_S, in a thread: more turns
    assert answered == [("first", None), ("second", None), ("done already", None)]
    receiver.watch(None, lambda exc: answered.append(("alone", exc)))  # nothing queued: at once
    assert answered[-1] == ("alone", None)
    receiver.close()


async def test_a_started_bucket_answers_those_done_before_it_without_a_turn_of_the_loop():
    """``start`` answers finished buckets first: a burst of buckets started back to back (no
    turn of the loop between them) does not hold back the answers of those already done."""
    from rollfleet.errors import InvalidRequest
    from rollfleet.transport.messages import WeightsBucket

    receiver = WeightReceiver(StoreEngine())
    answered = []
    work = GpuWork()
    receiver.watch(work, lambda exc: answered.append(exc))
    work.ready = True
    # Refused before the start awaits anything (no update is under way): the loop never
    # turned, so only the start itself can have answered the finished bucket.
    with pytest.raises(InvalidRequest):
        await receiver.start(WeightsBucket(id="u1.0", index=0, buffer=0, tensors=[]))
    assert answered == [None]
    receiver.close()


async def test_failed_gpu_work_fails_the_bucket_and_marks_the_weights_mixed():
    receiver = WeightReceiver(StoreEngine())
    receiver.version = 3
    answered = []
    work = GpuWork()
    work.error = RuntimeError("illegal memory access")
    receiver.watch(work, lambda exc: answered.append(exc))
    assert await wait_for(lambda: answered)
    assert len(answered) == 1 and isinstance(answered[0], EngineFailed)
    assert "illegal memory access" in str(answered[0])
    assert receiver.version == -1
    with pytest.raises(EngineFailed):
        other = GpuWork()
        other.error = RuntimeError("again")
        await asyncio.wait_for(receiver.finish(other), 5)
    receiver.close()
