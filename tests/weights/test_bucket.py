import pytest
import torch

from rollfleet.weights.bucket import ALIGN, DTYPES, Assembler, Packer, dtype_from_name, fill, unpack
from weights_harness import digest, make_weights


def roundtrip(weights, bucket_bytes):
    """Pack, fill a fresh buffer per bucket, assemble: {name: tensor}, and the buckets."""
    got, buckets = {}, []
    asm = Assembler()
    for b in Packer(iter(weights), bucket_bytes):
        assert b.nbytes <= bucket_bytes
        buf = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)
        fill(b, buf)
        for name, t in asm.add(buf, b.entries):
            got[name] = t.clone()
        buckets.append(b)
    assert asm.incomplete == []
    return got, buckets


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 4096, 1 << 20])
def test_every_tensor_roundtrips_bit_exact(bucket_bytes):
    weights = make_weights(big_bytes=3 * bucket_bytes)
    got, buckets = roundtrip(weights, bucket_bytes)
    assert list(got) == [n for n, _ in weights] or set(got) == {n for n, _ in weights}
    for name, t in weights:
        assert digest(got[name]) == digest(t), name
    assert buckets[-1].last and not any(b.last for b in buckets[:-1])


def test_all_supported_dtypes_keep_their_bits():
    weights = []
    for name, dtype in DTYPES.items():
        raw = torch.arange(256, dtype=torch.uint8).repeat(4)  # every byte value, NaN payloads included
        if dtype == torch.bool:
            raw = raw % 2  # torch itself normalises other bytes of a bool (clone does)
        weights.append((name, raw.view(dtype)))
    got, _ = roundtrip(weights, 512)
    for name, t in weights:
        assert got[name].dtype == t.dtype and digest(got[name]) == digest(t), name
    assert "bfloat16" in DTYPES and "float8_e4m3fn" in DTYPES


def test_tensor_larger_than_bucket_is_split_at_element_boundaries():
    big = torch.arange(1000, dtype=torch.float64)
    _, buckets = roundtrip([("a", torch.ones(3)), ("big", big)], 256)
    parts = [e for b in buckets for e in b.entries if e["name"] == "big"]
    assert len(parts) > 1 and sum(p["nbytes"] for p in parts) == big.numel() * 8
    assert all(p["nbytes"] % 8 == 0 and p["total_nbytes"] == 8000 for p in parts)
    assert [p["part_offset"] for p in parts] == sorted(p["part_offset"] for p in parts)


def test_offsets_are_aligned_and_small_tensors_share_a_bucket():
    weights = [(f"t{i}", torch.full((3,), i, dtype=torch.int8)) for i in range(100)]
    got, buckets = roundtrip(weights, 4096)
    assert len(buckets) == 2  # 100 entries of 64 aligned bytes
    assert all(e["offset"] % ALIGN == 0 for b in buckets for e in b.entries)
    assert all(torch.equal(got[n], t) for n, t in weights)


def test_packer_pulls_at_most_one_tensor_past_the_bucket():
    taken = []

    def gen():
        for i in range(50):
            taken.append(i)
            yield f"t{i}", torch.zeros(16, dtype=torch.int32)  # 64 bytes each

    packer = Packer(gen(), 256)
    for b in packer:
        assert b.num_taken == len(taken)
        assert len(taken) <= (b.index + 1) * 4 + 1


def test_unpack_returns_views_and_refuses_split_parts():
    weights = [("x", torch.arange(6, dtype=torch.int32).view(2, 3))]
    (b,) = list(Packer(weights, 128))
    buf = torch.zeros(128, dtype=torch.uint8)
    fill(b, buf)
    ((name, view),) = unpack(buf, b.entries)
    assert name == "x" and torch.equal(view, weights[0][1])
    buf.zero_()
    assert int(view.sum()) == 0  # a view, not a copy
    (split,) = [e for bb in Packer([("y", torch.zeros(100))], 128) for e in bb.entries][:1]
    with pytest.raises(ValueError, match="Assembler"):
        unpack(torch.zeros(128, dtype=torch.uint8), [split])


@pytest.mark.parametrize(
    "entry",
    [
        {"name": "x", "dtype": "float33", "shape": [1], "offset": 0, "nbytes": 4},
        {"name": "x", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 4},
        {"name": "x", "dtype": "float32", "shape": [1], "offset": 126, "nbytes": 4},
        {"name": "x", "dtype": "float32", "shape": [1], "offset": 2, "nbytes": 4},
        {"name": 3, "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4},
        "not a map",
    ],
)
def test_bad_entries_raise_value_error(entry):
    with pytest.raises(ValueError):
        Assembler().add(torch.zeros(128, dtype=torch.uint8), [entry])


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_bad_inputs_are_refused_before_packing():
    with pytest.raises(ValueError):
        list(Packer([("x", torch.zeros(2, dtype=torch.complex32))], 128))
    with pytest.raises(ValueError):
        list(Packer([("x", [1, 2])], 128))
    with pytest.raises(ValueError):
        Packer([], 32)
    with pytest.raises(ValueError):
        dtype_from_name("torch.float32")
