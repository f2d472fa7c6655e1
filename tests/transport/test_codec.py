import msgpack
import pytest

from rollfleet.transport import codec
from rollfleet.transport.messages import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Abort,
    AbortAll,
    Batch,
    Chunk,
    Control,
    Error,
    Generate,
    Heartbeat,
    Hello,
    Register,
    Reply,
    Result,
    SamplingParams,
    Stats,
    WeightsBegin,
    WeightsBucket,
    WeightsEnd,
    WorkerExit,
    Shutdown,
)

SAMPLES = [
    Generate(id="r1", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4, temperature=0.0, seed=7,
                                                                      stop_token_ids=[2], logprobs=True),
             stream=True, session_id="s", resume=False),
    Abort(id="a1", request_id="r1"),
    Stats(id="s1"),
    Control(id="c1", op="sleep", args={"level": 2}),
    Chunk(id="r1", token_ids=[5, 6], logprobs=[-0.5, -1.0], weight_version=3),
    Result(id="r1", token_ids=[5, 6, 7], finish_reason="length", logprobs=None, weight_versions=[1, 2],
           num_preemptions=1, worker="w0-0", timings={"total": 0.5}),
    Reply(id="c1", ok=True, data={"x": [1, 2]}),
    Error(id="r9", code="bad_field", message="nope", request_id="r9"),
    Register(id="register", worker_id="w0-0", pid=12, engine="echo", capabilities=["pause"], host="h"),
    Heartbeat(id="hb", num_inflight=2, num_tokens=10, weight_version=1),
    WorkerExit(id="x", reason="boom"),
    Shutdown(id="bye"),
    WeightsBegin(id="wb", version=3, transport="shm", bucket_bytes=1024, buffers=[{"name": "rf-x", "size": 1024}]),
    WeightsBucket(id="wk", index=0, buffer=1, tensors=[{"name": "w", "dtype": "float32", "shape": [2], "offset": 0,
                                                         "nbytes": 8}]),
    WeightsEnd(id="we", version=3, commit=False),
    Batch(id="", messages=[{"v": 1, "type": "stats", "id": "s2"}, {"v": 1, "type": "abort", "id": "a2", "request_id": "r"}]),
    Hello(id="h", batch=True),
    AbortAll(id="a2"),
    AbortAll(id="a3", session_id="s1"),
]


def test_every_message_type_has_a_sample():
    assert {type(m).TYPE.value for m in SAMPLES} == set(MESSAGE_CLASSES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE.value)
def test_round_trip(msg):
    raw = codec.encode(msg)
    header = msgpack.unpackb(raw)
    assert header["v"] == PROTOCOL_VERSION and header["type"] == msg.TYPE.value and header["id"] == msg.id
    assert all(isinstance(k, str) for k in header)
    assert codec.decode([raw]) == msg


def test_defaults_fill_missing_optional_fields():
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt_ids": [1]})
    msg = codec.decode([raw])
    assert msg == Generate(id="r", prompt_ids=[1])


def test_unknown_keys_are_ignored_for_forward_compatibility():
    raw = msgpack.packb({"v": 1, "type": "abort", "id": "a", "request_id": "r", "added_later": 1})
    assert codec.decode([raw]) == Abort(id="a", request_id="r")


def test_a_bin_value_is_skipped_in_an_unknown_field_and_the_wrong_type_in_a_known_one():
    # PROTOCOL.md section 3: bin is no str, but in a field the receiver does not know it goes with the field.
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": [1], "added_later": b"\x00\x01"},
                        use_bin_type=True)
    assert codec.decode([raw]) == Generate(id="g", prompt_ids=[1])
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": [1], "session_id": b"s"},
                        use_bin_type=True)
    assert _code(raw) == ("bad_field", "g")


def _code(raw):
    with pytest.raises(codec.DecodeError) as info:
        codec.decode([raw])
    return info.value.code, info.value.msg_id


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"", "bad_frame"),
        (b"\xc1", "bad_frame"),
        (msgpack.packb([1, 2]), "bad_message"),
        (msgpack.packb({1: 2}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate"}), "bad_field"),
        (msgpack.packb({"v": 99, "type": "generate", "id": "x"}), "version_mismatch"),
        (msgpack.packb({"v": True, "type": "stats", "id": "x"}), "version_mismatch"),
        (msgpack.packb({"v": 1.0, "type": "stats", "id": "x"}), "version_mismatch"),
        (msgpack.packb({"v": 1, "type": "launch_missiles", "id": "x"}), "unknown_type"),
        (msgpack.packb({"v": 1, "type": 5, "id": "x"}), "unknown_type"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x"}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": "abc"}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1, "2"]}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [True]}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1], "sampling": [1]}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"max_tokens": "9"}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"top_p": 0}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "abort", "id": "x", "request_id": None}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "control", "id": "x", "op": "sleep", "args": {1: 2}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"temperature": float("nan")}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"temperature": float("inf")}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"max_tokens": 2**64 - 1}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"top_k": 2**63}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"seed": 2**63}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"stop_token_ids": [2, 2**64 - 1]}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"temperature": 2**64 - 1}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "x", "prompt_ids": [1],
                        "sampling": {"temperature": 2**63}}), "bad_field"),
        (msgpack.packb({"v": 1, "type": "abort_all", "id": "x", "session_id": 7}), "bad_field"),
    ],
)
def test_malformed_input_is_rejected_with_a_code(raw, code):
    assert _code(raw)[0] == code


def test_a_key_that_is_not_a_str_is_answered_with_the_messages_id():
    # anywhere in the message: the id is read back without building the maps
    for header in ({"v": 1, "type": "generate", "id": "r1", "prompt_ids": [1], "sampling": {7: 1}},
                   {"v": 1, "type": "control", "id": "r1", "op": "sleep", "args": {None: 1}},
                   {3: "x", "v": 1, "type": "stats", "id": "r1"},
                   # bin keys: at the top level and in a known field's map
                   {"v": 1, "type": "stats", "id": "r1", b"x": 1},
                   {"v": 1, "type": "generate", "id": "r1", "prompt_ids": [1], b"stream": 5},
                   {"v": 1, "type": "generate", "id": "r1", "prompt_ids": [1], "sampling": {b"max_tokens": 2}}):
        assert _code(msgpack.packb(header)) == ("bad_field", "r1")
    # the value of a field the receiver does not know is not looked into
    assert type(codec.decode([msgpack.packb({"v": 1, "type": "stats", "id": "r1", "zz": {b"k": 1}})])).__name__ == "Stats"
    # an id that cannot be read (itself a map with such keys) leaves it empty
    assert _code(msgpack.packb({"v": 1, "type": "stats", "id": {1: 2}})) == ("bad_field", None)


def test_accept_refuses_known_types_before_their_fields():
    accept = frozenset({"generate", "stats"})
    # a register with no fields at all: the type is refused first, not its missing fields
    with pytest.raises(codec.DecodeError) as info:
        codec.decode([msgpack.packb({"v": 1, "type": "register", "id": "g1"})], accept=accept)
    assert (info.value.code, info.value.msg_id) == ("unknown_type", "g1")
    assert codec.decode([msgpack.packb({"v": 1, "type": "stats", "id": "s"})], accept=accept) == Stats(id="s")
    batch = codec.decode([codec.batch_frame([codec.encode(Stats(id="a")), codec.encode(Abort(id="b", request_id="r"))])])
    first, second = codec.unbatch(batch, accept=accept)
    assert first == Stats(id="a")
    assert isinstance(second, codec.DecodeError) and (second.code, second.msg_id) == ("unknown_type", "b")


def test_error_reply_carries_the_correlation_id_when_readable():
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "req-7", "prompt_ids": "x"})
    code, msg_id = _code(raw)
    reply = codec.error_for(codec.DecodeError(code, "bad", msg_id))
    assert reply.id == "req-7" and reply.code == "bad_field"


def test_oversized_header_is_rejected():
    raw = codec.encode(Generate(id="r", prompt_ids=list(range(1000))))
    with pytest.raises(codec.DecodeError) as info:
        codec.decode([raw], max_bytes=100)
    assert info.value.code == "too_large"


def test_sampling_replace_is_a_deep_copy():
    params = SamplingParams(max_tokens=10, stop_token_ids=[1])
    copy = params.replace(max_tokens=3)
    copy.stop_token_ids.append(9)
    assert params.max_tokens == 10 and params.stop_token_ids == [1]


def test_sampling_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)


# ------------------------------------------------------------------------------ batches
def test_batch_frame_is_the_batch_message_the_codec_encodes():
    msgs = [Result(id=f"w0-0:{i}", token_ids=[i, 300], finish_reason="length", weight_versions=[0],
                   timings={"total": 0.5}) for i in range(40)]
    items = [codec.encode(m) for m in msgs]
    frame = codec.batch_frame(items)
    assert frame == codec.encode(Batch(id="", messages=[msgpack.unpackb(x) for x in items]))
    batch = codec.decode([frame])
    assert isinstance(batch, Batch) and codec.unbatch(batch) == msgs


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_batch_frame_array_header_for_every_size(n):
    item = codec.encode(Stats(id="s"))
    assert len(msgpack.unpackb(codec.batch_frame([item] * n))["messages"]) == n


def test_a_bad_message_in_a_batch_costs_the_others_nothing():
    good = [Chunk(id="w0-0:1", token_ids=[1]), Result(id="w0-0:2", token_ids=[2], finish_reason="stop")]
    items = [
        codec.encode(good[0]),
        msgpack.packb({"v": 1, "type": "result", "id": "w0-0:9", "token_ids": "nope", "finish_reason": "stop"}),
        msgpack.packb({"v": 2, "type": "stats", "id": "old"}),
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 1, "type": "no_such_type", "id": "u"}),
        codec.batch_frame([codec.encode(Stats(id="inner"))]),  # no batch inside a batch
        codec.encode(good[1]),
    ]
    out = codec.unbatch(codec.decode([codec.batch_frame(items)]))
    assert out[0] == good[0] and out[-1] == good[1]
    errors = out[1:-1]
    assert all(isinstance(e, codec.DecodeError) for e in errors)
    assert [e.code for e in errors] == ["bad_field", "version_mismatch", "bad_message", "unknown_type", "bad_message"]
    assert [e.msg_id for e in errors] == ["w0-0:9", "old", None, "u", ""]


def _batch(*members: bytes, batch_id: str = "B") -> bytes:
    """A batch frame around messages given as bytes, any bytes (a msgpack library cannot write
    every bad message)."""
    n = len(members)
    head = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return b"".join((b"\x84", *map(msgpack.packb, ("v", 1, "type", "batch", "id", batch_id, "messages")), head,
                     *members))


def _nested(depth: int) -> bytes:
    """A stats message whose field ``x`` holds arrays nested ``depth`` deep: the message nests
    ``depth + 1`` deep, its own map included."""
    return b"\x84" + b"".join(map(msgpack.packb, ("v", 1, "type", "stats", "id", "deep", "x"))) + b"\x91" * depth + b"\x01"


NOT_UTF8 = b"\x83\xa1v\x01\xa4type\xa5stats\xa2id\xa2\xff\xfe"  # {"v": 1, "type": "stats", "id": <not UTF-8>}


def test_a_message_of_a_batch_that_cannot_be_unpacked_is_answered_alone_and_the_others_decode():
    # PROTOCOL.md 4.3: each message as if it had come in a frame of its own, whatever is wrong with it
    good = [Abort(id="m2", request_id="zz"), Generate(id="g", prompt_ids=[1], sampling=SamplingParams(max_tokens=2)),
            Stats(id="deep")]
    members = [
        msgpack.packb({"v": 1, "type": "stats", "id": "m1", 7: 1}),
        codec.encode(good[0]),
        msgpack.packb({"v": 1, "type": "generate", "id": "g1", "prompt_ids": [1], "sampling": {7: 1}}),
        msgpack.packb({"v": 1, "type": "stats", "id": "s1", "added_later": {None: 1}}),  # in an unknown field too
        codec.encode(good[1]),
        NOT_UTF8,
        _nested(1023),  # 1,024 deep: within the limit alone, beyond it inside the batch's map and array
    ]
    raw = _batch(*members)
    with pytest.raises(ValueError):
        msgpack.unpackb(raw, raw=False, strict_map_key=True)  # no library reads this frame whole
    out = codec.unbatch(codec.decode([raw]))
    assert len(out) == len(members)
    assert [out[1], out[4]] == good[:2] and type(out[6]) is Stats and out[6].id == "deep"
    errors = [out[i] for i in (0, 2, 3, 5)]
    assert all(isinstance(e, codec.DecodeError) for e in errors)
    assert [(e.code, e.msg_id) for e in errors] == [("bad_field", "m1"), ("bad_field", "g1"), ("bad_field", "s1"),
                                                     ("bad_frame", None)]
    # the same bytes in a frame of their own get the same answers
    for member, error in zip((members[i] for i in (0, 2, 3, 5)), errors):
        assert _code(member) == (error.code, error.msg_id)


def test_errors_about_a_batch_itself_carry_the_empty_id_whatever_its_own():
    frames = [
        msgpack.packb({"v": 1, "type": "batch", "id": "B", b"k": 1, "messages": []}),  # a bin key
        msgpack.packb({"v": 1, "type": "batch", "id": "B", 7: 1, "messages": []}),  # an int key
        msgpack.packb({"v": 1, "type": "batch", "id": "B", "x": {7: 1}, "messages": []}),  # in an unknown field
        msgpack.packb({"v": 1, "type": "batch", "id": "B", 7: 1, "messages": [{"v": 1, "type": "stats", "id": "s",
                                                                              3: 3}]}),
    ]
    for raw in frames:
        assert _code(raw) == ("bad_field", "")
    assert _code(msgpack.packb({"v": 2, "type": "batch", "id": "b12", "messages": []})) == ("version_mismatch", "")
    assert _code(msgpack.packb({"v": 1, "type": "batch", "id": 5, "messages": []})) == ("bad_field", "")
    with pytest.raises(codec.DecodeError) as info:
        codec.decode([msgpack.packb({"v": 1, "type": "batch", "id": "B", "messages": []})], accept=frozenset({"stats"}))
    assert (info.value.code, info.value.msg_id) == ("unknown_type", "")


def test_a_batch_whose_messages_cannot_be_told_apart_is_refused_whole():
    good = codec.encode(Stats(id="ok"))
    assert _code(_batch(good, _nested(1024), good)) == ("bad_frame", None)  # too deep even alone: its end is unknown
    assert _code(_batch(good, good)[:-3]) == ("bad_frame", None)  # cut short
    assert _code(_batch(good, NOT_UTF8) + b"\x01") == ("bad_frame", None)  # bytes after the batch's map
    # ... whatever fault came before in the frame: a message with a key that is not a str (answered on
    # its own in a batch that can be taken apart) does not make a batch that cannot be bad_field
    int_key = msgpack.packb({"v": 1, "type": "stats", "id": "k", 7: 1})
    assert _code(_batch(good, int_key, good)[:-3]) == ("bad_frame", None)  # cut short after it
    assert _code(_batch(good, int_key) + b"\xa5ab") == ("bad_frame", None)  # bytes after the map, cut short
    assert _code(_batch(int_key, _nested(1024))) == ("bad_frame", None)
    three = _batch(good, int_key, good)
    assert _code(three[:three.rindex(good)]) == ("bad_frame", None)  # an array of 3 holding 2
    # more messages than are taken apart: answered whole, under the empty id
    many = [good] * codec.MAX_BATCH_APART
    assert _code(_batch(*many, msgpack.packb({"v": 1, "type": "stats", "id": "m", 7: 1}))) == ("bad_field", "")
    assert _code(_batch(*many, NOT_UTF8)) == ("bad_frame", None)
    assert len(codec.unbatch(codec.decode([_batch(*many[1:], NOT_UTF8)]))) == len(many)


@pytest.mark.parametrize("messages", [{"a": 1}, "x", None])
def test_a_batch_whose_messages_field_is_bad_is_rejected_whole_under_the_empty_id(messages):
    # a batch's own id is ignored (PROTOCOL.md 3, 4.3), even in an error about the batch itself
    fields = {"v": 1, "type": "batch", "id": "B1"}
    if messages is not None:
        fields["messages"] = messages
    with pytest.raises(codec.DecodeError) as err:
        codec.decode([msgpack.packb(fields)])
    assert (err.value.code, err.value.msg_id) == ("bad_field", "")


# ------------------------------------------------------------------------------ fast paths
@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE.value)
def test_build_and_encode_values_match_the_constructor_and_encode(msg):
    values = (msg.id, *(getattr(msg, f) for f in codec._spec(type(msg)).names))
    built = codec.build(type(msg), *values)
    assert built == msg and type(built) is type(msg)
    assert codec.builder(type(msg))(*values) == msg  # the same, looked up once
    assert codec.encode_values(type(msg), *values) == codec.encode(msg)
    with pytest.raises(TypeError):
        codec.encode_values(type(msg), *values, "one too many")


def test_a_list_with_an_element_of_the_wrong_type_is_named_as_such():
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": ["a", "b"]})
    with pytest.raises(codec.DecodeError, match="field 'prompt_ids' holds an element of the wrong type"):
        codec.decode([raw])
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": "ab"})
    with pytest.raises(codec.DecodeError, match="field 'prompt_ids' has wrong type str"):
        codec.decode([raw])
    # the same words for a list inside the sampling map
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": [1],
                         "sampling": {"stop_token_ids": [1, "x"]}})
    with pytest.raises(codec.DecodeError, match="sampling.stop_token_ids: holds an element of the wrong type"):
        codec.decode([raw])
    raw = msgpack.packb({"v": 1, "type": "generate", "id": "g", "prompt_ids": [1], "sampling": {"stop_token_ids": 3}})
    with pytest.raises(codec.DecodeError, match="sampling.stop_token_ids: wrong type int"):
        codec.decode([raw])


@pytest.mark.parametrize("bad", [{"max_tokens": 8.0}, {"logprobs": 0}, {"seed": "x"}, {"stop_token_ids": 2},
                                 {"stop_token_ids": [1, "2"]}, {"temperature": True}, {"top_k": None},
                                 {"ignore_eos": 1}])
def test_sampling_params_built_in_python_have_the_wire_types(bad):
    # what a decoded map is checked for holds for one made in Python too, where a wrong type
    # would otherwise get as far as a worker (or past it: logprobs=0 read as False)
    with pytest.raises(TypeError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_sampling_params_take_numpy_numbers_as_the_plain_ones_they_stand_for():
    import fractions

    import numpy as np

    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float64(0.7), top_p=np.float32(0.5),
                            top_k=np.int32(-1), seed=np.uint64(7), stop_token_ids=[np.int64(2), 3])
    assert params == SamplingParams(max_tokens=5, temperature=0.7, top_p=0.5, top_k=-1, seed=7, stop_token_ids=[2, 3])
    plain = [params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, *params.stop_token_ids]
    assert [type(v) for v in plain] == [int, float, float, int, int, int, int]
    # what goes on the wire is plain msgpack, and reads back the same
    assert codec.decode([codec.encode(Generate(id="g", prompt_ids=[1], sampling=params))]).sampling == params
    assert SamplingParams(temperature=np.int64(0), top_p=fractions.Fraction(1, 2)).to_wire()["top_p"] == 0.5
    assert type(params.replace(max_tokens=np.int16(3)).max_tokens) is int
    # no bool where a number is wanted, no float where an int is, and the ranges hold as for plain ones
    for bad in ({"max_tokens": np.bool_(True)}, {"temperature": np.True_}, {"max_tokens": np.float64(2.0)},
                {"stop_token_ids": [np.int64(1), np.True_]}, {"seed": np.float32(1)}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            SamplingParams(**bad)
    for bad in ({"max_tokens": np.int64(-1)}, {"seed": np.uint64(2**64 - 1)}, {"top_p": np.float32(2)},
                {"temperature": np.float64("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_sampling_temperature_is_below_2_63_as_an_int_or_a_float():
    assert SamplingParams(temperature=2**63 - 1).temperature == 2**63 - 1
    for bad in (2**63, 2**64 - 1, float(2**63), 1e300, float("inf"), float("nan"), -1):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_sampling_params_take_a_tuple_of_stop_ids_and_ints_for_floats():
    params = SamplingParams(stop_token_ids=(1, 2), temperature=0, top_p=1)
    assert params.stop_token_ids == [1, 2] and type(params.stop_token_ids) is list
    assert codec.decode([codec.encode(Generate(id="g", prompt_ids=[1], sampling=params))]).sampling == params


@pytest.mark.parametrize("key", [b"\x07", b"\xc0", b"\x91\x01", b"\x81\x01\x01", b"\x81\xa1k\x81\x01\x01"],
                         ids=["int", "nil", "array", "map", "map-in-map"])
@pytest.mark.parametrize("id_first", [True, False])
def test_a_key_that_is_not_a_str_is_answered_with_the_messages_id_whatever_the_key(key, id_first):
    # A map (or an array holding one) as a key lost the id: reading the id built that key,
    # and msgpack refuses to build a map with a key that is not a str.
    head, ident, bad = b"\x84\xa1v\x01\xa4type\xa5stats", b"\xa2id\xa2k8", key + b"\x01"
    raw = head + (ident + bad if id_first else bad + ident)
    assert _code(raw) == ("bad_field", "k8")
    batch = msgpack.packb({"v": 1, "type": "batch", "id": "B", "messages": []})  # a map of 4: one more key
    assert _code(b"\x85" + batch[1:] + bad) == ("bad_field", "")  # a batch's own id is never answered


def test_a_type_that_is_not_a_str_or_a_bad_key_after_it_keeps_the_messages_id():
    # The id is read whatever stands between it and the type, and after it: only a frame that
    # is (or might be) a batch goes without its id.
    bad_type = b"\xa4type\x81\x01\x02"  # type: {1: 2}
    for raw in (b"\x83\xa1v\x01" + bad_type + b"\xa2id\xa2t1", b"\x83\xa1v\x01\xa2id\xa2t1" + bad_type):
        assert _code(raw) == ("bad_field", "t1")
    # a type read, then a key that is not UTF-8 (or an int key before it)
    head = b"\x86\xa1v\x01\xa4type\xa5abort\xa2id\xa2t5\xaarequest_id\xa1x\x01\x02"
    assert _code(head + b"\xa1\xff\x03") == ("bad_field", "t5")
    element = b"\x83\xa1v\x01" + bad_type + b"\xa2id\xa2t7"
    batch = codec.decode([msgpack.packb({"v": 1, "type": "batch", "id": "", "messages": [0]})[:-1] + element])
    ((error,),) = [list(codec.unbatch(batch))]
    assert isinstance(error, codec.DecodeError) and (error.code, error.msg_id) == ("bad_field", "t7")


def test_an_ext_in_an_unknown_field_is_skipped_unless_it_is_a_malformed_timestamp():
    # PROTOCOL.md 3: well-formed ext and timestamps are skipped with their field; a timestamp of a
    # wrong length, or with nanoseconds over 999,999,999, is not msgpack.
    head = b"\x84\xa1v\x01\xa4type\xa5stats\xa2id\xa1s\xa1x"
    # ... an ext of a type code msgpack reserves (-128..-2) as well as an application's (0..127)
    for ext in (b"\xd6\xff" + bytes(4), b"\xd7\xff" + bytes(8), b"\xc7\x0c\xff" + bytes(12), b"\xd5\x07ab",
                b"\xd4\xfe\x00", b"\xc7\x02\x80ab"):
        assert type(codec.decode([head + ext])) is Stats
    for ext in (b"\xc7\x03\xffabc", b"\xd7\xff" + b"\xff" * 8):
        assert _code(head + ext) == ("bad_frame", None)


def test_of_several_faults_in_a_frame_the_first_met_is_answered_a_key_once_its_value_is_read():
    # PROTOCOL.md 6.6: a frame of its own is read from its start; a map key is checked after its value.
    head = b"\x85" + b"".join(map(msgpack.packb, ("v", 1, "type", "stats", "id", "o3")))  # a map of 5, 3 given
    int_key = b"\x05\x01"  # 5: 1
    assert _code(head + int_key + b"\xa1x" + b"\xa5ab") == ("bad_field", "o3")  # then a str cut short
    assert _code(head + int_key + b"\xa1x" + b"\xa2\xff\xfe") == ("bad_field", "o3")  # then a str not UTF-8
    assert _code(head + int_key + b"\xa1x" + b"\x91" * 1100 + b"\x01") == ("bad_field", "o3")  # then too deep
    assert _code(head + b"\x05\xa2\xff\xfe" + b"\xa1x\x01") == ("bad_frame", None)  # the key's own value not UTF-8
    assert _code(head + b"\xa1x\xa2\xff\xfe" + int_key) == ("bad_frame", None)  # not UTF-8 before the key
