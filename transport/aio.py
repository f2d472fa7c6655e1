"""A ZeroMQ socket driven by an asyncio loop without a future per message.

zmq.asyncio creates a future for every send and recv. Here a reader callback drains every
waiting message in one go and hands each to a handler, and sends are plain non-blocking
sends (rollfleet sockets have no high-water mark, so a send never blocks).

The ZeroMQ FD is edge-triggered: a send, a recv or a ``ZMQ_EVENTS`` query may consume the
notice of an incoming message. So a send made outside a drain is followed, once per loop
iteration, by a check for messages; a drain checks again after its handler anyway.

``post`` sends the first message a peer gets in a loop iteration at once and queues the
ones after it: at the end of the iteration they go out as one ``batch`` message (cut at
BATCH_COUNT messages or BATCH_BYTES). Under load that turns dozens of sends and receives
into one each (ZeroMQ's per-message cost, a wake-up of its I/O thread, is most of what a
small message costs), while a request made alone still leaves without waiting. ``send``
sends the queues first, so a peer always gets messages in the order they were given.

Per call (pyzmq 27): a non-blocking recv that finds nothing raises ``zmq.Again`` (~3 us
with the exception), a ``ZMQ_EVENTS`` query costs ~1.3 us, and pyzmq's ``recv_multipart``
and ``send_multipart`` cost about twice the plain calls they make. So checks ask
``ZMQ_EVENTS`` where one message or none is the likely answer, and a drain reads on until
``zmq.Again`` only once a second message is waiting.

``wait_within`` is ``asyncio.wait_for`` without the flaw it has before Python 3.12: there, a
task cancelled in the loop iteration in which what it waits for finishes gets the result,
and the cancel is lost (the task runs on; an ``asyncio.timeout`` around it never fires).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import zmq

from .codec import batch_frame

__all__ = ["LoopSocket", "wait_within"]

logger = logging.getLogger(__name__)

# A batch is sent early once its messages reach this many bytes: it stays far below any
# receiver's header limit, and a big prompt does not wait for the iteration to end.
BATCH_BYTES = 1 << 20
# ... or once it holds this many: the peer starts on them while this side makes the rest
# (one batch of everything would leave one side idle while the other works).
BATCH_COUNT = 32

# Plain ints: pyzmq's constants are enum.IntFlag, and `events & zmq.POLLIN` runs IntFlag's
# Python-level __rand__ (~1 us).
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class LoopSocket:
    """``handler`` gets each message as a list of frames: bytes, or zmq.Frame with copy=False."""

    def __init__(self, sock: zmq.Socket, handler: Callable[[list[Any]], None], *,
                 loop: asyncio.AbstractEventLoop | None = None, copy: bool = True, max_batch: int = 4096,
                 on_post_error: Callable[[bytes | None, zmq.ZMQError], None] | None = None):
        """``on_post_error(route, exc)`` hears of a posted batch that could not be sent (the
        peer is gone: EHOSTUNREACH on a ROUTER_MANDATORY socket); by default it is logged."""
        self.sock = sock
        self._handler = handler
        self._loop = loop or asyncio.get_running_loop()
        self._copy = copy
        self._max_batch = max_batch
        self._drain_scheduled = False
        self._draining = False
        self._closed = False
        self.batch_bytes = BATCH_BYTES  # a batch is sent early once its messages reach this many bytes
        # Posted messages: route (None on a DEALER) -> [encoded messages, their total bytes]
        self._posted: dict[bytes | None, list[Any]] = {}
        self._turn_scheduled = False
        self._sent: set[bytes | None] = set()  # peers that got a message this loop iteration
        self._on_post_error = on_post_error
        # The backend's send, under pyzmq's Python-level wrapper (which only adds the
        # routing_id and group options of draft sockets): half the cost per frame.
        self._send = super(zmq.Socket, sock).send if isinstance(sock, zmq.Socket) else sock.send
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain_after_send)

    def _drain_after_send(self) -> None:
        self._drain_scheduled = False
        # Usually nothing has arrived since the send: asking is cheaper than a failing recv.
        if not self._closed and self.sock.getsockopt(_EVENTS) & _POLLIN:
            self._drain()

    def _recv(self) -> list[Any]:
        # Frame.more is free, getsockopt(RCVMORE) is not; .bytes copies as copy=True would.
        recv = self.sock.recv
        frame = recv(_NOBLOCK, copy=False)
        if not self._copy:
            frames = [frame]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            return frames
        frames = [frame.bytes]
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)
            frames.append(frame.bytes)
        return frames

    def _drain(self) -> None:
        if self._closed or self._draining:
            return
        sock = self.sock
        handler = self._handler
        self._draining = True
        try:
            for n in range(self._max_batch):
                try:
                    frames = self._recv()
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    if not self._closed:
                        logger.error("recv failed: %s", exc)
                    return
                try:
                    handler(frames)
                except Exception:
                    logger.exception("message handler failed")
                if self._closed:
                    return
                # One message per wake-up is the common case at low load: ask once rather
                # than fail a recv; with more waiting, read on until zmq.Again.
                if n == 0 and not sock.getsockopt(_EVENTS) & _POLLIN:
                    return
        finally:
            self._draining = False
        # Batch limit reached with messages left: yield to other tasks, then go on.
        self._schedule_drain()

    def post(self, route: bytes | None, encoded: bytes) -> None:
        """Send one encoded message (a header frame without buffers) to ``route``: a peer's
        identity on a ROUTER, None on a DEALER. The first one a peer gets in a loop iteration
        goes at once; the ones after it wait for the end of the iteration and go together,
        in order. Send errors go to on_post_error."""
        queue = self._posted.get(route)
        if queue is None:
            if not self._turn_scheduled:
                self._turn_scheduled = True
                self._loop.call_soon(self._end_turn)
            if route not in self._sent:
                self._sent.add(route)
                self._send_posted(route, [encoded])
                return
            self._posted[route] = [[encoded], len(encoded)]
            return
        if queue[1] + len(encoded) > self.batch_bytes:  # full: it goes now, and this message starts the next
            self._posted[route] = [[encoded], len(encoded)]
            self._send_posted(route, queue[0])
            return
        items = queue[0]
        items.append(encoded)
        queue[1] += len(encoded)
        if len(items) >= BATCH_COUNT:
            del self._posted[route]
            self._send_posted(route, items)

    def _end_turn(self) -> None:
        self._turn_scheduled = False
        self.flush()
        self._sent.clear()

    def flush(self) -> None:
        """Send every posted message now (harmless at any time)."""
        while self._posted:
            posted, self._posted = self._posted, {}
            for route, (items, _) in posted.items():
                self._send_posted(route, items)

    def _send_posted(self, route: bytes | None, items: list[bytes]) -> None:
        if self._closed:
            return
        frame = items[0] if len(items) == 1 else batch_frame(items)
        try:
            self._send_now([frame] if route is None else [route, frame])
        except zmq.ZMQError as exc:
            if self._on_post_error is not None:
                self._on_post_error(route, exc)
            else:
                logger.warning("dropped %d message(s) for %r: %s", len(items), route, exc)

    def send(self, frames: list[Any], copy: bool = True) -> None:
        """Send one multipart message now, after anything posted. Raises zmq.ZMQError
        (e.g. EHOSTUNREACH)."""
        if self._posted:
            self.flush()
        self._send_now(frames, copy)

    def _send_now(self, frames: list[Any], copy: bool = True) -> None:
        send = self._send
        last = len(frames) - 1
        try:
            for i in range(last):
                send(frames[i], _MORE, copy=copy)
            send(frames[last], _NOBLOCK, copy=copy)
        finally:
            # Any call on the socket, a failed send included (EHOSTUNREACH to a gone peer),
            # may take the edge of its fd's readiness: look for input that came meanwhile.
            if not self._draining:  # a drain in progress checks again after its handler returns
                self._schedule_drain()

    def close(self, linger: int = 0) -> None:
        """Send what is posted, then close (``linger`` ms to deliver it)."""
        if self._closed:
            return
        if self._posted:
            self.flush()
        self._closed = True
        try:
            self._loop.remove_reader(self._fd)
        except Exception:
            pass
        self.sock.close(linger=linger)


_T = TypeVar("_T")

if sys.version_info >= (3, 12):
    wait_within = asyncio.wait_for  # built on asyncio.timeout since 3.12: a cancel always counts
elif sys.version_info >= (3, 11):
    async def wait_within(aw: Awaitable[_T], timeout: float | None) -> _T:
        """``await aw``, or asyncio.TimeoutError after ``timeout`` seconds (None: no limit),
        ``aw`` cancelled then; a cancel of the caller is raised even when ``aw`` has just finished."""
        async with asyncio.timeout(timeout):
            return await aw
else:
    async def wait_within(aw: Awaitable[_T], timeout: float | None) -> _T:
        """As above, with a timer of its own (3.10 has no asyncio.timeout). A cancel from
        elsewhere that lands in the very iteration the timer fires is taken for the timeout."""
        if timeout is None:
            return await aw
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def expire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(max(timeout, 0.0), expire)
        try:
            return await aw
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            timer.cancel()
