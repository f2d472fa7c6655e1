"""A ZeroMQ socket driven by an asyncio loop without a future per message.

zmq.asyncio creates a future for every send and recv. Here a reader callback drains every
waiting message in one go (non-blocking recv until EAGAIN) and hands each to a handler,
and sends are plain non-blocking sends (rollfleet sockets have no high-water mark, so a
send never blocks). The ZeroMQ FD is edge-triggered and a send can consume the edge of
an incoming message, so after sends a drain is scheduled once per loop iteration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["LoopSocket"]

logger = logging.getLogger(__name__)


class LoopSocket:
    def __init__(self, sock: zmq.Socket, handler: Callable[[list[Any]], None], *,
                 loop: asyncio.AbstractEventLoop | None = None, copy: bool = True, max_batch: int = 4096):
        self.sock = sock
        self._handler = handler
        self._loop = loop or asyncio.get_running_loop()
        self._copy = copy
        self._max_batch = max_batch
        self._drain_scheduled = False
        self._closed = False
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self.sock
        for _ in range(self._max_batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=self._copy)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                logger.error("recv failed: %s", exc)
                return
            try:
                self._handler(frames)
            except Exception:
                logger.exception("message handler failed")
            if self._closed:
                return
        # Batch limit reached with messages left: yield to other tasks, then go on.
        self._schedule_drain()

    def send(self, frames: list[Any], copy: bool = True) -> None:
        """Send one multipart message now. Raises zmq.ZMQError (e.g. EHOSTUNREACH)."""
        self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        self._schedule_drain()

    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.remove_reader(self._fd)
        except Exception:
            pass
        self.sock.close(linger=linger)
