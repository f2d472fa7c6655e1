import msgpack
import pytest

from rollfleet.transport import codec
from rollfleet.transport.messages import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Abort,
    Chunk,
    Control,
    Error,
    Generate,
    Heartbeat,
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
        (msgpack.packb({1: 2}), "bad_frame"),
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
        (msgpack.packb({"v": 1, "type": "control", "id": "x", "op": "sleep", "args": {1: 2}}), "bad_frame"),
    ],
)
def test_malformed_input_is_rejected_with_a_code(raw, code):
    assert _code(raw)[0] == code


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
