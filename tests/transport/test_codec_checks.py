"""decode's fast path (all value types as expected) and its field-by-field path must agree:
same messages for valid headers, the same typed rejections for invalid ones."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.transport import codec
from rollfleet.transport.messages import CHECKS, MESSAGE_CLASSES, Generate, Result, SamplingParams

from .test_codec import SAMPLES

# One value of each kind msgpack can produce, and lists/maps of mixed kinds.
ODD_VALUES = [0, -3, 2.5, True, False, None, "x", b"raw", [], [1, 2], [1, True], [1, 2.0], [1.5, 2], ["a"],
              {}, {"k": 1.0}, {"k": "v"}, [{"a": 1}], [{}, 3]]


def _header(msg):
    return msgpack.unpackb(codec.encode(msg))


def _annotations(cls):
    return {f.name: str(f.type) for f in dataclasses.fields(cls) if f.name != "id"}


def _valid(msg, name, annotation, value):
    if annotation == "SamplingParams":
        try:
            SamplingParams.from_wire(value)
        except ValueError:
            return False
        return True
    if not CHECKS[annotation](value):
        return False
    try:  # a range its class checks on top of the type (hello's lease_s)
        dataclasses.replace(msg, **{name: value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE.value)
@pytest.mark.parametrize("value", ODD_VALUES, ids=repr)
def test_every_field_accepts_exactly_what_its_check_accepts(msg, value):
    for name, annotation in _annotations(type(msg)).items():
        header = _header(msg)
        header[name] = value
        raw = msgpack.packb(header)
        if _valid(msg, name, annotation, value):
            decoded = codec.decode([raw])
            want = SamplingParams.from_wire(value) if annotation == "SamplingParams" else value
            assert getattr(decoded, name) == want
        else:
            with pytest.raises(codec.DecodeError) as info:
                codec.decode([raw])
            assert info.value.code == "bad_field" and info.value.msg_id == msg.id
            if annotation != "SamplingParams":
                assert f"'{name}'" in str(info.value)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE.value)
def test_absent_optional_fields_take_their_defaults(msg):
    cls = type(msg)
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    header = {k: v for k, v in _header(msg).items() if k in required or k in ("v", "type")}
    decoded = codec.decode([msgpack.packb(header)])
    kwargs = {k: v for k, v in header.items() if k not in ("v", "type")}
    if "sampling" in kwargs:
        kwargs["sampling"] = SamplingParams.from_wire(kwargs["sampling"])
    assert decoded == cls(**kwargs)


def test_decoded_messages_are_ordinary_frozen_dataclasses():
    msg = codec.decode([codec.encode(SAMPLES[5])])
    assert type(msg) is Result and msg == SAMPLES[5] and hash(msg.id) == hash("r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.worker = "w9"  # type: ignore[misc]


def test_sampling_values_are_checked_on_both_paths():
    base = _header(SAMPLES[0])
    for sampling, ok in [({"max_tokens": 3, "stop_token_ids": [1, 2]}, True), ({"temperature": 0}, True),
                         ({"stop_token_ids": [1, True]}, False), ({"stop_token_ids": [1.0]}, False),
                         ({"max_tokens": -1}, False), ({"top_k": 2.0}, False), ({"seed": True}, False),
                         # every key given: the fast path; some left out: the field-by-field one
                         ({**SamplingParams().to_wire(), "temperature": 2**64 - 1}, False),
                         ({"temperature": 2**64 - 1}, False), ({"temperature": 2**63}, False),
                         ({**SamplingParams().to_wire(), "temperature": 2**63 - 1}, True)]:
        raw = msgpack.packb({**base, "sampling": sampling})
        if ok:
            assert codec.decode([raw]).sampling == SamplingParams(**sampling)
        else:
            with pytest.raises(codec.DecodeError):
                codec.decode([raw])


def test_sampling_replace_copies_without_revalidating_and_keeps_the_stop_list_private():
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop_token_ids=[7])
    copy = params.replace()
    assert copy == params and copy.stop_token_ids is not params.stop_token_ids
    params.stop_token_ids.append(8)
    assert copy.stop_token_ids == [7]


_scalars = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.booleans(), st.none(),
                     st.text(max_size=3))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                       max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(tag=st.sampled_from(sorted(MESSAGE_CLASSES)), data=st.data())
def test_random_headers_decode_to_checked_messages_or_a_typed_error(tag, data):
    cls = MESSAGE_CLASSES[tag]
    header = {"v": 1, "type": tag, "id": "x"}
    for name, annotation in _annotations(cls).items():
        if data.draw(st.booleans()):
            header[name] = data.draw(_values)
    try:
        msg = codec.decode([msgpack.packb(header)])
    except codec.DecodeError as exc:
        # a batch's own id is ignored, even in an error about the batch itself
        assert exc.code == "bad_field" and exc.msg_id == ("" if tag == "batch" else "x")
        return
    for name, annotation in _annotations(cls).items():
        if name in header:
            value = getattr(msg, name)
            assert _valid(msg, name, annotation, value.to_wire() if isinstance(value, SamplingParams) else value)
    assert codec.decode([codec.encode(msg)]) == msg


def test_long_prompts_are_checked_token_by_token():
    prompt = list(range(4096))
    assert codec.decode([codec.encode(Generate(id="r", prompt_ids=prompt))]).prompt_ids == prompt
    for bad in (True, 1.0, "1", None):
        header = _header(Generate(id="r", prompt_ids=prompt))
        header["prompt_ids"][2048] = bad
        with pytest.raises(codec.DecodeError):
            codec.decode([msgpack.packb(header)])


@pytest.mark.parametrize("size", [1, 8, 9, 40])  # a plain loop up to 8 keys, the list-based check past that
@pytest.mark.parametrize("bad", [True, "1.0", None, [1.0], {"s": 1.0}], ids=repr)
def test_a_result_timings_map_takes_numbers_only_whatever_its_size(size, bad):
    base = Result(id="t", token_ids=[1], finish_reason="length")
    timings = {f"k{i}": (i if i % 2 else i + 0.5) for i in range(size)}
    decoded = codec.decode([codec.encode(dataclasses.replace(base, timings=timings))])
    assert decoded.timings == timings
    for at in (0, size - 1):  # the first key and the last
        header = _header(base)
        header["timings"] = {**timings, f"k{at}": bad}
        with pytest.raises(codec.DecodeError) as info:
            codec.decode([msgpack.packb(header)])
        assert info.value.code == "bad_field" and "'timings'" in str(info.value)
    assert not CHECKS["dict[str, float]"]({**timings, 7: 1.0})  # a key that is not a str, in-process
