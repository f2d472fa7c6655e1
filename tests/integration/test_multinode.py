"""Multi-node: a node agent on a second host (a network namespace joined by a veth pair)
runs workers that register with the supervisor over CurveZMQ, serve requests and take
weights over the collective transport.

Needs root and ``ip netns`` (namespaces are created and removed by the test); skipped
with the reason otherwise.
"""

import asyncio
import datetime
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import zmq

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.actors.node import NodeAgent, publish_router
from rollfleet.engines.echo import echo_tokens
from rollfleet.transport.auth import make_keys
from rollfleet.transport.messages import SamplingParams

from ..helpers import kill_sentinel, sentinel_of, wait_until, worker_children

pytestmark = pytest.mark.usefixtures("no_leaks")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def _why_no_netns() -> str | None:
    if not zmq.has("curve"):
        return "libzmq without CurveZMQ"
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    name = f"rfprobe{os.getpid()}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Namespace:
    """A second 'host': namespace ``name`` with 10.213.N.2/30, reached from here at 10.213.N.1;
    with ``ipv6``, joined over IPv6 only: fd13:0:0:N::2/64, reached at fd13:0:0:N::1."""

    def __init__(self, ipv6: bool = False) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.name = f"rfnode{tag}"
        self.veth = f"rfv{tag}"
        net = random.randrange(1, 255)
        self.host_ip, self.node_ip = f"10.213.{net}.1", f"10.213.{net}.2"
        self.prefix = 30
        if ipv6:
            self.host_ip, self.node_ip, self.prefix = f"fd13:0:0:{net:x}::1", f"fd13:0:0:{net:x}::2", 64

    def __enter__(self) -> "Namespace":
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", self.veth + "n")
            _ip("link", "set", self.veth + "n", "netns", self.name)
            dad = ["nodad"] if ":" in self.host_ip else []  # (usable at once, not after duplicate detection)
            _ip("addr", "add", f"{self.host_ip}/{self.prefix}", "dev", self.veth, *dad)
            _ip("link", "set", self.veth, "up")
            _ip("-n", self.name, "addr", "add", f"{self.node_ip}/{self.prefix}", "dev", self.veth + "n", *dad)
            _ip("-n", self.name, "link", "set", self.veth + "n", "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def remove(self) -> None:
        for pid in self.pids():  # nothing should be left; never leave a stray process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("link", "del", self.veth, check=False)
        _ip("netns", "del", self.name, check=False)

    def __exit__(self, *exc: object) -> None:
        self.remove()


expected_tokens = echo_tokens


async def _until(predicate, timeout: float, what: str, log: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tail = open(log).read()[-3000:] if log and os.path.exists(log) else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        await asyncio.sleep(0.05)


WHY_NOT = _why_no_netns()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-node test skipped: {WHY_NOT}")
@pytest.mark.timeout(120)
async def test_remote_node_serves_and_takes_weights_over_collective(tmp_path):
    keys = str(tmp_path / "keys")
    make_keys(keys)
    agent_log = str(tmp_path / "agent.log")
    with Namespace() as ns:
        store = torch.distributed.TCPStore(ns.host_ip, 0, None, True, datetime.timedelta(seconds=30),
                                           wait_for_workers=False)
        node = f"{ns.name}-host"  # the node's name: differs from this host's, as a real second host's would
        config = FleetConfig(engine="echo", num_workers=1, worker_addr=f"tcp://{ns.host_ip}:0", curve_keys_dir=keys,
                             accept_remote_workers=True, deterministic_routing=True,
                             heartbeat_interval_s=0.5, heartbeat_timeout_s=20.0,
                             # no master_addr: the store is dialled at the host the worker socket is bound to
                             weights={"bucket_bytes": 1 << 16, "timeout_s": 30.0})
        agent = None
        try:
            async with Supervisor(config) as sup:
                publication = publish_router(store, sup)

                def start_agent() -> subprocess.Popen:
                    with open(agent_log, "ab") as log:
                        return subprocess.Popen(
                            ["ip", "netns", "exec", ns.name, sys.executable, "-m", "rollfleet.actors.node",
                             "--store", f"{ns.host_ip}:{store.port}", "--workers", "1", "--name", node,
                             "--timeout", "30",
                             "--engine-options", '{"tokens_per_s": 100}'],  # slow remotely: a request to kill
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

                agent = start_agent()

                def remote_ready():
                    return [h for h in sup.ready_workers() if "/" in h.worker_id]

                await _until(lambda: remote_ready(), 60, "the remote worker to register", agent_log)
                assert publication.admitted and publication.admitted[0].startswith(node)
                (remote,) = remote_ready()
                assert remote.worker_id.startswith(f"{node}.") and remote.worker_id.endswith("/w0-0")
                assert remote.host == node
                # It runs in the other namespace: its pid is one of the namespace's.
                assert remote.pid in ns.pids()

                stats = await sup.stats()
                rows = {w["worker_id"]: w for w in stats["workers"]}
                assert rows[remote.worker_id]["state"] == "ready"
                assert rows[remote.worker_id]["host"] == node
                assert stats["num_workers"] == 2

                client = sup.client()
                prompt = [5, 6, 7]
                results = await asyncio.gather(*(client.generate(f"a{i}", prompt, SamplingParams(max_tokens=8))
                                                 for i in range(8)))
                by_worker = {r.worker for r in results}
                assert remote.worker_id in by_worker and len(by_worker) == 2
                assert all(r.token_ids == expected_tokens(prompt, 8) for r in results)

                report = await sup.update_weights([("offset", torch.tensor([3]))], version=1)
                assert report.ok
                transports = {w: r.transport for w, r in report.workers.items()}
                assert transports[remote.worker_id] == "collective"
                local = next(w for w in transports if w != remote.worker_id)
                assert transports[local] == "shm"

                results = await asyncio.gather(*(client.generate(f"b{i}", prompt, SamplingParams(max_tokens=8))
                                                 for i in range(8)))
                remote_results = [r for r in results if r.worker == remote.worker_id]
                assert remote_results
                for r in results:
                    assert r.token_ids == expected_tokens(prompt, 8, offset=3)
                    assert r.weight_versions == [1]
                stats = await sup.stats()
                rows = {w["worker_id"]: w for w in stats["workers"]}
                assert rows[remote.worker_id]["engine_stats"]["offset"] == 3
                assert rows[remote.worker_id]["weight_version"] == 1

                # The remote worker dies mid-request: the request resumes on the local worker,
                # the agent starts a new incarnation, and the supervisor brings it to version 1
                # over the collective before it serves.
                sup.router.set_available(local, False)  # the next request goes to the remote worker
                slow = asyncio.create_task(client.generate("slow", prompt, SamplingParams(max_tokens=200)))
                await _until(lambda: sup.table.on_worker(remote.worker_id), 10, "the request to reach the remote")
                sup.router.set_available(local, True)
                await asyncio.sleep(0.3)  # some tokens were made remotely
                os.kill(remote.pid, signal.SIGKILL)
                result = await asyncio.wait_for(slow, 30)
                assert result.token_ids == expected_tokens(prompt, 200, offset=3)
                assert result.num_preemptions == 1 and result.worker == local

                await _until(lambda: remote_ready(), 30, "the restarted remote worker", agent_log)
                (again,) = remote_ready()
                assert again.worker_id.endswith("/w0-1") and again.index == remote.index
                assert again.weight_version == 1 and again.pid in ns.pids()
                sup.router.set_available(local, False)
                r = await client.generate("after", prompt, SamplingParams(max_tokens=5))
                sup.router.set_available(local, True)
                assert r.worker == again.worker_id and r.token_ids == expected_tokens(prompt, 5, offset=3)
                rows = {w["worker_id"]: w for w in (await sup.stats())["workers"]}
                assert rows[again.worker_id]["restarts"] == 1

                # The agent is killed: its worker exits and tells the supervisor, which takes
                # it out at once, not after heartbeat_timeout_s (20 s), and resumes its request.
                sup.router.set_available(local, False)
                slow = asyncio.create_task(client.generate("slow2", prompt, SamplingParams(max_tokens=200)))
                await _until(lambda: sup.table.on_worker(again.worker_id), 10, "the request to reach the remote")
                sup.router.set_available(local, True)
                await asyncio.sleep(0.3)
                os.kill(agent.pid, signal.SIGKILL)
                agent.wait(timeout=10)
                await _until(lambda: again.worker_id not in sup.workers, 5,
                             "the supervisor to drop the dead agent's worker", agent_log)
                result = await asyncio.wait_for(slow, 30)
                assert result.token_ids == expected_tokens(prompt, 200, offset=3)
                assert result.num_preemptions == 1 and result.worker == local
                await _until(lambda: again.pid not in ns.pids(), 5, "the dead agent's worker to exit")

                # A new agent joins; when the supervisor shuts down it stops by itself.
                agent = start_agent()
                await _until(lambda: remote_ready(), 60, "the new agent's worker", agent_log)
            # The supervisor shut down: its remote worker was told to stop and the store says
            # the fleet closed, so the agent exits by itself.
            assert agent.wait(timeout=20) == 0, open(agent_log).read()[-3000:]
            publication.close()
            deadline = time.monotonic() + 10
            while ns.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ns.pids() == [], "processes left in the node's namespace"
        finally:
            if agent is not None and agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=10)
            del store


@pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-node test skipped: {WHY_NOT}")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bind", ["bound", "wildcard"])
async def test_a_node_reached_over_ipv6_only_serves_and_takes_weights_over_collective(tmp_path, bind):
    """The two hosts share no IPv4 network: the store, the worker socket (CurveZMQ), and the
    collective's rendezvous and gloo group all go over IPv6, with no master_addr given. A
    wildcard bind (``[::]``) is published, and the store dialled, at this host's address on the
    route to the store's host."""
    keys = str(tmp_path / "keys")
    make_keys(keys)
    agent_log = str(tmp_path / "agent.log")
    with Namespace(ipv6=True) as ns:
        store = torch.distributed.TCPStore(ns.host_ip, 0, None, True, datetime.timedelta(seconds=30),
                                           wait_for_workers=False)
        node = f"{ns.name}-host"
        host = ns.host_ip if bind == "bound" else "::"
        config = FleetConfig(engine="echo", num_workers=1, worker_addr=f"tcp://[{host}]:0", curve_keys_dir=keys,
                             accept_remote_workers=True, heartbeat_interval_s=0.5, heartbeat_timeout_s=20.0,
                             weights={"bucket_bytes": 1 << 16, "timeout_s": 30.0})
        agent = None
        try:
            async with Supervisor(config) as sup:
                publication = publish_router(store, sup)
                with open(agent_log, "ab") as log:
                    agent = subprocess.Popen(
                        ["ip", "netns", "exec", ns.name, sys.executable, "-m", "rollfleet.actors.node",
                         "--store", f"[{ns.host_ip}]:{store.port}", "--workers", "1", "--name", node,
                         "--timeout", "30"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

                def remote_ready():
                    return [h for h in sup.ready_workers() if "/" in h.worker_id]

                await _until(lambda: remote_ready(), 60, "the remote worker to register over IPv6", agent_log)
                (remote,) = remote_ready()
                assert remote.pid in ns.pids() and sup.worker_host == ns.host_ip

                report = await sup.update_weights([("offset", torch.tensor([4]))], version=1)
                assert report.ok, report
                assert report.workers[remote.worker_id].transport == "collective"
                client = sup.client()
                prompt = [5, 6, 7]
                sup.router.set_available(next(w for w in sup.workers if w != remote.worker_id), False)
                r = await client.generate("v6", prompt, SamplingParams(max_tokens=6))
                assert r.worker == remote.worker_id
                assert r.token_ids == expected_tokens(prompt, 6, offset=4) and r.weight_versions == [1]
            assert agent.wait(timeout=20) == 0, open(agent_log).read()[-3000:]
            publication.close()
        finally:
            if agent is not None and agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=10)
            del store


SUPERVISOR_ON_STORE = """
import asyncio, datetime, sys
import torch
from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.actors.node import publish_router

async def main():
    store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, datetime.timedelta(seconds=30))
    config = FleetConfig(engine="echo", num_workers=1, worker_addr="tcp://127.0.0.1:0", curve_keys_dir=sys.argv[2],
                         accept_remote_workers=True)
    async with Supervisor(config) as sup:
        publish_router(store, sup)
        while not [h for h in sup.ready_workers() if "/" in h.worker_id]:
            await asyncio.sleep(0.05)
        print("remote ready", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(120)
def test_agent_stops_when_the_supervisor_is_killed_and_the_store_lives_on(tmp_path):
    # The store outlives the supervisor (as one served by torchrun's agent does): the node
    # agent sees the supervisor's beat stand still and stops, and its workers with it.
    keys = str(tmp_path / "keys")
    make_keys(keys)
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR_ON_STORE, str(store.port), keys], stdout=subprocess.PIPE,
                           text=True)
    agent = subprocess.Popen([sys.executable, "-m", "rollfleet.actors.node", "--store", f"127.0.0.1:{store.port}",
                              "--workers", "1", "--timeout", "30", "--supervisor-timeout", "2", "--log-level", "WARNING"],
                             stderr=subprocess.PIPE, text=True)
    try:
        assert sup.stdout.readline().strip() == "remote ready"
        workers = worker_children(agent.pid)
        assert len(workers) == 1
        sup.kill()
        sup.wait(10)
        assert agent.wait(timeout=20) == 0
        assert "no beat from the supervisor" in agent.stderr.read()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive
    finally:
        for proc in (sup, agent):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        del store


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(120)
async def test_an_agent_run_in_process_stops_its_workers_and_removes_its_dir_before_wait_returns(tmp_path):
    # README's recipe for a torchrun job: NodeAgent(store, ...), start(), then wait() until the
    # fleet closes, nothing more. What the agent leaves must be gone once wait() says it stopped.
    keys = str(tmp_path / "keys")
    make_keys(keys)
    root = tmp_path / "agent-root"
    root.mkdir()
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    agent_store = torch.distributed.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
    agent = NodeAgent(agent_store, num_workers=1, name="second-host", private_dir_root=str(root))
    config = FleetConfig(engine="echo", num_workers=1, worker_addr="tcp://127.0.0.1:0", curve_keys_dir=keys,
                         accept_remote_workers=True)
    loop = asyncio.get_running_loop()
    try:
        async with Supervisor(config) as sup:
            publish_router(store, sup)
            await loop.run_in_executor(None, agent.start)
            await _until(lambda: [h for h in sup.ready_workers() if h.worker_id.startswith("second-host.")], 60,
                         "the agent's worker to register")
            workers = [psutil.Process(p.pid) for p in agent.procs.values()]
            assert len(workers) == 1
            private = agent.private_dir
            assert private is not None and os.path.isdir(private)
            result = await sup.client().generate("r", [1, 2, 3], SamplingParams(max_tokens=4))
            assert len(result.token_ids) == 4
        assert await loop.run_in_executor(None, agent.wait, 30), "the agent did not stop when its fleet closed"
        assert not os.path.exists(private), os.listdir(private)
        assert os.listdir(root) == []
        gone, alive = psutil.wait_procs(workers, timeout=1)
        assert not alive
        agent.shutdown()  # what a careful caller adds: nothing left to do
        assert agent.wait(0)
    finally:
        agent.shutdown(grace_s=1)
        del agent_store, store


@pytest.mark.timeout(120)
async def test_a_fleet_published_after_another_under_the_same_store_and_prefix_keeps_its_agents(tmp_path):
    # The first fleet's shutdown marks the store closed; the second fleet's agents read that as
    # their own fleet's end and stopped a moment after they joined.
    keys = str(tmp_path / "keys")
    make_keys(keys)
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    config = FleetConfig(engine="echo", num_workers=1, worker_addr="tcp://127.0.0.1:0", curve_keys_dir=keys,
                         accept_remote_workers=True)
    loop = asyncio.get_running_loop()
    agents = []
    try:
        for fleet in ("first", "second"):
            agent_store = torch.distributed.TCPStore("127.0.0.1", store.port, None, False,
                                                     datetime.timedelta(seconds=30))
            agent = NodeAgent(agent_store, num_workers=1, name=f"{fleet}-host", private_dir_root=str(tmp_path))
            agents.append(agent)
            async with Supervisor(config) as sup:
                publish_router(store, sup)
                await loop.run_in_executor(None, agent.start)
                await _until(lambda: [h for h in sup.ready_workers() if h.worker_id.startswith(f"{fleet}-host.")],
                             60, f"the {fleet} fleet's agent's worker to register")
                await asyncio.sleep(2.5)  # the agent looks at the store every second
                assert not agent.wait(0), f"the {fleet} fleet's agent stopped while its fleet serves"
                result = await sup.client().generate("r", [1, 2], SamplingParams(max_tokens=3), session_id="s")
                assert result.token_ids == expected_tokens([1, 2], 3)
            assert await loop.run_in_executor(None, agent.wait, 30), f"the {fleet} fleet's agent outlived it"
    finally:
        for agent in agents:
            agent.shutdown(grace_s=1)


@pytest.mark.timeout(60)
def test_an_agent_stopped_while_it_waits_for_the_router_is_done_once_start_returns(tmp_path):
    # No supervisor publishes a router: start() waits for one until shutdown() from another
    # thread; then wait() says the agent stopped (it had nothing to stop) instead of blocking.
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    agent = NodeAgent(store, num_workers=1, private_dir_root=str(tmp_path))
    joining = threading.Thread(target=agent.start)
    joining.start()
    try:
        time.sleep(0.3)
        assert joining.is_alive() and not agent.wait(0)  # still waiting for the router: not stopped
        agent.shutdown(grace_s=1)
        joining.join(10)
        assert not joining.is_alive()
        assert agent.wait(5) and agent.error is None
        assert agent.private_dir is None and os.listdir(tmp_path) == []
    finally:
        agent.shutdown(grace_s=1)
        joining.join(10)
        del store


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.timeout(120)
def test_agent_waiting_for_the_router_stops_at_once_on_a_signal(sig):
    # No supervisor has published its router yet (it is still starting): the agent waits for
    # it, up to its --timeout. A SIGTERM (a job manager) or Ctrl-C ends that wait at once.
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    agent = subprocess.Popen([sys.executable, "-m", "rollfleet.actors.node", "--store", f"127.0.0.1:{store.port}",
                              "--workers", "1", "--timeout", "300", "--log-level", "WARNING"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(c.raddr and c.raddr.port == store.port for c in psutil.Process(agent.pid).net_connections()):
            assert time.monotonic() < deadline and agent.poll() is None, "the agent did not reach the store"
            time.sleep(0.05)
        time.sleep(0.5)  # its read of the router has begun
        agent.send_signal(sig)
        assert agent.wait(timeout=20) == 0, agent.stderr.read()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        del store


class ServedFleet:
    """``rollfleet serve --engine echo --store-bind ...`` (keys made for it) and the node agents
    started for it with ``agent()``; whatever still runs at the end is killed."""

    def __init__(self, tmp_path, *extra: str, store_bind: str = "127.0.0.1:0"):
        self.keys = str(tmp_path / "keys")
        self.ready = tmp_path / "ready"
        self.argv = [sys.executable, "-m", "rollfleet", "serve", "--engine", "echo", "--bind", "tcp://127.0.0.1:0",
                     "--keys-dir", self.keys, "--store-bind", store_bind, "--ready-file", str(self.ready), *extra]
        self.agents: list[subprocess.Popen] = []

    def __enter__(self) -> "ServedFleet":
        make_keys(self.keys)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        try:
            line = self.proc.stdout.readline().split()  # rollfleet store on HOST:PORT (workers ADDR)
            assert line[:3] == ["rollfleet", "store", "on"] and line[4] == "(workers", line
            self.store, self.workers_address = line[3], line[5].rstrip(")")
            assert self.proc.stdout.readline().startswith("rollfleet serving on ")
            self.address = self.ready.read_text().strip()
        except BaseException:
            self.__exit__()
            raise
        return self

    def agent(self, *args: str, netns: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``rollfleet node --store <this store> ARGS``, in network namespace ``netns`` if given,
        with ``env`` added to its environment."""
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "rollfleet", "node", "--store", self.store, *args],
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.agents.append(proc)
        return proc

    def client(self):  # type: ignore[no-untyped-def]
        from rollfleet.actors.client import RemoteClient
        from rollfleet.transport.auth import load_client_keys

        return RemoteClient(self.address, curve_keys=load_client_keys(self.keys))

    @staticmethod
    async def ready_on(client, host: str, n: int, timeout: float = 60) -> tuple[dict, list[dict]]:  # type: ignore[no-untyped-def]
        """Once ``n`` workers of ``host`` are ready: (the fleet's stats, those workers' rows)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = await client.stats()
            rows = [w for w in stats["workers"] if w["host"] == host and w["state"] == "ready"]
            if len(rows) >= n:
                return stats, rows
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        for proc in self.agents:  # asked first, so that each removes its private directory
            if proc.poll() is None:
                proc.terminate()
        for proc in self.agents:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its workers too
                proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(180)
async def test_serve_with_a_store_admits_a_node_agents_workers_and_its_clients_reach_them(tmp_path):
    # `rollfleet serve --store-bind` runs the store itself: an agent pointed at it (as one on
    # another node would be) brings its workers into the served fleet, a client's requests
    # reach them, and when serve stops the agent and its workers stop too.
    with ServedFleet(tmp_path) as fleet:
        assert fleet.store.startswith("127.0.0.1:") and fleet.workers_address.startswith("tcp://127.0.0.1:")
        # The store listens on the address it was given only, not on every interface.
        port = int(fleet.store.rpartition(":")[2])
        listening = [c.laddr for c in psutil.Process(fleet.proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [a.ip for a in listening] == ["127.0.0.1"]

        agent = fleet.agent("--workers", "2", "--name", "othernode", "--timeout", "30")
        prompt = [4, 5, 6]
        async with fleet.client() as client:
            stats, rows = await fleet.ready_on(client, "othernode", 2)
            remote = {w["worker_id"] for w in rows}
            assert all(w.startswith("othernode.") for w in remote) and stats["num_workers"] == 3
            results = await asyncio.gather(*(client.generate(f"r{i}", prompt, SamplingParams(max_tokens=6))
                                             for i in range(24)))
            assert all(r.token_ids == echo_tokens(prompt, 6) for r in results)
            assert remote <= {r.worker for r in results}
        workers = worker_children(agent.pid)
        assert len(workers) == 2
        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(30) == 0
        assert agent.wait(timeout=30) == 0
        # It stopped because the store said the fleet closed, not because the store was gone:
        # nothing to warn of (an agent logs at WARNING and above).
        assert agent.stderr.read() == ""
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert not fleet.ready.exists()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-node test skipped: {WHY_NOT}")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("advertise", [True, False], ids=["advertised", "by-default"])
async def test_serve_on_a_wildcard_worker_socket_is_reached_from_another_host_by_its_advertised_name(tmp_path,
                                                                                                   advertise):
    # The worker socket listens on every interface; agents on the other host dial the name
    # serve advertises (here the address the other host reaches it at), found in the store.
    # Without --advertise-host: this host's address on the route to the store's host (here the
    # same address), not its host name, which here resolves to loopback only.
    with Namespace() as ns, ServedFleet(tmp_path, "--worker-bind", "tcp://0.0.0.0:0",
                                        *(("--advertise-host", ns.host_ip) if advertise else ()),
                                        store_bind=f"{ns.host_ip}:0") as fleet:
        assert fleet.store.startswith(f"{ns.host_ip}:")
        assert fleet.workers_address.startswith(f"tcp://{ns.host_ip}:")  # the address agents dial, not 0.0.0.0
        agent = fleet.agent("--workers", "1", "--name", "nodeb", "--timeout", "30", netns=ns.name)
        async with fleet.client() as client:
            _, (remote,) = await fleet.ready_on(client, "nodeb", 1)
            assert remote["pid"] in ns.pids()
            results = await asyncio.gather(*(client.generate(f"n{i}", [9, 8], SamplingParams(max_tokens=4))
                                             for i in range(16)))
            assert remote["worker_id"] in {r.worker for r in results}
            assert all(r.token_ids == echo_tokens([9, 8], 4) for r in results)
        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(30) == 0
        assert agent.wait(timeout=30) == 0, agent.stderr.read()
        deadline = time.monotonic() + 10
        while ns.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ns.pids() == [], "processes left in the node's namespace"


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(120)
async def test_an_agent_whose_served_fleet_is_killed_stops_and_says_so_in_one_line(tmp_path):
    # serve killed outright takes its store with it: the agent's next look at the store fails,
    # and it stops with its workers, saying why in one line (no C++ trace of torch's).
    with ServedFleet(tmp_path) as fleet:
        agent = fleet.agent("--workers", "1", "--name", "nodec")
        async with fleet.client() as client:
            await fleet.ready_on(client, "nodec", 1)
        fleet_workers = worker_children(fleet.proc.pid)
        agent_workers = worker_children(agent.pid)
        assert len(fleet_workers) == 1 and len(agent_workers) == 1
        fleet.proc.kill()
        fleet.proc.wait(10)
        assert agent.wait(timeout=30) == 0
        err = agent.stderr.read()
        assert "store unreachable" in err, err
        assert "Exception raised from" not in err and "frame #" not in err, err
        gone, alive = psutil.wait_procs(fleet_workers + agent_workers, timeout=15)
        assert not alive


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(120)
async def test_garbage_and_a_dead_agents_entry_in_the_store_keep_no_agent_out(tmp_path):
    # Anyone who can reach the store can write to it. An index taken by an agent that died
    # before writing its key, and an entry whose key and name are garbage, are passed over:
    # the next agent is still admitted, and the supervisor's beat goes on.
    with ServedFleet(tmp_path) as fleet:
        host, _, port = fleet.store.rpartition(":")
        store = torch.distributed.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        store.add("rollfleet/nodes", 1)  # node 0: took its index, never wrote its key
        bad = store.add("rollfleet/nodes", 1) - 1
        store.set(f"rollfleet/node/{bad}/name", b"\xff\xfe not utf-8")
        store.set(f"rollfleet/node/{bad}/public", "not a key")
        agent = fleet.agent("--workers", "1", "--name", "noded", "--supervisor-timeout", "3")
        async with fleet.client() as client:
            _, (remote,) = await fleet.ready_on(client, "noded", 1)
            result = await client.generate("g", [3, 4], SamplingParams(max_tokens=3))
            assert result.token_ids == echo_tokens([3, 4], 3)
            await asyncio.sleep(5)  # longer than the agent's --supervisor-timeout: the beat goes on
            assert agent.poll() is None
            _, rows = await fleet.ready_on(client, "noded", 1)
            assert rows[0]["worker_id"] == remote["worker_id"]
        assert not store.check([f"rollfleet/node/{bad}/admitted"]) and not store.check(["rollfleet/node/0/admitted"])
        del store


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["sentinel", "next-agent"])
async def test_the_private_dir_of_an_agent_killed_with_its_workers_is_removed(tmp_path, who):
    # An agent's process group sent SIGKILL (a batch scheduler's cancel) takes its workers too:
    # its sentinel, a process of another session, removes the agent's private directory (its
    # workers' logs, what their engines shared) at once. With the sentinel killed too (every
    # process of the job: a container stopped), nobody is left to remove it: it names its owner,
    # so the next agent started beside it removes it, as a supervisor's is removed.
    root = tmp_path / "agents"
    root.mkdir()
    env = {"TMPDIR": str(root)}
    with ServedFleet(tmp_path) as fleet:
        first = fleet.agent("--workers", "1", "--name", "first", env=env)
        async with fleet.client() as client:
            await fleet.ready_on(client, "first", 1)
            (left,) = [p for p in root.iterdir() if p.name.startswith("rollfleet-node-")]
            assert (left / "owner").read_text().split()[0] == str(first.pid)
            workers = worker_children(first.pid)
            sentinel = sentinel_of(first.pid)
            assert workers and sentinel is not None
            if who == "next-agent":
                kill_sentinel(first.pid)
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(10)
            _, alive = psutil.wait_procs(workers, timeout=10)
            assert not alive
            if who == "sentinel":
                assert wait_until(lambda: not left.exists(), 10), f"left behind: {list(left.iterdir())}"
                assert wait_until(lambda: not psutil.pid_exists(sentinel)
                                  or psutil.Process(sentinel).status() == psutil.STATUS_ZOMBIE, 10)
                assert list(root.iterdir()) == []
                return
            assert left.exists()  # nobody was left to remove it
            second = fleet.agent("--workers", "1", "--name", "second", env=env)
            await fleet.ready_on(client, "second", 1)
            assert not left.exists() and len(list(root.iterdir())) == 1  # the second's own
        second.terminate()
        assert second.wait(20) == 0
        assert list(root.iterdir()) == []  # a stopped agent removes its own


def test_the_published_worker_address_names_a_wildcard_bind_by_the_advertised_host_in_dialable_form():
    from rollfleet.actors.node import reachable_address

    assert reachable_address("tcp://127.0.0.1:5", None) == "tcp://127.0.0.1:5"  # a bound host is kept
    assert reachable_address("tcp://0.0.0.0:5", "node-a") == "tcp://node-a:5"
    assert reachable_address("tcp://[::]:5", "10.0.0.1") == "tcp://10.0.0.1:5"
    assert reachable_address("tcp://0.0.0.0:5", "::1") == "tcp://[::1]:5"  # an IPv6 host in brackets


@pytest.mark.timeout(60)
async def test_the_fleets_worker_host_is_its_bound_host_or_the_one_a_wildcard_was_published_under(tmp_path):
    """What the collective's store is dialled at by default (remote workers reached the fleet there)."""
    keys = str(tmp_path / "keys")
    make_keys(keys)
    # (a store on loopback: no route to it names an address other hosts dial, so a wildcard bind
    # published with no host has none; the published address then names this host's FQDN)
    for bind, published, expected in (("tcp://127.0.0.1:0", None, "127.0.0.1"), ("tcp://0.0.0.0:0", None, ""),
                                      ("tcp://0.0.0.0:0", "node-a.example", "node-a.example")):
        store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                                           wait_for_workers=False)
        async with Supervisor(FleetConfig(engine="echo", num_workers=1, worker_addr=bind, curve_keys_dir=keys,
                                          accept_remote_workers=True)) as sup:
            publication = publish_router(store, sup, host=published)
            try:
                assert sup.worker_host == expected, (bind, published)
                # the default store address of a collective update to a worker on another host
                assert sup.weights._sender().fleet_host == expected
            finally:
                publication.close()
