"""CurveZMQ: non-loopback binds need keys; only authorized client keys are served."""

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest
import zmq

from rollfleet.actors import FleetConfig, RemoteClient, Supervisor
from rollfleet.cli import main as cli_main
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import FleetClosed, RequestTimeout
from rollfleet.transport.auth import is_loopback_address, load_client_keys, make_keys
from rollfleet.transport.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("no_leaks")


def _curve_dealer(address, identity, public, secret, server_public):
    """A raw CurveZMQ DEALER with its own context (close the socket, then term the context)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


@contextlib.asynccontextmanager
async def fleet_with_a_worker_key(tmp_path, tokens_per_s: float, **overrides):
    """A fleet that admits remote workers, one key pair allowed: (supervisor, a DEALER factory
    for an identity with that key)."""
    keys_dir = str(tmp_path / "keys")
    make_keys(keys_dir)
    config = FleetConfig(engine="echo", num_workers=1, worker_addr="tcp://127.0.0.1:0", curve_keys_dir=keys_dir,
                         accept_remote_workers=True, engine_options={"tokens_per_s": tokens_per_s}, **overrides)
    async with Supervisor(config) as sup:
        pub, sec = zmq.curve_keypair()
        sup.allow_worker_key(pub)
        server_pub = load_client_keys(keys_dir)[2]
        yield sup, lambda identity: _curve_dealer(sup.worker_address, identity, pub, sec, server_pub)


def test_loopback_rule():
    assert is_loopback_address("tcp://127.0.0.1:5")
    assert is_loopback_address("tcp://[::1]:5")
    assert is_loopback_address("ipc:///tmp/x")
    assert not is_loopback_address("tcp://0.0.0.0:5")
    assert not is_loopback_address("tcp://*:5")
    assert not is_loopback_address("tcp://10.1.2.3:5")


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs an IPv6 loopback (::1)")
async def test_a_fleet_on_the_ipv6_loopback_serves_its_clients():
    # tcp://[::1] passes the loopback rule; ZeroMQ binds and connects to it only with its IPv6 option.
    config = FleetConfig(engine="echo", num_workers=1, frontend_addr="tcp://[::1]:0")
    async with Supervisor(config) as sup:
        assert sup.frontend_address.startswith("tcp://[::1]:")
        async with RemoteClient(sup.frontend_address, request_timeout_s=30) as remote:
            result = await remote.generate("v6", [1, 2], SamplingParams(max_tokens=3))
        assert result.token_ids == echo_tokens([1, 2], 3)


async def test_non_loopback_bind_without_keys_is_refused_with_instructions(capsys):
    for addrs in ({"frontend_addr": "tcp://0.0.0.0:0"}, {"worker_addr": "tcp://10.1.2.3:0"}):
        with pytest.raises(ValueError, match="rollfleet keys"):
            FleetConfig(engine="echo", num_workers=1, **addrs)  # before anything starts
    # a config changed after it was checked is refused at start, and nothing is left
    config = FleetConfig(engine="echo", num_workers=1)
    config.frontend_addr = "tcp://0.0.0.0:0"
    sup = Supervisor(config)
    with pytest.raises(ValueError, match="rollfleet keys"):
        await sup.start()
    assert not os.path.exists(sup.private_dir)
    # the command line calls it a bad option (exit 2), not a failed start
    assert await asyncio.to_thread(cli_main, ["serve", "--engine", "echo", "--bind", "tcp://0.0.0.0:0"]) == 2
    assert "rollfleet keys" in capsys.readouterr().err


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_curve_fleet_serves_authorized_clients_only(tmp_path):
    assert cli_main(["keys", str(tmp_path / "keys")]) == 0
    keys_dir = str(tmp_path / "keys")
    stranger = make_keys(str(tmp_path / "other"))  # a key pair this fleet never authorized
    del stranger
    config = FleetConfig(engine="echo", num_workers=2, frontend_addr="tcp://0.0.0.0:0",
                         worker_addr="tcp://127.0.0.1:0", curve_keys_dir=keys_dir)
    async with Supervisor(config) as sup:
        port = sup.frontend_address.rsplit(":", 1)[1]
        address = f"tcp://127.0.0.1:{port}"
        # Workers connected over tcp with their own ephemeral keys.
        assert len(sup.ready_workers()) == 2
        async with RemoteClient(address, curve_keys=load_client_keys(keys_dir)) as ok:
            result = await ok.generate("r", [1, 2], SamplingParams(max_tokens=3))
            assert len(result.token_ids) == 3
        # Refused at the handshake: no answer comes (the call times out), or, when the refusal
        # has already dropped the connection, the message cannot be queued (FleetClosed).
        async with RemoteClient(address, curve_keys=load_client_keys(str(tmp_path / "other")),
                                call_timeout_s=1.0) as bad:
            with pytest.raises((RequestTimeout, FleetClosed)):
                await bad.stats()
        async with RemoteClient(address, call_timeout_s=1.0) as plain:
            with pytest.raises((RequestTimeout, FleetClosed)):
                await plain.stats()
            await asyncio.sleep(0.3)  # refused by now
            with pytest.raises((RequestTimeout, FleetClosed)):
                await plain.stats()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_client_key_cannot_register_a_worker(tmp_path):
    keys_dir = str(tmp_path / "keys")
    make_keys(keys_dir)
    config = FleetConfig(engine="echo", num_workers=1, worker_addr="tcp://127.0.0.1:0", curve_keys_dir=keys_dir)
    async with Supervisor(config) as sup:
        import msgpack

        client_pub, client_sec, server_pub = load_client_keys(keys_dir)
        ctx, sock = _curve_dealer(sup.worker_address, b"w0-7", client_pub, client_sec, server_pub)
        try:
            sock.send(msgpack.packb({"v": 1, "type": "register", "id": "r", "worker_id": "w0-7", "pid": 1,
                                     "engine": "echo"}))
            assert sock.poll(1500) == 0, "the worker socket answered a client key"
        finally:
            sock.close()
            ctx.term()
        assert len(sup.workers) == 1


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
def test_keys_command_keeps_existing_keys_unless_forced_and_secrets_stay_private(tmp_path):
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir(mode=0o755)
    command = [sys.executable, "-m", "rollfleet.cli", "keys", str(keys_dir)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    secret = (keys_dir / "server.key_secret").read_bytes()
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    assert (keys_dir / "authorized").stat().st_mode & 0o777 == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert (keys_dir / name).stat().st_mode & 0o777 == 0o600
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "--force" in again.stderr
    assert (keys_dir / "server.key_secret").read_bytes() == secret
    forced = subprocess.run(command + ["--force"], capture_output=True, text=True, timeout=60)
    assert forced.returncode == 0 and (keys_dir / "server.key_secret").read_bytes() != secret
    assert sorted(p.name for p in keys_dir.iterdir()) == ["authorized", "client.key", "client.key_secret",
                                                          "server.key", "server.key_secret"]
    assert (keys_dir / "authorized" / "client.key").read_bytes() == (keys_dir / "client.key").read_bytes()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_worker_cannot_end_or_add_to_a_request_that_runs_on_another(tmp_path):
    # A request's inner id is known to the worker it runs on alone; an admitted remote worker
    # (or a buggy one) that sends a chunk, result or error under that id is ignored: the
    # request's tokens, its worker's load and its end stay the real worker's.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=100) as (sup, dealer):
        client = sup.client()
        # 2 s of work: still running when the false frames come, after a CurveZMQ handshake
        victim = asyncio.create_task(client.generate("victim", [1, 2], SamplingParams(max_tokens=200)))
        while not sup.table.num_inner:
            await asyncio.sleep(0.01)
        inner = next(iter(sup.table)).inner_id
        ctx, sock = dealer(b"nodeA/w0-0")
        try:
            def send(kind, **fields):
                sock.send(msgpack.packb({"v": 1, "type": kind, **fields}))

            send("register", id="register", worker_id="nodeA/w0-0", pid=1, engine="echo")
            assert await asyncio.to_thread(sock.poll, 5000), "the remote worker was not admitted"
            sock.recv()
            send("chunk", id=inner, token_ids=[7], weight_version=0)
            send("result", id=inner, token_ids=[7, 8], finish_reason="stop", weight_versions=[0])
            send("error", id=inner, code="engine_error", message="not mine")
            result = await asyncio.wait_for(victim, 10)
        finally:
            sock.close()
            ctx.term()
        assert result.finish_reason == "length" and result.token_ids == echo_tokens([1, 2], 200)
        assert result.worker == "w0-0"
        stats = await sup.stats(engines=False)
        assert [w["num_inflight"] for w in stats["workers"]] == [0, 0]
        assert stats["dropped_frames"].get("bad_worker_frame", 0) >= 3


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_replaced_remote_generation_is_told_to_exit_and_cannot_come_back(tmp_path):
    # A node agent that restarts a slot's worker leaves the old process, if it still runs (a
    # network fault, a hang), unaware: the new generation's register replaces it, and it gets a
    # shutdown. Should it register again later, it is refused with another: an older generation
    # never displaces a newer one.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=0) as (sup, dealer):
        socks = {}
        try:
            async def register(identity: bytes) -> dict:
                ctx, sock = socks.get(identity) or dealer(identity)
                socks[identity] = (ctx, sock)
                sock.send(msgpack.packb({"v": 1, "type": "register", "id": "register",
                                         "worker_id": identity.decode(), "pid": 1, "engine": "echo"}))
                return await next_message(sock)

            async def next_message(sock) -> dict:
                assert await asyncio.to_thread(sock.poll, 10_000), "no answer from the supervisor"
                return msgpack.unpackb(sock.recv())

            assert (await register(b"nodeA/w0-0"))["type"] == "reply"
            assert (await register(b"nodeA/w0-1"))["type"] == "reply"
            told = await next_message(socks[b"nodeA/w0-0"][1])
            assert (told["type"], told["id"]) == ("shutdown", "shutdown")
            came_back = await register(b"nodeA/w0-0")
            assert came_back["type"] == "shutdown"
            stats = await sup.stats(engines=False)
            remote = [w for w in stats["workers"] if "/" in w["worker_id"]]
            assert [(w["worker_id"], w["state"]) for w in remote] == [("nodeA/w0-1", "ready")]
        finally:
            for ctx, sock in socks.values():
                sock.close()
                ctx.term()


async def _register_as(sock, name: str) -> None:
    """Register a raw remote-worker DEALER as ``name`` and check that it was admitted."""
    import msgpack

    sock.send(msgpack.packb({"v": 1, "type": "register", "id": "register", "worker_id": name, "pid": 1,
                             "engine": "echo"}))
    assert await asyncio.to_thread(sock.poll, 10_000), f"{name} was not admitted"
    assert msgpack.unpackb(sock.recv())["type"] == "reply"


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_stats_keeps_only_the_remote_slots_that_died_last(tmp_path):
    # Agents started again fill new slots; the slots of workers that are gone are kept up to
    # keep_dead_remote_slots, the last to die, and a forgotten slot that comes back takes a new
    # index. A live slot is never forgotten, nor a spawned worker's.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=0, keep_dead_remote_slots=2) as (sup, dealer):
        socks = {}
        try:
            async def register(name: str) -> None:
                socks[name] = socks.get(name) or dealer(name.encode())
                await _register_as(socks[name][1], name)

            async def rows() -> list[tuple[str, int, str]]:
                stats = await sup.stats(engines=False)
                return [(w["worker_id"], w["index"], w["state"]) for w in stats["workers"]]

            async def leave(name: str) -> None:
                socks[name][1].send(msgpack.packb({"v": 1, "type": "worker_exit", "id": "x", "reason": "done"}))
                for _ in range(500):
                    if name not in sup.workers:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{name} was not taken for gone")

            for name in ("a/w0-0", "b/w0-0", "c/w0-0", "d/w0-0"):
                await register(name)
            assert [r[1] for r in await rows()] == [0, 1, 2, 3, 4]
            for name in ("b/w0-0", "a/w0-0", "d/w0-0"):
                await leave(name)
            assert await rows() == [("w0-0", 0, "ready"), ("a/w0-0", 1, "dead"), ("c/w0-0", 3, "ready"),
                                    ("d/w0-0", 4, "dead")]
            await register("b/w0-1")  # its slot was forgotten: a new index
            await leave("c/w0-0")
            assert await rows() == [("w0-0", 0, "ready"), ("c/w0-0", 3, "dead"), ("d/w0-0", 4, "dead"),
                                    ("b/w0-1", 5, "ready")]
            assert sorted(sup._restarts) == [0, 3, 4, 5]
        finally:
            for ctx, sock in socks.values():
                sock.close()
                ctx.term()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_new_generation_keeps_its_slot_even_when_no_dead_slot_is_kept(tmp_path):
    # keep_dead_remote_slots=0 forgets a slot as its worker dies, but not the slot whose worker
    # dies because a new generation of it registered: that one lives on, at its index.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=0, keep_dead_remote_slots=0) as (sup, dealer):
        socks = []
        try:
            for name in ("x/w0-0", "x/w0-1"):
                socks.append(dealer(name.encode()))
                await _register_as(socks[-1][1], name)
            stats = await sup.stats(engines=False)
            assert [(w["worker_id"], w["index"], w["state"]) for w in stats["workers"]] == [
                ("w0-0", 0, "ready"), ("x/w0-1", 1, "ready")]
            socks[1][1].send(msgpack.packb({"v": 1, "type": "worker_exit", "id": "x", "reason": "done"}))
            for _ in range(500):
                if len((await sup.stats(engines=False))["workers"]) == 1:
                    break
                await asyncio.sleep(0.01)
            assert [w["worker_id"] for w in (await sup.stats(engines=False))["workers"]] == ["w0-0"]
            # Its slot is forgotten, not its generation: the replaced x/w0-0, come back, is still
            # refused and told to go; a newer one takes a new index.
            stale = socks[0][1]
            while stale.poll(0):
                stale.recv()  # the shutdown it was sent when replaced
            stale.send(msgpack.packb({"v": 1, "type": "register", "id": "register", "worker_id": "x/w0-0",
                                      "pid": 1, "engine": "echo"}))
            assert await asyncio.to_thread(stale.poll, 10_000)
            assert msgpack.unpackb(stale.recv())["type"] == "shutdown"
            assert "x/w0-0" not in sup.workers
            socks.append(dealer(b"x/w0-2"))
            await _register_as(socks[-1][1], "x/w0-2")
            stats = await sup.stats(engines=False)
            assert [(w["worker_id"], w["index"]) for w in stats["workers"]] == [("w0-0", 0), ("x/w0-2", 2)]
        finally:
            for ctx, sock in socks:
                sock.close()
                ctx.term()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_remote_worker_taken_for_dead_that_registers_again_is_admitted_as_a_new_start(tmp_path):
    # PROTOCOL.md 6.10: once taken for dead (here its worker_exit) the fleet drops what the
    # identity sends until it registers again, and that register admits it as a new start of its
    # slot, the same generation included: answered with a reply, not told to go, and it serves.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=0) as (sup, dealer):
        ctx, sock = dealer(b"back/w0-0")
        try:
            await _register_as(sock, "back/w0-0")
            sock.send(msgpack.packb({"v": 1, "type": "worker_exit", "id": "exit", "reason": "exit"}))
            for _ in range(500):
                if "back/w0-0" not in sup.workers:
                    break
                await asyncio.sleep(0.01)
            assert "back/w0-0" not in sup.workers
            while sock.poll(0):
                sock.recv()  # anything sent to it before it went
            await _register_as(sock, "back/w0-0")  # a reply: admitted again
            await asyncio.sleep(0.2)
            assert not sock.poll(0), f"told more after its reply: {msgpack.unpackb(sock.recv())}"
            handle = sup.workers.get("back/w0-0")
            assert handle is not None and handle.alive
            stats = await sup.stats(engines=False)
            assert [(w["worker_id"], w["index"], w["state"]) for w in stats["workers"]] == [
                ("w0-0", 0, "ready"), ("back/w0-0", 1, "ready")]
            # It serves: a request routed to it arrives as a generate.
            client = sup.client()
            sup.router.set_available("w0-0", False)
            task = asyncio.create_task(client.generate("r", [5, 6], SamplingParams(max_tokens=2)))
            assert await asyncio.to_thread(sock.poll, 10_000)
            frame = msgpack.unpackb(sock.recv())
            items = frame["messages"] if frame["type"] == "batch" else [frame]
            gen = [m for m in items if m["type"] == "generate"]
            assert gen and gen[0]["prompt_ids"] == [5, 6]
            sock.send(msgpack.packb({"v": 1, "type": "result", "id": gen[0]["id"], "token_ids": [1, 2],
                                     "finish_reason": "length", "weight_versions": [0]}))
            result = await asyncio.wait_for(task, 10)
            assert result.token_ids == [1, 2] and result.worker == "back/w0-0"
        finally:
            sock.close()
            ctx.term()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
async def test_a_worker_refused_at_the_handshake_must_connect_anew_once_its_key_is_allowed(tmp_path):
    # PROTOCOL.md 1 and 6.10: ZeroMQ does not try a connection refused at the CurveZMQ handshake
    # again, so a key allowed later admits only a new socket, not the one refused before.
    import msgpack

    async with fleet_with_a_worker_key(tmp_path, tokens_per_s=0) as (sup, _):
        pub, sec = zmq.curve_keypair()
        server_pub = load_client_keys(str(tmp_path / "keys"))[2]
        register = msgpack.packb({"v": 1, "type": "register", "id": "register", "worker_id": "late/w0-0",
                                  "pid": 1, "engine": "echo"})
        ctx, early = _curve_dealer(sup.worker_address, b"late/w0-0", pub, sec, server_pub)
        fresh = None
        try:
            with contextlib.suppress(zmq.Again):
                early.send(register, zmq.DONTWAIT)
            await asyncio.sleep(0.5)  # refused at the handshake: its key is not allowed yet
            sup.allow_worker_key(pub)
            for _ in range(8):
                with contextlib.suppress(zmq.Again):
                    early.send(register, zmq.DONTWAIT)
                await asyncio.sleep(0.25)
            assert not early.poll(0) and "late/w0-0" not in sup.workers
            early.close()
            fresh = _curve_dealer(sup.worker_address, b"late/w0-0", pub, sec, server_pub)
            await _register_as(fresh[1], "late/w0-0")
            assert "late/w0-0" in sup.workers
        finally:
            early.close()
            ctx.term()
            if fresh is not None:
                fresh[1].close()
                fresh[0].term()
