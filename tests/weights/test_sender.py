"""Sender and receiver in one process over LocalLink (every message through the wire codec)."""

import asyncio
import ipaddress
import socket
from types import SimpleNamespace

import psutil
import pytest
import torch

from rollfleet.engines.base import WeightsRefused
from rollfleet.errors import EngineFailed, InvalidRequest, WeightUpdateError
from rollfleet.transport.messages import WeightsBegin, WeightsBucket, WeightsEnd
from rollfleet.weights import WeightReceiver, WeightSender, WeightSyncConfig, choose_transport
from rollfleet.weights import shm
from rollfleet.weights.collective import rendezvous_address
from weights_harness import DescriptorEngine, LocalLink, StoreEngine, digest, make_weights


class FailingStore(StoreEngine):
    """StoreEngine whose load number ``fail_at`` raises what ``error()`` makes; ``calls`` counts
    every load asked of it, failed ones included."""

    fail_at = -1
    calls = 0

    def __init__(self, error) -> None:
        super().__init__()
        self.error = error

    async def load_weights(self, weights):
        self.calls += 1
        if self.num_loads == self.fail_at:
            raise self.error()
        await super().load_weights(weights)


def local(worker_id, engine=None):
    engine = engine or StoreEngine()
    return LocalLink(worker_id, WeightReceiver(engine)), engine


def mine():
    import os

    return shm.list_segments(os.getpid())


@pytest.mark.parametrize("bucket_bytes", [256, 4096, 1 << 20])
async def test_update_delivers_every_tensor_bit_exact_to_every_worker(bucket_bytes):
    weights = make_weights(big_bytes=3 * bucket_bytes)
    pairs = [local("a"), local("b")]
    report = await WeightSender(WeightSyncConfig(bucket_bytes=bucket_bytes, transport="shm")).update(
        iter(weights), 7, [link for link, _ in pairs]
    )
    assert report.ok and report.version == 7 and report.num_tensors == len(weights)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in weights)
    for link, engine in pairs:
        assert engine.digests() == {n: digest(t) for n, t in weights}
        assert link.receiver.version == 7
        assert report.workers[link.worker_id].ok and report.workers[link.worker_id].transport == "shm"
        buffers = {m.buffer for m in link.sent if isinstance(m, WeightsBucket)}
        # Three buffers by default on CPU; a single bucket needs only one.
        assert buffers == (set(range(min(3, report.num_buckets))) if report.num_buckets > 1 else {0})
    assert mine() == []


@pytest.mark.parametrize("num_buffers, expected", [(0, 3), (2, 2), (4, 4)])
async def test_buffers_are_shared_once_per_update_not_per_bucket(num_buffers, expected):
    link, engine = local("a")
    weights = make_weights()
    config = WeightSyncConfig(bucket_bytes=256, transport="shm", num_buffers=num_buffers)
    report = await WeightSender(config).update(iter(weights), 1, [link])
    assert report.num_buckets > expected
    begins = [m for m in link.sent if type(m).__name__ == "WeightsBegin"]
    assert len(begins) == 1 and len(begins[0].buffers) == expected
    assert {m.buffer for m in link.sent if isinstance(m, WeightsBucket)} == set(range(expected))
    assert engine.digests() == {n: digest(t) for n, t in weights}
    allowed = {"name", "dtype", "shape", "offset", "nbytes", "part_offset", "total_nbytes"}
    assert all(set(e) <= allowed for m in link.sent if isinstance(m, WeightsBucket) for e in m.tensors)


@pytest.mark.parametrize("num_buffers", [2, 3])
async def test_generator_is_consumed_at_most_num_buffers_buckets_ahead(num_buffers):
    taken = []

    def gen():
        for i in range(40):
            taken.append(i)
            yield f"t{i}", torch.full((16,), i, dtype=torch.int32)  # 64 bytes: 4 per 256-byte bucket

    class Watching(StoreEngine):
        async def load_weights(self, weights):
            seen.append((len(self.weights), len(taken)))
            await super().load_weights(weights)

    seen = []
    link, engine = local("a", Watching())
    await WeightSender(WeightSyncConfig(bucket_bytes=256, transport="shm", num_buffers=num_buffers)).update(
        gen(), 1, [link])
    assert len(engine.weights) == 40
    for loaded, pulled in seen:
        assert pulled <= loaded + 4 * num_buffers + 1 + 4  # this bucket, the other buffers', one pending


async def test_failed_update_aborts_everywhere_marks_partly_updated_engines_and_names_the_worker():
    good, good_engine = local("good")

    broken = FailingStore(lambda: RuntimeError("disk on fire"))
    bad, _ = local("bad", broken)
    sender = WeightSender(WeightSyncConfig(bucket_bytes=256, transport="shm"))
    await sender.update(make_weights(), 3, [good, bad])
    broken.fail_at = broken.num_loads + 2
    with pytest.raises(WeightUpdateError, match="bad.*disk on fire") as info:
        await sender.update(make_weights(seed=1), 4, [good, bad])
    assert info.value.worker_id == "bad" and isinstance(info.value.__cause__, EngineFailed)
    assert info.value.report.workers["bad"].error
    # Both engines applied the first buckets before the failure: neither holds version 3 any
    # more, and both say so (-1) so the supervisor can restore them.
    assert good.receiver.version == -1 and bad.receiver.version == -1
    assert [m.commit for m in good.sent if isinstance(m, WeightsEnd)][-1] is False
    assert good.receiver._update is None
    # The worker that failed is told to drop the update too (not waited for: it may be gone).
    for _ in range(200):
        if [m.commit for m in bad.sent if isinstance(m, WeightsEnd)][-1] is False:
            break
        await asyncio.sleep(0.01)
    assert [m.commit for m in bad.sent if isinstance(m, WeightsEnd)][-1] is False
    assert bad.receiver._update is None
    assert mine() == []


async def test_a_bucket_refused_whole_keeps_the_version_unless_an_earlier_bucket_was_applied():
    engine = FailingStore(lambda: WeightsRefused("load_weights: unknown names: x; nothing was loaded"))
    link, _ = local("a", engine)
    sender = WeightSender(WeightSyncConfig(bucket_bytes=256, transport="shm"))
    await sender.update(make_weights(), 3, [link])
    assert link.receiver.version == 3
    # The first bucket is refused: nothing of the update reached the model, which still holds 3,
    # and the buckets after it are refused without reaching the engine.
    engine.fail_at, calls = engine.num_loads, engine.calls
    with pytest.raises(WeightUpdateError, match="nothing was loaded"):
        await sender.update(make_weights(seed=1), 4, [link])
    assert link.receiver.version == 3 and engine.calls == calls + 1
    # The second bucket is refused, after the first was applied: a mix.
    engine.fail_at = engine.num_loads + 1
    with pytest.raises(WeightUpdateError, match="nothing was loaded"):
        await sender.update(make_weights(seed=2), 5, [link])
    assert link.receiver.version == -1


async def test_bad_input_mid_stream_aborts_everywhere():
    link, _ = local("a")

    def gen():
        yield from make_weights()
        yield "bad", "not a tensor"

    with pytest.raises(WeightUpdateError, match="not a tensor|torch.Tensor"):
        await WeightSender(WeightSyncConfig(bucket_bytes=256, transport="shm")).update(gen(), 1, [link])
    # Buckets before the bad item had reached the engine: it reports a mix (-1), not version 0.
    assert link.receiver.version == -1 and link.receiver._update is None and mine() == []


async def test_receiver_refuses_out_of_order_messages():
    rx = WeightReceiver(StoreEngine())
    with pytest.raises(InvalidRequest):
        await rx.handle(WeightsBucket(id="w1.0", index=0, buffer=0, tensors=[]))
    assert (await rx.handle(WeightsEnd(id="w1.end", version=5, commit=False)))["version"] == 0
    with pytest.raises(InvalidRequest):
        await rx.handle(WeightsEnd(id="w1.end", version=5, commit=True))


async def test_empty_update_commits_the_version():
    link, _ = local("a")
    report = await WeightSender(WeightSyncConfig(transport="shm")).update([], 9, [link])
    assert report.ok and report.num_buckets == 0 and link.receiver.version == 9


async def test_descriptor_engine_gets_raw_entries_by_shm_name():
    engine = DescriptorEngine()
    link, _ = local("a", engine)
    weights = make_weights(big_bytes=2000)
    await WeightSender(WeightSyncConfig(bucket_bytes=1024, transport="shm")).update(weights, 2, [link])
    assert engine.digests() == {n: digest(t) for n, t in weights}
    assert engine.descriptors and all(d["shm_name"].startswith("rf-") for d in engine.descriptors)
    assert any("part_offset" in e for d in engine.descriptors for e in d["tensors"])
    assert mine() == []


async def test_collective_gloo_in_one_process_alongside_shm():
    weights = make_weights(big_bytes=5000)
    a, a_engine = local("a")
    b, b_engine = local("b")
    b.host = "elsewhere.invalid"  # auto picks collective for a remote host
    cfg = WeightSyncConfig(bucket_bytes=2048, master_addr="127.0.0.1", timeout_s=30)
    assert choose_transport(a, cfg) == "shm" and choose_transport(b, cfg) == "collective"
    report = await WeightSender(cfg, fleet_host="192.0.2.77").update(weights, 11, [a, b])
    assert report.workers["b"].transport == "collective"
    for engine in (a_engine, b_engine):
        assert engine.digests() == {n: digest(t) for n, t in weights}
    assert b.receiver.version == 11
    assert _store_addr(b) == "127.0.0.1"  # master_addr goes before the fleet's host


def _store_addr(link) -> str:
    """The store address the sender gave ``link`` in its update's begin."""
    begins = [m for m in link.sent if isinstance(m, WeightsBegin)]
    assert begins, "no weights_begin reached the link"
    return begins[-1].options["addr"]


def _own_address(family: int) -> str | None:
    """One of this machine's addresses of ``family`` other than loopback (and, for IPv6, other
    than link-local), as its interfaces list them."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == family:
                ip = ipaddress.ip_address(address.address.partition("%")[0])
                if not (ip.is_loopback or ip.is_link_local):
                    return ip.compressed
    return None


OWN_IPV4 = _own_address(socket.AF_INET)
OWN_IPV6 = _own_address(socket.AF_INET6)


def test_the_collective_store_address_defaults_to_one_the_workers_can_dial():
    def links(*hosts):
        return [SimpleNamespace(host=h) for h in hosts]

    # every worker on this host: loopback, whatever else is known
    assert rendezvous_address(links("", "localhost", socket.gethostname()), "192.0.2.77") == "127.0.0.1"
    # a worker elsewhere: the host the fleet's worker socket is bound to, which it dialled
    assert rendezvous_address(links("", "elsewhere.invalid"), "192.0.2.77") == "192.0.2.77"
    # a loopback worker host is none of this host's addresses for another host (a tunnel's)
    assert rendezvous_address(links("elsewhere.invalid"), "127.0.0.1") == socket.getfqdn()
    assert rendezvous_address(links("elsewhere.invalid"), "::1") == socket.getfqdn()
    assert rendezvous_address(links("elsewhere.invalid"), "::ffff:127.0.0.1") == socket.getfqdn()
    # no such host known, and a name that does not resolve here: this host's name, the last resort
    assert rendezvous_address(links("elsewhere.invalid")) == socket.getfqdn()
    for own in (OWN_IPV4, OWN_IPV6):
        if own is not None:
            # a host that resolves: this host's address on the route to it (here one of this
            # machine's own addresses, whose route starts at itself), never a loopback one
            assert rendezvous_address(links("elsewhere.invalid", own)) == own


@pytest.mark.parametrize("own", [
    pytest.param(OWN_IPV4, id="ipv4",
                 marks=pytest.mark.skipif(OWN_IPV4 is None, reason="no IPv4 address but loopback")),
    pytest.param(OWN_IPV6, id="ipv6", marks=pytest.mark.skipif(OWN_IPV6 is None, reason="no global IPv6 address")),
])
@pytest.mark.parametrize("fleet_host", ["", "own"])
async def test_a_remote_worker_is_given_a_store_address_it_can_dial_without_master_addr(fleet_host, own):
    """Without master_addr, the worker is sent a store address that reaches this host from its
    own (the fleet's worker host, or the address on the route to the worker), and the group forms
    there: not this host's name, which on many machines resolves to 127.0.x.x only. Over IPv6 as
    over IPv4: the store, and gloo's device on each side, take the address as it is."""
    weights = make_weights(big_bytes=5000)
    link, engine = local("b")
    # Not this host by name (is_local_host), so collective: a name that does not resolve here
    # (the fleet's host is all there is to go by), or an address that does.
    link.host = "elsewhere.invalid" if fleet_host else own
    cfg = WeightSyncConfig(bucket_bytes=2048, timeout_s=30)
    assert choose_transport(link, cfg) == "collective"
    report = await WeightSender(cfg, fleet_host=own if fleet_host else "").update(weights, 4, [link])
    assert report.workers["b"].transport == "collective" and report.workers["b"].ok
    assert _store_addr(link) == own
    assert engine.digests() == {n: digest(t) for n, t in weights}


def test_config_is_validated():
    for bad in ({"bucket_bytes": 10}, {"transport": "carrier-pigeon"}, {"timeout_s": 0}, {"device": "cpu"}):
        with pytest.raises(ValueError):
            WeightSyncConfig(**bad)


@pytest.mark.parametrize("bad", [1, -1, 17, 2.0, "3", True])
def test_num_buffers_must_be_auto_or_2_to_16(bad):
    with pytest.raises(ValueError, match="num_buffers"):
        WeightSyncConfig(num_buffers=bad)


async def test_in_place_entries_are_refused_outside_cuda_ipc_and_fail_only_their_update():
    """'segment' (a tensor read in place from the sender's GPU memory) is cuda_ipc's alone: over
    another transport it is a bad message, the update it belongs to cannot be committed (a
    bucket of it is missing), and the receiver takes the next update."""
    link, engine = local("a")
    weights = make_weights()
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=4096)).update(weights, 3, [link])
    assert report.ok and report.in_place_bytes == 0
    rx = link.receiver
    bad = {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16, "segment": 0,
           "handle": b"\0" * 64}
    from rollfleet.transport.messages import WeightsBegin

    await rx.handle(WeightsBegin(id="w9.begin", version=4, transport="zmq", bucket_bytes=64, buffers=[{"size": 64}]))
    with pytest.raises(InvalidRequest, match="cuda_ipc"):
        await rx.handle(WeightsBucket(id="w9.0", index=0, buffer=0, tensors=[bad]))
    with pytest.raises(EngineFailed, match="not committed"):
        await rx.handle(WeightsEnd(id="w9.end", version=4))
    assert rx.version == 3 and rx._update is None
    assert engine.digests() == {n: digest(t) for n, t in weights}
    again = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=4096)).update(weights, 5, [link])
    assert again.ok and rx.version == 5


@pytest.mark.parametrize("ender", ["abort", "new-begin"])
async def test_a_receiver_held_in_a_broadcast_gives_it_up_when_its_sender_ends_the_update(ender):
    # Rank 0 joins the group but never broadcasts (its process stopped, say): the receiver's
    # bucket waited until the group's timeout, holding the receiver, and the sender's abort or
    # next begin waited behind it.
    from rollfleet.weights.collective import make_group, open_store, release_group

    rx = WeightReceiver(StoreEngine())
    store = open_store("127.0.0.1", 60)
    options = {"addr": "127.0.0.1", "port": store.port, "world_size": 2, "rank": 1, "backend": "gloo",
               "prefix": "test/held", "timeout_s": 60}
    root = asyncio.ensure_future(asyncio.to_thread(make_group, {**options, "rank": 0}, store))
    await rx.handle(WeightsBegin(id="w1.begin", version=1, transport="collective", bucket_bytes=64,
                                 buffers=[{"size": 64}], options=options))
    group = await root
    try:
        entry = {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}
        bucket = asyncio.ensure_future(rx.handle(WeightsBucket(id="w1.0", index=0, buffer=0, tensors=[entry])))
        await asyncio.sleep(0.5)
        assert not bucket.done()  # held in the broadcast rank 0 never starts
        end = (WeightsEnd(id="w1.end", version=1, commit=False) if ender == "abort" else
               WeightsBegin(id="w2.begin", version=2, transport="zmq", bucket_bytes=64, buffers=[{"size": 64}]))
        assert rx.interrupt(end)  # as the worker does on its arrival
        with pytest.raises(InvalidRequest, match="given up"):
            await asyncio.wait_for(bucket, 5)
        answer = await asyncio.wait_for(rx.handle(end), 5)
        assert answer.get("aborted") if ender == "abort" else rx._update.uid == "w2"
        assert not rx.interrupt(end)  # nothing is held any more
    finally:
        release_group(group)
        del group
