"""Fuzzing both sockets of a live fleet while real requests run.

Covered, 100k frames each:
- the client socket, over a real connection, from a separate process (fuzz_peer.py):
  malformed, truncated, mistyped, wrong-direction and multi-frame messages each get one
  error reply; oversized ones are dropped by ZeroMQ (MAXMSGSIZE) with their connection,
  which then reconnects and is served again;
- the worker socket, over a real connection: peers with identities the supervisor did not
  spawn are dropped, counted, and logged a few lines at a time;
- frames carrying a live worker's identity. ZeroMQ itself refuses a second connection
  with the identity of a connected peer (checked below), so a buggy worker is the only
  source of these; they are fed to the supervisor's worker-socket handler, the code that
  receives whatever arrives under a worker's identity, as ZeroMQ would hand them over.
  Register, WorkerExit and Heartbeat are left out: a worker that sends those means them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time

import psutil
import pytest
import zmq
import zmq.asyncio

from rollfleet.actors import RemoteClient
from rollfleet.transport.messages import SamplingParams

from .fuzz_peer import bad_frames, worker_frames
from .helpers import expected_tokens, fleet, worker_pids

pytestmark = pytest.mark.usefixtures("no_leaks")

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_peer.py")
MAX_BYTES = 1 << 20
LOGGER = "rollfleet.actors.supervisor"


class Traffic:
    """Real requests, in-process and remote, checked token by token, until stopped."""

    def __init__(self, sup, remote=None):
        self.sup, self.remote = sup, remote
        self.done = 0
        self.worst_s = 0.0
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _one(self, client, i):
        prompt, n = [i % 97 + 1, i % 13 + 2], 1 + i % 24
        t0 = time.monotonic()
        if i % 3 == 0:
            tokens = []
            async for item in client.stream(f"t{i}", prompt, SamplingParams(max_tokens=n)):
                if not hasattr(item, "finish_reason"):
                    tokens.extend(item.token_ids)
        else:
            tokens = (await client.generate(f"t{i}", prompt, SamplingParams(max_tokens=n))).token_ids
        self.worst_s = max(self.worst_s, time.monotonic() - t0)
        assert tokens == expected_tokens(prompt, n), f"request t{i}"
        self.done += 1

    async def _run(self):
        local = self.sup.client()
        i = 0
        while not self._stop.is_set():
            clients = [local] + ([self.remote] if self.remote is not None else [])
            await asyncio.wait_for(asyncio.gather(*(self._one(c, i + k) for k, c in enumerate(clients * 4))), 30)
            i += len(clients) * 4
            await asyncio.sleep(0.01)

    async def stop(self):
        self._stop.set()
        await asyncio.wait_for(self._task, 60)  # re-raises a wrong token or a timeout


async def run_peer(address, count, seed):
    proc = await asyncio.create_subprocess_exec(sys.executable, PEER, address, str(count), str(seed), str(MAX_BYTES),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def rss_mb():
    return psutil.Process().memory_info().rss / 2**20


def log_lines(caplog, text):
    return sum(1 for r in caplog.records if r.name == LOGGER and text in r.getMessage())


async def test_100k_bad_client_frames_get_error_replies_while_real_requests_complete(caplog):
    caplog.set_level(logging.INFO, logger="rollfleet")
    sup = fleet(2, engine_options={"tokens_per_s": 2000}, max_message_bytes=MAX_BYTES)
    async with sup:
        pids = worker_pids(sup)
        async with RemoteClient(sup.frontend_address) as remote:
            await run_peer(sup.frontend_address, 5000, seed=1)  # warm-up: allocator, caches
            base = rss_mb()
            traffic = Traffic(sup, remote)
            t0 = time.monotonic()
            report = await run_peer(sup.frontend_address, 100_000, seed=2)
            elapsed = time.monotonic() - t0
            await traffic.stop()
        grown = rss_mb() - base
        stats = await sup.stats()
        assert worker_pids(sup) == pids and stats["num_inflight"] == 0
    assert report["sent"] == 100_000 and report["missing"] == 0, report
    assert sum(report["replies"].values()) == 100_000
    assert all(key.startswith("error:") for key in report["replies"]), report["replies"]
    assert report["answered_after_oversize"], "the client socket stopped answering after oversized frames"
    assert traffic.done >= 40 and traffic.worst_s < 10.0, (traffic.done, traffic.worst_s)
    decode_errors = sum(n for key, n in report["replies"].items()
                        if key.split(":")[1] in ("bad_frame", "bad_message", "bad_field", "version_mismatch"))
    assert stats["dropped_frames"]["bad_client_frame"] >= decode_errors
    # A few lines per 5 s window, not one per frame.
    assert log_lines(caplog, "bad client message") <= 5 * (elapsed / 5 + 3)
    assert grown < 40, f"resident memory grew by {grown:.1f} MiB"


async def test_100k_frames_from_unknown_identities_on_the_worker_socket_are_dropped(caplog):
    caplog.set_level(logging.INFO, logger="rollfleet")
    rng = random.Random(3)
    pool = worker_frames(rng, 2000) + [f[0] for f in bad_frames(rng, 2000)]
    sup = fleet(2, engine_options={"tokens_per_s": 2000})
    async with sup:
        pids = worker_pids(sup)
        ctx = zmq.asyncio.Context()
        rogues = []
        for identity in (b"rogue", b"w9-9", b"w0-7", None):  # None: ZeroMQ picks one
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if identity:
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(sup.worker_address)
            rogues.append(sock)
        # A peer that claims a live worker's identity: ZeroMQ keeps it out altogether.
        twin = ctx.socket(zmq.DEALER)
        twin.setsockopt(zmq.LINGER, 0)
        twin.setsockopt(zmq.IDENTITY, sup.slots[0].identity)
        twin.connect(sup.worker_address)
        try:
            traffic = Traffic(sup)
            t0 = time.monotonic()
            sent = 0
            while sent < 100_000:
                for k in range(2000):
                    await rogues[k % len(rogues)].send(pool[rng.randrange(len(pool))])
                    if k % 10 == 0:
                        await twin.send(pool[rng.randrange(len(pool))])
                sent += 2000
                deadline = time.monotonic() + 20
                while sup._drops.counts.get("unregistered_identity", 0) < sent and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)  # backpressure: the next burst waits for this one
            elapsed = time.monotonic() - t0
            await traffic.stop()
        finally:
            for sock in (*rogues, twin):
                sock.close(0)
            ctx.term()
        assert sup._drops.counts.get("unregistered_identity") == 100_000
        assert "bad_worker_frame" not in sup._drops.counts  # the twin's frames never got in
        assert worker_pids(sup) == pids and len(sup.ready_workers()) == 2
        assert traffic.done >= 40
    assert log_lines(caplog, "unregistered identity") <= 5 * (elapsed / 5 + 3)


async def test_100k_malformed_frames_under_a_live_workers_identity_are_dropped(caplog):
    caplog.set_level(logging.INFO, logger="rollfleet")
    rng = random.Random(4)
    pool = worker_frames(rng, 4000) + [f[0] for f in bad_frames(rng, 1000)]
    sup = fleet(2, engine_options={"tokens_per_s": 2000})
    async with sup:
        pids = worker_pids(sup)
        traffic = Traffic(sup)
        t0 = time.monotonic()
        victim = sup.slots[0].identity
        for burst in range(50):
            for _ in range(2000):
                sup._on_worker_frames([victim, pool[rng.randrange(len(pool))]])
            await asyncio.sleep(0.01)  # let real traffic through between bursts
        elapsed = time.monotonic() - t0
        await traffic.stop()
        counts = dict(sup._drops.counts)
        assert worker_pids(sup) == pids and len(sup.ready_workers()) == 2
        assert traffic.done >= 20 and len(sup.table) == 0
        assert counts.get("bad_worker_frame", 0) > 50_000
    lines = sum(log_lines(caplog, text) for text in ("from worker", "error engine_error"))
    assert lines <= 3 * 5 * (elapsed / 5 + 3), lines
