"""The worker's inline start (actors.worker.start_inline, what EngineWorker._start runs for engines
that allow it): a request's coroutine runs up to its first suspension in the socket callback,
then a Task takes over from exactly there."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from rollfleet.actors.worker import start_inline

request = contextvars.ContextVar("request", default=None)


async def test_a_coroutine_that_never_suspends_finishes_inline_without_a_task():
    done = []

    async def quick():
        done.append(request.get())

    task = start_inline(quick())
    assert task is None and done == [None]


async def test_the_task_goes_on_from_the_first_suspension_in_the_same_context():
    gate = asyncio.get_running_loop().create_future()
    steps = []

    async def serve():
        request.set("r1")
        steps.append("first")
        value = await gate  # suspends: the rest runs in the task
        steps.append((value, request.get(), asyncio.current_task() is not None))
        await asyncio.sleep(0)  # a bare yield works too
        return "done"

    task = start_inline(serve())
    assert steps == ["first"] and request.get() is None  # the caller's context is untouched
    gate.set_result(42)
    assert await task == "done"
    assert steps == ["first", (42, "r1", True)]


async def test_a_cancel_before_the_task_runs_reaches_the_coroutine():
    gate = asyncio.get_running_loop().create_future()
    cleaned = []

    async def serve():
        try:
            await gate
        finally:
            cleaned.append(True)

    task = start_inline(serve())
    task.cancel()  # before the task's first step
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_an_exception_after_the_first_suspension_fails_the_task():
    gate = asyncio.get_running_loop().create_future()

    async def serve():
        await gate
        raise ValueError("engine broke")

    task = start_inline(serve())
    gate.set_result(None)
    with pytest.raises(ValueError, match="engine broke"):
        await task
