import pytest
import torch

from rollfleet.weights.bucket import (
    ALIGN, DTYPES, Assembler, Packer, bucket_nbytes, check_pair, check_whole, dtype_from_name, fill, unpack,
)
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


def test_in_place_tensors_take_no_buffer_room_but_count_towards_the_bucket():
    """With an in_place function (cuda_ipc's reads CUDA tensors where they lie), tensors it
    accepts get its 'segment' and 'offset' instead of a place in the buffer; fill skips them."""
    big = torch.arange(600, dtype=torch.float32)  # 2400 bytes: larger than a bucket
    weights = [("a", torch.ones(100)), ("b", torch.full((100,), 2.0)), ("c", torch.full((60,), 3.0)),
               ("big", big), ("d", torch.full((30,), 4.0))]
    chosen = {id(weights[1][1]): 0, id(weights[3][1]): 1}

    def in_place(t):
        k = chosen.get(id(t))
        return None if k is None else {"segment": k, "offset": 64 * k}

    packer = Packer(iter(weights), 1024, in_place)
    buckets = list(packer)
    entries = {e["name"]: (b.index, e) for b in buckets for e in b.entries}
    assert entries["b"][1]["segment"] == 0 and entries["b"][1]["offset"] == 0
    assert entries["big"][1]["segment"] == 1 and entries["big"][1]["offset"] == 64
    assert "part_offset" not in entries["big"][1]  # never split: it takes no room
    # a (400 B in the buffer, then aligned to 448) + b (400 B in place) leave 176 B: c (240 B) goes on.
    assert entries["a"][0] == entries["b"][0] == 0 and entries["c"][0] == 1
    assert entries["big"][0] == 2 and [e["name"] for e in buckets[2].entries] == ["big"]  # alone
    assert buckets[0].nbytes == 400 and buckets[0].in_place == 400
    assert [t is weights[1][1] for t in buckets[0].sources_in_place] == [True]
    assert packer.nbytes_in_place == 400 + 2400 and packer.nbytes == 400 + 400 + 240 + 2400 + 120
    buf = torch.zeros(1024, dtype=torch.uint8)
    fill(buckets[0], buf)
    assert torch.equal(buf[:400].view(torch.float32), weights[0][1]) and buf[400:].eq(0).all()
    assert bucket_nbytes(buckets[0].entries) == 400 and bucket_nbytes(buckets[2].entries) == 0


@pytest.mark.parametrize("entry", [
    {"name": "x", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 16},
    {"name": "x", "dtype": "float32", "shape": [2], "offset": 2, "nbytes": 8},
    {"name": "x", "dtype": "float32", "shape": [2], "offset": -8, "nbytes": 8},
])
def test_check_whole_refuses_bytes_that_do_not_match_the_tensor(entry):
    with pytest.raises(ValueError):
        check_whole(entry)


def test_a_meta_tensor_is_refused_by_name_before_any_copy():
    with pytest.raises(ValueError, match="'w' is on the meta device: it has a shape and no data"):
        check_pair(("w", torch.empty(4, 4, device="meta")))
    with torch.device("meta"):  # a model built without its weights
        layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        check_pair(next(iter(layer.named_parameters())))
