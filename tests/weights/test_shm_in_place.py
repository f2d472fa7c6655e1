"""shm in place: engines read the sender's CPU tensors straight out of its memory
(process_vm_readv), one copy instead of two; everything else still goes through the segments.

In-process tests use LocalLink (the worker's reads then target this same process, which the
kernel allows like any other); the fleet test at the end runs the torch engine in a worker
process of a real Supervisor."""

import os
import re
import subprocess
import sys

import pytest
import torch

from rollfleet.errors import EngineFailed, InvalidRequest, WeightUpdateError
from rollfleet.transport.messages import WeightsBegin, WeightsBucket, WeightsEnd
from rollfleet.weights import WeightReceiver, WeightSender, WeightSyncConfig, remote, shm
from rollfleet.weights.bucket import Packer
from weights_harness import LocalLink, RemoteStoreEngine, StoreEngine, digest, make_weights

pytestmark = pytest.mark.skipif(not remote.available(), reason="process_vm_readv is Linux-only")

MIB = 1 << 20


def big_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """make_weights' mix plus tensors of 1 MiB and more: contiguous ones of several dtypes
    (read in place), a transposed one and one just under 1 MiB (through the segments)."""
    g = torch.Generator().manual_seed(seed)
    out = make_weights(seed=seed)
    out += [
        ("in_place.bf16", torch.randn(1024, 768, generator=g).to(torch.bfloat16)),   # 1.5 MiB
        ("in_place.fp32", torch.randn(600, 1000, generator=g)),                      # 2.3 MiB
        ("in_place.int64", torch.randint(-(2**62), 2**62, (300_000,), generator=g)),  # 2.3 MiB
        ("transposed.fp32", torch.randn(700, 500, generator=g).t()),                 # not contiguous
        ("just_under", torch.randn(MIB // 4 - 16, generator=g)),
    ]
    return out


def eligible(weights, capacity: int | None = None) -> int:
    n = 0
    for _, t in weights:
        size = t.numel() * t.element_size()
        if t.is_contiguous() and size >= remote.IN_PLACE_MIN_BYTES and (capacity is None or size <= capacity):
            n += size
    return n


def local(worker_id, engine):
    return LocalLink(worker_id, WeightReceiver(engine))


def entries(link):
    return [e for m in link.sent if isinstance(m, WeightsBucket) for e in m.tensors]


@pytest.mark.parametrize("bucket_bytes", [3 * MIB, 64 * MIB])
async def test_engines_that_take_remote_tensors_read_big_contiguous_ones_in_place_bit_exact(bucket_bytes):
    weights = big_weights()
    links = [local("a", RemoteStoreEngine()), local("b", RemoteStoreEngine())]
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=bucket_bytes)).update(
        iter(weights), 3, links)
    assert report.ok and report.in_place_bytes == eligible(weights) > 0
    for link in links:
        engine = link.receiver.engine
        assert engine.digests() == {n: digest(t) for n, t in weights}
        assert sorted(engine.remote_names) == ["in_place.bf16", "in_place.fp32", "in_place.int64"]
        placed = {e["name"]: e for e in entries(link) if "address" in e}
        assert set(placed) == set(engine.remote_names)
        assert all(placed[n]["address"] == t.data_ptr() for n, t in weights if n in placed)
        begin = next(m for m in link.sent if isinstance(m, WeightsBegin))
        assert set(begin.options["in_place"]) == {"address", "check"}
        assert link.receiver.version == 3
    assert shm.list_segments(os.getpid()) == []


async def test_a_tensor_larger_than_a_bucket_is_read_in_place_once_every_worker_accepted():
    """Before the begin's replies a tensor must fit a bucket (the bucket may have to move
    into the buffer); afterwards a larger one goes in place alone."""
    weights = [("first", torch.randn(MIB)), ("second", torch.randn(MIB // 2)), ("huge", torch.randn(3 * MIB)),
               ("last", torch.randn(MIB // 2))]  # 4, 2, 12 and 2 MiB
    link = local("a", RemoteStoreEngine())
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=5 * MIB)).update(
        iter(weights), 1, [link])
    assert report.ok and report.in_place_bytes == report.bytes == 20 * MIB and report.num_buckets == 4
    assert link.receiver.engine.digests() == {n: digest(t) for n, t in weights}
    assert sorted(link.receiver.engine.remote_names) == ["first", "huge", "last", "second"]


@pytest.mark.parametrize("bucket_bytes", [3 * MIB, 64 * MIB])
async def test_one_worker_that_cannot_read_in_place_sends_everything_through_the_segments(bucket_bytes):
    """The first bucket is packed before the workers answer the begin: its in-place tensors
    move into the buffer (which has room for them) when one worker says no."""
    weights = big_weights(seed=1)
    links = [local("a", RemoteStoreEngine()), local("b", StoreEngine())]
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=bucket_bytes)).update(
        iter(weights), 2, links)
    assert report.ok and report.in_place_bytes == 0
    for link in links:
        assert link.receiver.engine.digests() == {n: digest(t) for n, t in weights}
        assert not any("address" in e for e in entries(link))
    assert getattr(links[0].receiver.engine, "remote_names", []) == []


async def test_in_place_off_sends_every_byte_through_the_segments():
    weights = big_weights()
    link = local("a", RemoteStoreEngine())
    config = WeightSyncConfig(transport="shm", bucket_bytes=4 * MIB, in_place=False)
    report = await WeightSender(config).update(iter(weights), 1, [link])
    assert report.ok and report.in_place_bytes == 0
    assert not any("address" in e for e in entries(link))
    assert "in_place" not in next(m for m in link.sent if isinstance(m, WeightsBegin)).options
    assert link.receiver.engine.digests() == {n: digest(t) for n, t in weights}


def test_refused_bucket_moves_in_place_tensors_into_its_buffer_within_capacity():
    """Packer + stop_in_place: a bucket packed with in-place tensors fits its capacity once
    they move into the buffer, at aligned offsets, and the pending tensor follows them."""
    tensors = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate([300_000, 7, 262_145, 100_001, 262_144])]
    packer = Packer(iter(tensors), 2 * MIB, lambda t: {"address": t.data_ptr()} if t.numel() > 100_000 else None)
    buckets = iter(packer)
    first = next(buckets)
    assert first.in_place and first.sources_in_place
    packer.stop_in_place(first)
    rest = list(buckets)
    assert packer.nbytes_in_place == 0 and not first.in_place and not first.sources_in_place
    for bucket in [first] + rest:
        spans = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in bucket.entries)
        assert all(e["offset"] % 64 == 0 and "address" not in e for e in bucket.entries)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        assert bucket.nbytes == spans[-1][1] <= packer.capacity
    buffer = torch.zeros(packer.capacity, dtype=torch.uint8)
    from rollfleet.weights.bucket import Assembler, fill

    got = {}
    asm = Assembler()
    for bucket in [first] + rest:
        fill(bucket, buffer)
        got.update({n: t.clone() for n, t in asm.add(buffer, bucket.entries)})
    assert {n: digest(t) for n, t in got.items()} == {n: digest(t) for n, t in tensors}


async def test_address_entries_without_an_accepted_in_place_begin_are_refused():
    link = local("a", StoreEngine())
    rx = link.receiver
    weights = make_weights()
    assert (await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=4096)).update(weights, 3, [link])).ok
    t = torch.arange(4, dtype=torch.float32)
    entry = {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16, "address": t.data_ptr()}
    await rx.handle(WeightsBegin(id="w9.begin", version=4, transport="zmq", bucket_bytes=64, buffers=[{"size": 64}]))
    with pytest.raises(InvalidRequest, match="address"):
        await rx.handle(WeightsBucket(id="w9.0", index=0, buffer=0, tensors=[entry]))
    with pytest.raises(EngineFailed, match="not committed"):
        await rx.handle(WeightsEnd(id="w9.end", version=4))
    assert rx.version == 3 and rx.engine.digests() == {n: digest(t) for n, t in weights}
    assert (await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=4096)).update(weights, 5, [link])).ok


async def test_an_address_the_sender_does_not_map_fails_the_bucket_not_the_worker():
    """An accepted update whose entry names unmapped memory: the engine's read fails with
    EFAULT, the bucket fails (EngineFailed; weights_failed on the wire), the update is not
    committed, the next lands."""
    engine = RemoteStoreEngine()
    link = local("a", engine)
    rx = link.receiver
    probe = remote.Probe()
    size = 4096
    seg = shm.Segments(size, 1)
    try:
        begin = WeightsBegin(id="w1.begin", version=1, transport="shm", bucket_bytes=size,
                             buffers=[{"size": size, "pool": seg.token, "index": 0, "name": seg.names[0]}],
                             options={"sender_pid": os.getpid(), "in_place": probe.describe()})
        assert (await rx.handle(begin))["in_place"] is True
        bad = {"name": "x", "dtype": "float32", "shape": [MIB // 4], "offset": 0, "nbytes": MIB, "address": 4096}
        with pytest.raises(EngineFailed, match="Bad address|EFAULT|short read"):
            await rx.handle(WeightsBucket(id="w1.0", index=0, buffer=0, tensors=[bad]))
        with pytest.raises(EngineFailed, match="not committed"):
            await rx.handle(WeightsEnd(id="w1.end", version=1))
        malformed = dict(bad, address="0x1000")
        again = WeightsBegin(id="w2.begin", version=1, transport="shm", bucket_bytes=size, buffers=begin.buffers,
                             options=begin.options)
        assert (await rx.handle(again))["in_place"] is True
        with pytest.raises(InvalidRequest, match="address"):
            await rx.handle(WeightsBucket(id="w2.0", index=0, buffer=0, tensors=[malformed]))
        await rx.handle(WeightsEnd(id="w2.end", version=1, commit=False))
    finally:
        seg.unlink_names()
    weights = big_weights()
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=8 * MIB)).update(weights, 2, [link])
    assert report.ok and report.in_place_bytes > 0 and rx.version == 2
    assert engine.digests() == {n: digest(t) for n, t in weights}


async def test_probe_refuses_wrong_bytes_a_dead_process_and_malformed_offers():
    probe = remote.Probe()
    assert remote.probe(os.getpid(), probe.describe()) is None
    assert "other bytes" in remote.probe(os.getpid(), {"address": probe.address, "check": bytes(16)})
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert remote.probe(child.pid, probe.describe()) is not None  # gone: ESRCH
    assert remote.probe(os.getpid(), {"address": "x", "check": b"1"}) == "malformed probe"
    assert remote.probe(os.getpid(), None) == "malformed probe"


def test_read_into_reads_another_processes_tensor_across_threads(tmp_path):
    """A real second process: a child holds a tensor and waits; this process reads it."""
    code = (
        "import sys, torch\n"
        "t = torch.arange(5_000_000, dtype=torch.int64)\n"
        "print(t.data_ptr(), flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = int(child.stdout.readline())
        src = remote.RemoteTensor(child.pid, address, torch.int64, [5_000_000], 40_000_000)
        for threads in (1, 3):
            dst = torch.zeros(5_000_000, dtype=torch.int64)
            remote.read_into([(src, dst)], threads=threads)
            assert torch.equal(dst, torch.arange(5_000_000, dtype=torch.int64))
        part = remote.RemoteTensor(child.pid, address + 8 * 1000, torch.int64, [10, 10], 800)
        assert torch.equal(part.read(), torch.arange(1000, 1100).view(10, 10))
        strided = torch.zeros(10, 20, dtype=torch.int64)[:, ::2]
        part.copy_into(strided)
        assert torch.equal(strided, torch.arange(1000, 1100).view(10, 10))
        with pytest.raises(ValueError, match="cannot read"):
            part.copy_into(torch.zeros(100, dtype=torch.int64))
    finally:
        child.stdin.close()
        child.wait(30)
    with pytest.raises(OSError):
        remote.read_into([(src, torch.zeros(5_000_000, dtype=torch.int64))])


# ---------------------------------------------------------------------------- a real fleet


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A Llama small enough for CPU tests with embeddings of 2 MiB (read in place) and
    smaller layers (through the segments)."""
    import transformers

    path = str(tmp_path_factory.mktemp("wide-llama"))
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


async def test_torch_fleet_reads_the_trainers_tensors_in_place_and_decodes_with_them(wide_model):
    import transformers

    from rollfleet.actors.config import FleetConfig
    from rollfleet.actors.supervisor import Supervisor
    from rollfleet.transport.messages import SamplingParams

    hf = transformers.LlamaForCausalLM.from_pretrained(wide_model, dtype=torch.float32).eval()
    prompt = [1, 5, 9, 33]

    def greedy() -> torch.Tensor:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)
        return out[0, len(prompt):]

    old = {k: v.clone() for k, v in hf.state_dict().items()}
    before = greedy()
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    hf.load_state_dict(new)
    want = greedy()
    assert want.tolist() != before.tolist()
    cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"model": wide_model})
    async with Supervisor(cfg) as sup:
        report = await sup.update_weights(list(new.items()), 1)
        assert report.ok and report.in_place_bytes == eligible(list(new.items()), 256 << 20) >= 4 * MIB
        assert [w.transport for w in report.workers.values()] == ["shm"]
        result = await sup.client().generate("r1", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        assert result.token_ids == want.tolist() and result.weight_versions == [1]
        # The old weights through the segments only, then the new ones in place again.
        sup.config.weights["in_place"] = False
        report = await sup.update_weights(list(old.items()), 2)
        assert report.ok and report.in_place_bytes == 0
        result = await sup.client().generate("r2", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        assert result.token_ids == before.tolist() and result.weight_versions == [2]
        sup.config.weights["in_place"] = True
        report = await sup.update_weights(list(new.items()), 3)
        assert report.ok and report.in_place_bytes > 0
        result = await sup.client().generate("r3", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        assert result.token_ids == want.tolist() and result.weight_versions == [3]


class InOrderRemoteEngine(StoreEngine):
    """Takes RemoteTensor values and applies every pair in the order given, as a real engine
    copying each into its parameter does: of a name given twice, the last one stays."""

    name = "in-order-remote"
    accepts_remote_tensors = True

    async def load_weights(self, weights) -> None:
        from rollfleet.weights.remote import RemoteTensor

        self.order = getattr(self, "order", [])
        for name, tensor in weights:
            if isinstance(tensor, RemoteTensor):
                dst = torch.empty(tensor.shape, dtype=tensor.dtype)
                tensor.copy_into(dst)
            else:
                dst = tensor.clone()
            self.weights[name] = dst
            self.order.append((name, isinstance(tensor, RemoteTensor)))
        self.num_loads += 1


@pytest.mark.parametrize("first_in_place", [True, False])
async def test_a_name_given_twice_once_in_place_once_through_a_segment_loads_the_last_one(first_in_place):
    g = torch.Generator().manual_seed(3)
    contiguous = torch.randn(600, 1000, generator=g)  # 2.3 MiB: read in place
    transposed = torch.randn(1000, 600, generator=g).t()  # the same shape, not contiguous: through the segment
    pairs = [("w", contiguous), ("w", transposed)] if first_in_place else [("w", transposed), ("w", contiguous)]
    link = local("a", InOrderRemoteEngine())
    report = await WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=64 * MIB)).update(iter(pairs), 1, [link])
    engine = link.receiver.engine
    assert report.ok and report.in_place_bytes == contiguous.numel() * 4
    assert engine.order == [("w", first_in_place), ("w", not first_in_place)]  # the bucket's order
    assert torch.equal(engine.weights["w"], pairs[-1][1])


async def test_torch_fleet_loads_the_last_of_a_name_given_twice_when_the_first_was_read_in_place(wide_model):
    import transformers

    from rollfleet.actors.config import FleetConfig
    from rollfleet.actors.supervisor import Supervisor
    from rollfleet.transport.messages import SamplingParams

    hf = transformers.LlamaForCausalLM.from_pretrained(wide_model, dtype=torch.float32).eval()
    prompt = [1, 5, 9, 33]
    old = {k: v.clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    hf.load_state_dict(new)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    # Every name twice: first the old tensor (the big ones read in place), then the new one, the
    # matrices as non-contiguous views (through the segments). The new ones must win.
    views = [(k, v.t().contiguous().t() if v.dim() == 2 else v) for k, v in new.items()]
    assert sum(not t.is_contiguous() and t.numel() * 4 >= MIB for _, t in views) >= 2
    cfg = FleetConfig(engine="torch", num_workers=1, engine_options={"model": wide_model})
    async with Supervisor(cfg) as sup:
        report = await sup.update_weights([*old.items(), *views], 1)
        assert report.ok and report.in_place_bytes >= 2 * MIB
        result = await sup.client().generate("r", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        assert result.token_ids == want and result.weight_versions == [1]


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def kernel_at_least(major: int, minor: int) -> bool:
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return release is not None and (int(release[1]), int(release[2])) >= (major, minor)


async def test_tensors_read_in_place_by_two_updates_in_a_row_move_onto_huge_pages():
    # Both decided from the machine alone, before anything runs: where they hold, the
    # collapse must happen.
    if not remote._thp_enabled():
        pytest.skip("transparent huge pages are off on this machine (sysfs says never)")
    if not kernel_at_least(6, 1):
        pytest.skip(f"kernel {os.uname().release} has no MADV_COLLAPSE (Linux 6.1+)")
    t = torch.randn(6 * MIB)  # 24 MiB: several whole 2 MiB pages
    keep = t.clone()
    link = local("a", RemoteStoreEngine())
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=32 * MIB))
    assert (await sender.update([("t", t)], 1, [link])).in_place_bytes == t.numel() * 4
    assert not remote.huge_pages_pending()  # seen once: nothing to do yet
    await sender.update([("t", t)], 2, [link])
    job = remote._job
    assert job is not None
    assert job.result(60) >= 1  # ranges collapsed
    first_huge = -(-t.data_ptr() // (2 * MIB)) * (2 * MIB)  # madvise splits the mapping there
    assert anon_huge_kib(first_huge) >= 2048
    assert torch.equal(t, keep)  # the contents never change
    report = await sender.update([("t", t)], 3, [link])
    assert report.ok and link.receiver.engine.digests() == {"t": digest(keep)}
    off = WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=32 * MIB, huge_pages=False))
    before = remote._job
    await off.update([("t", t)], 4, [link])
    await off.update([("t", t)], 5, [link])
    assert remote._job is before


async def test_the_same_worker_processes_are_assumed_to_accept_again_even_for_the_first_bucket():
    """The first bucket is packed before the begin's replies: a tensor larger than a bucket
    goes in place there only when the same worker process accepted at the last update. A
    worker that then refuses fails that update (the tensor cannot move into a buffer), and the
    next update assumes nothing."""
    weights = [("embed", torch.randn(3 * MIB)), ("layer", torch.randn(MIB // 2)), ("head", torch.randn(3 * MIB))]
    engine = RemoteStoreEngine()
    link = local("a", engine)
    link.pid = 4242  # the worker process's pid, as the supervisor's links have it
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_bytes=4 * MIB))
    first = await sender.update(iter(weights), 1, [link])
    assert first.in_place_bytes == (3 + 0.5 + 3) * MIB * 4 - 3 * MIB * 4  # embed went through the segments
    engine.remote_names = []
    second = await sender.update(iter(weights), 2, [link])
    assert second.in_place_bytes == second.bytes and sorted(engine.remote_names) == ["embed", "head", "layer"]
    assert engine.digests() == {n: digest(t) for n, t in weights}
    engine.accepts_remote_tensors = False
    with pytest.raises(WeightUpdateError, match="refused the in-place reads"):
        await sender.update(iter(weights), 3, [link])
    assert link.receiver.version == 2
    third = await sender.update(iter(weights), 4, [link])
    assert third.ok and third.in_place_bytes == 0 and link.receiver.version == 4
    assert engine.digests() == {n: digest(t) for n, t in weights}
    engine.accepts_remote_tensors = True
    fourth = await sender.update(iter(weights), 5, [link])
    assert fourth.in_place_bytes == first.in_place_bytes  # accepted again, not assumed
    assert (await sender.update(iter(weights), 6, [link])).in_place_bytes == second.bytes
    link.pid = 4343  # another process under the same worker id (restarted): nothing assumed
    fifth = await sender.update(iter(weights), 7, [link])
    assert fifth.in_place_bytes == first.in_place_bytes and link.receiver.version == 7
