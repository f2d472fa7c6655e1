"""Observability: per-worker fleet stats from both clients and the CLI, Prometheus export,
and the rate-limited log of dropped frames."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import pytest

from rollfleet.actors import RemoteClient
from rollfleet.actors.metrics import LogLimiter
from rollfleet.transport.messages import SamplingParams

from .helpers import fleet, wait_for, worker_pids

pytestmark = pytest.mark.usefixtures("no_leaks")

WORKER_FIELDS = {"worker_id", "state", "pid", "device", "num_inflight", "num_tokens", "weight_version",
                 "restarts", "last_error"}


async def run_cli(*args):
    # Asynchronously: the fleet answering the CLI runs on this very loop.
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rollfleet.cli", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def kill_and_wait_restart(sup, index):
    victim = sup.slots[index]
    os.kill(victim.pid, signal.SIGKILL)
    assert await wait_for(lambda: sup.slots[index] is not victim and sup.slots[index].state.value == "ready", 15)
    return victim


async def test_stats_per_worker_from_the_client_the_remote_client_and_the_cli():
    async with fleet(2, heartbeat_interval_s=0.1) as sup:
        client = sup.client()
        await asyncio.gather(*(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=10)) for i in range(20)))
        victim = await kill_and_wait_restart(sup, 1)
        await asyncio.gather(*(client.generate(f"s{i}", [i + 1], SamplingParams(max_tokens=10)) for i in range(20)))

        async def tokens_reported():
            return sum(w["num_tokens"] for w in (await sup.stats())["workers"]) > 0

        deadline = time.monotonic() + 5
        while not await tokens_reported() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        local = await client.stats()
        async with RemoteClient(sup.frontend_address) as remote:
            from_remote = await remote.stats()
        from_cli = json.loads(await run_cli("stats", sup.frontend_address, "--json"))
        table = await run_cli("stats", sup.frontend_address)
        for stats in (local, from_remote, from_cli):
            workers = stats["workers"]
            assert len(workers) == 2 and all(WORKER_FIELDS <= set(w) for w in workers)
            assert [w["state"] for w in workers] == ["ready", "ready"]
            assert [w["pid"] for w in workers] == [sup.slots[0].pid, sup.slots[1].pid]
            assert [w["device"] for w in workers] == ["cpu", "cpu"]
            assert [w["restarts"] for w in workers] == [0, 1]
            assert "code -9" in workers[1]["last_error"] and workers[0]["last_error"] == ""
            assert all(w["num_inflight"] == 0 and w["weight_version"] == 0 for w in workers)
            assert stats["num_completed"] == 40 and stats["num_inflight"] == 0
        assert sum(w["num_tokens"] for w in local["workers"]) > 0
        # PROTOCOL.md's example answer (tests/golden/reply.json) has every key a fleet sends.
        example = json.loads((pathlib.Path(__file__).parents[1] / "golden" / "reply.json").read_text())["data"]
        assert set(local) == set(example) and set(local["workers"][0]) == set(example["workers"][0])
        assert victim.worker_id not in table and sup.slots[1].worker_id in table and "in flight: 0" in table
        header, *rows = table.splitlines()[:3]
        assert header.split()[:3] == ["worker_id", "host", "state"]
        assert [row.split()[:3] for row in rows] == [[w["worker_id"], w["host"], "ready"] for w in local["workers"]]


def scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


async def test_prometheus_endpoint_exports_per_worker_and_fleet_metrics():
    pytest.importorskip("prometheus_client")
    sup = fleet(2, heartbeat_interval_s=0.1, metrics_port=0)
    async with sup:
        url = sup.metrics_address
        assert url.startswith("http://127.0.0.1:")
        client = sup.client()
        await asyncio.gather(*(client.generate(f"r{i}", [i + 1], SamplingParams(max_tokens=12)) for i in range(30)))
        await kill_and_wait_restart(sup, 0)
        await client.generate("after", [3], SamplingParams(max_tokens=5))

        async def current():
            return await asyncio.to_thread(scrape, url)

        deadline = time.monotonic() + 5
        samples = await current()
        while (value(samples, "rollfleet_requests_total", outcome="completed") != 31
               or value(samples, "rollfleet_worker_up", worker="0", device="cpu") != 1.0) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            samples = await current()
        assert value(samples, "rollfleet_requests_total", outcome="completed") == 31
        for w in ("0", "1"):
            assert value(samples, "rollfleet_worker_up", worker=w, device="cpu") == 1.0
            assert value(samples, "rollfleet_worker_state", worker=w, device="cpu", state="ready") == 1.0
            assert value(samples, "rollfleet_worker_state", worker=w, device="cpu", state="dead") == 0.0
            assert value(samples, "rollfleet_worker_inflight", worker=w, device="cpu") == 0.0
            assert value(samples, "rollfleet_worker_weight_version", worker=w, device="cpu") == 0.0
        assert value(samples, "rollfleet_worker_restarts_total", worker="0", device="cpu") == 1.0
        assert value(samples, "rollfleet_worker_restarts_total", worker="1", device="cpu") == 0.0
        assert value(samples, "rollfleet_worker_tokens_total", worker="1", device="cpu") > 0
        assert value(samples, "rollfleet_workers_ready") == 2.0 and value(samples, "rollfleet_inflight") == 0.0
        info = [k for k in samples if k[0] == "rollfleet_worker_info" and ("worker", "0") in k[1]]
        assert len(info) == 1 and any(lbl == "last_error" and "code -9" in v for lbl, v in info[0][1])
        assert any(lbl == "pid" and v == str(sup.slots[0].pid) for lbl, v in info[0][1])
        assert ("host", socket.gethostname()) in info[0][1]
        assert value(samples, "rollfleet_sleep_level") == 0.0
        await client.sleep(2)
        deadline = time.monotonic() + 5
        while value(samples, "rollfleet_sleep_level") != 2.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            samples = await current()
        assert value(samples, "rollfleet_sleep_level") == 2.0
    with pytest.raises(urllib.error.URLError):  # the endpoint goes away with the fleet
        urllib.request.urlopen(url, timeout=2)


async def test_a_scrape_right_after_start_already_shows_the_workers():
    pytest.importorskip("prometheus_client")
    async with fleet(2, heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, metrics_port=0) as sup:
        samples = await asyncio.to_thread(scrape, sup.metrics_address)  # long before the first heartbeat tick
        assert value(samples, "rollfleet_workers_ready") == 2.0
        for w in ("0", "1"):
            assert value(samples, "rollfleet_worker_up", worker=w, device="cpu") == 1.0


async def test_a_metrics_port_in_use_fails_the_start_naming_that_port():
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sup = fleet(1, metrics_port=port)
        with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{port}"):
            async with sup:
                pass
    assert not os.path.exists(sup.private_dir)


def test_log_limiter_logs_a_burst_then_one_count_per_interval(caplog):
    log = logging.getLogger("rollfleet.test.limiter")
    caplog.set_level(logging.INFO, logger=log.name)
    limiter = LogLimiter(log, burst=3, interval_s=0.2)
    for i in range(1000):
        limiter.log("junk", logging.WARNING, "junk frame %d", i)
    limiter.log("other", logging.INFO, "other frame")
    assert [r.getMessage() for r in caplog.records] == ["junk frame 0", "junk frame 1", "junk frame 2", "other frame"]
    time.sleep(0.25)
    limiter.flush()
    assert caplog.records[-1].getMessage().startswith("997 more junk events")
    assert caplog.records[-1].levelno == logging.WARNING
    limiter.log("junk", logging.WARNING, "junk again")  # a new window logs again
    assert caplog.records[-1].getMessage() == "junk again"
    assert limiter.counts == {"junk": 1001, "other": 1}
    with pytest.raises(ValueError):
        LogLimiter(log, interval_s=0)


def test_new_config_fields_are_validated():
    from rollfleet.actors import FleetConfig

    for bad in ({"stall_timeout_s": 0}, {"stall_timeout_s": -1.0}, {"metrics_port": -1}, {"metrics_port": 70000}):
        with pytest.raises(ValueError):
            FleetConfig(engine="echo", **bad)
    assert FleetConfig(engine="echo", stall_timeout_s=5.0, metrics_port=0).metrics_port == 0
    # A request that is not streamed shows its tokens once per report: a stall timeout within
    # two reports would take a healthy engine for a stuck one.
    with pytest.raises(ValueError, match="twice report_interval_s"):
        FleetConfig(engine="echo", stall_timeout_s=1.0)
    assert FleetConfig(engine="echo", stall_timeout_s=1.0, report_interval_s=0.1).stall_timeout_s == 1.0
