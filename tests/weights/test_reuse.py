"""Transfer buffers kept between updates: reused while the receivers hold them, replaced
when one does not, and never left behind under a name."""

import os

import torch

from rollfleet.transport.messages import WeightsBegin
from rollfleet.weights import WeightReceiver, WeightSender, WeightSyncConfig, release_buffers, shm
from rollfleet.weights.bucket import Assembler, Packer, fill
from weights_harness import LocalLink, StoreEngine, digest, make_weights


def begins(link):
    return [m for m in link.sent if isinstance(m, WeightsBegin)]


async def test_second_update_reuses_the_same_segments_without_names():
    engine = StoreEngine()
    link = LocalLink("a", WeightReceiver(engine))
    sender = WeightSender(WeightSyncConfig(bucket_bytes=4096, transport="shm"))
    await sender.update(iter(make_weights(big_bytes=20000)), 1, [link])
    first = begins(link)[0].buffers
    assert all("name" in b for b in first)
    assert shm.list_segments(os.getpid()) == []  # names dropped right after the begin
    weights = make_weights(big_bytes=20000, seed=1)
    # A new sender object (the supervisor makes one per update) still finds the kept segments.
    await WeightSender(WeightSyncConfig(bucket_bytes=4096, transport="shm")).update(iter(weights), 2, [link])
    second = begins(link)[1].buffers
    assert [b["pool"] for b in second] == [b["pool"] for b in first]
    assert all("name" not in b for b in second)
    assert engine.digests() == {n: digest(t) for n, t in weights} and link.receiver.version == 2
    assert shm.list_segments(os.getpid()) == []


async def test_a_receiver_without_the_kept_segments_gets_fresh_named_ones():
    old = LocalLink("a", WeightReceiver(StoreEngine()))
    cfg = WeightSyncConfig(bucket_bytes=4096, transport="shm")
    await WeightSender(cfg).update(iter(make_weights(big_bytes=9000)), 1, [old])
    engine = StoreEngine()
    restarted = LocalLink("b", WeightReceiver(engine))  # like a restarted worker: maps nothing yet
    weights = make_weights(big_bytes=9000, seed=2)
    report = await WeightSender(cfg).update(iter(weights), 2, [old, restarted])
    assert report.ok
    tried, fresh = begins(restarted)
    assert "name" not in tried.buffers[0] and "name" in fresh.buffers[0]
    assert fresh.buffers[0]["pool"] != tried.buffers[0]["pool"]
    assert engine.digests() == {n: digest(t) for n, t in weights}
    assert old.receiver.version == 2 and restarted.receiver.version == 2
    assert shm.list_segments(os.getpid()) == []


async def test_keep_buffers_off_and_release_start_each_update_afresh():
    link = LocalLink("a", WeightReceiver(StoreEngine()))
    cfg = WeightSyncConfig(bucket_bytes=4096, transport="shm", keep_buffers=False)
    for version in (1, 2):
        await WeightSender(cfg).update(iter(make_weights(big_bytes=9000)), version, [link])
    a, b = begins(link)
    assert "name" in b.buffers[0] and a.buffers[0]["pool"] != b.buffers[0]["pool"]
    cfg = WeightSyncConfig(bucket_bytes=4096, transport="shm")
    await WeightSender(cfg).update(iter(make_weights()), 3, [link])
    release_buffers()
    await WeightSender(cfg).update(iter(make_weights()), 4, [link])
    assert begins(link)[2].buffers[0]["pool"] != begins(link)[3].buffers[0]["pool"]
    assert link.receiver.version == 4


def test_assembler_reuses_the_space_of_a_split_tensor_across_updates():
    big = torch.arange(5000, dtype=torch.int32)
    assembler = Assembler(keep=True)
    seen = []
    for scale in (1, 3):
        assembler.start()
        for bucket in Packer([("big", big * scale)], 4096):
            buf = torch.zeros(4096, dtype=torch.uint8)
            fill(bucket, buf)
            for name, t in assembler.add(buf, bucket.entries):
                assert torch.equal(t, big * scale)
                seen.append(t.untyped_storage().data_ptr())
    assert len(seen) == 2 and seen[0] == seen[1]
