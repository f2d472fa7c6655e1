"""Writes the golden vectors: one ``<type>.msgpack`` and one ``<type>.json`` per message type.

``<type>.msgpack`` is the header frame exactly as rollfleet's codec encodes the message below;
``<type>.json`` is the map that frame decodes to, keys in wire order. JSON cannot say
everything msgpack can, so two conventions apply (PROTOCOL.md, "Golden vectors"):

- a msgpack ``bin`` value is written ``{"$bin": "<lowercase hex>"}``;
- a msgpack float is written with a fraction or exponent (``1.0``, ``-0.25``), an integer
  without one, so a reader that keeps JSON number kinds can tell them apart.

Regenerate after a deliberate wire change, and review the diff:
``.venv/bin/python tests/golden/make_vectors.py``. Every field holds a value, most of
them not the default, so a renamed, retyped or reordered field changes some file.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import msgpack

from rollfleet.transport import codec
from rollfleet.transport.messages import (
    Abort,
    AbortAll,
    Batch,
    Chunk,
    Control,
    Error,
    Generate,
    Heartbeat,
    Hello,
    Message,
    Register,
    Reply,
    Result,
    SamplingParams,
    Shutdown,
    Stats,
    WeightsBegin,
    WeightsBucket,
    WeightsEnd,
    WorkerExit,
)

HERE = pathlib.Path(__file__).resolve().parent

# Values are chosen to cover msgpack's encodings: positive fixint (3), uint8 (200), uint16
# (300), uint32 (70000, 1048576), negative fixint (-1), float64, nil, true/false, str, bin,
# nested maps and arrays, empty map and empty array.
VECTORS: list[Message] = [
    Generate(
        id="req-1",
        prompt_ids=[1, 3, 200, 300, 70000],
        sampling=SamplingParams(max_tokens=8, temperature=0.75, top_p=0.5, top_k=-1, seed=1234,
                                stop_token_ids=[2], ignore_eos=True, logprobs=True),
        stream=True,
        session_id="session-7",
        resume=False,
    ),
    Abort(id="abort-1", request_id="req-1"),
    AbortAll(id="abort-all-1", session_id="session-7"),
    Stats(id="stats-1"),
    Control(id="control-1", op="start_profile", args={"trace_dir": "/tmp/rollfleet-trace"}),
    Chunk(id="req-1", token_ids=[17, 20308], logprobs=[-0.25, -1.5], weight_version=3),
    Result(
        id="req-1",
        token_ids=[17, 20308, 4, 31999],
        finish_reason="length",
        logprobs=[-0.25, -1.5, -0.125, -2.0],
        weight_versions=[2, 3],
        weight_version_starts=[0, 2],
        num_preemptions=1,
        worker="w1-0",
        timings={"total": 0.5, "queue": 0.125, "first_token": 0.25, "worker": 0.3125},
    ),
    # The answer to stats-1, shaped as PROTOCOL.md 6.5 lists it (one worker, its engine stats cut short).
    Reply(
        id="stats-1",
        ok=True,
        data={
            "workers": [{
                "worker_id": "w0-1", "index": 0, "state": "ready", "pid": 4242, "device": "cuda:0", "host": "node-1",
                "engine": "vllm", "capabilities": ["pause", "sleep", "load_weights"], "num_inflight": 3,
                "num_tokens": 123456, "weight_version": 3, "restarts": 1,
                "last_error": "process exited with code -9", "engine_stats": {"gpu_cache_usage": 0.5},
            }],
            "num_workers": 1,
            "num_inflight": 3,
            "num_pending": 0,
            "weight_version": 3,
            "sleep_level": 0,
            "engines_paused": False,
            "mode": "hybrid",
            "engine": "vllm",
            "host": "node-1",
            "num_completed": 70000,
            "num_aborted": 2,
            "num_failed": 0,
            "num_resumed": 5,
            "num_cancelled": 1,
            "num_leases": 3,
            "num_leases_expired": 1,
            "dropped_frames": {"bad_client_frame": 1},
        },
    ),
    # A refusal of a generate the supervisor read whole: request_id is set (PROTOCOL.md 4.2).
    Error(id="req-1", code="duplicate_request", message="request 'req-1' is already in flight", request_id="req-1"),
    Register(
        id="register",
        worker_id="w0-0",
        pid=4242,
        engine="echo",
        device="cuda:0",
        capabilities=["clear_kv_cache", "load_weights", "pause"],
        weight_version=7,
        host="node-1",
        batch=True,
    ),
    Heartbeat(id="hb", num_inflight=3, num_tokens=123456, weight_version=7),
    WorkerExit(id="fatal", reason="engine died serving a request: RuntimeError('out of memory')", fatal=True),
    Shutdown(id="shutdown"),
    # An shm update's opening (PROTOCOL.md 4.3): two named segments, an in-place offer.
    WeightsBegin(
        id="5f0c2a9e.begin",
        version=8,
        transport="shm",
        bucket_bytes=1048576,
        buffers=[{"size": 1048576, "pool": "9d41c07b", "index": i, "name": f"rf-4242-9d41c07b5a6e13f2-{i}"}
                 for i in range(2)],
        options={"sender_pid": 4242, "sender_start": 1700000000.25,
                 "in_place": {"address": 140000000000, "check": bytes(range(0, 64, 4))}},
    ),
    WeightsBucket(
        id="5f0c2a9e.0",
        index=0,
        buffer=1,
        tensors=[
            {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64], "offset": 0, "nbytes": 128},
            {"name": "lm_head.weight", "dtype": "float32", "shape": [300, 64], "offset": 128, "nbytes": 70000,
             "part_offset": 0, "total_nbytes": 76800},
        ],
    ),
    WeightsEnd(id="5f0c2a9e.end", version=8, commit=True),
    # Two messages for one peer in one frame, as a worker sends them under load.
    Batch(id="", messages=[
        {"v": 1, "type": "chunk", "id": "w0-0:5", "token_ids": [17], "logprobs": None, "weight_version": 3},
        {"v": 1, "type": "result", "id": "w0-0:6", "token_ids": [4, 31999], "finish_reason": "stop",
         "logprobs": None, "weight_versions": [3], "num_preemptions": 0, "worker": "w0-0",
         "timings": {"worker": 0.0625, "first_token": 0.03125}, "weight_version_starts": []},
    ]),
    # A client that reads batches, before its first request.
    Hello(id="hello-1", batch=True, lease_s=30.0),
]


def to_json(value: Any) -> Any:
    """A decoded msgpack value as JSON-able data, bins as {"$bin": hex}."""
    if isinstance(value, bytes):
        return {"$bin": value.hex()}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    """The inverse of ``to_json``."""
    if isinstance(value, dict):
        if set(value) == {"$bin"}:
            return bytes.fromhex(value["$bin"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def difference(got: Any, want: Any, path: str = "$") -> str | None:
    """Where two decoded values differ, comparing value kinds (int, float and bool apart)
    and map key order too; None when they are the same."""
    if type(got) is not type(want):
        return f"{path}: {type(got).__name__} {got!r} != {type(want).__name__} {want!r}"
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{path}: keys {list(got)} != {list(want)}"
        return next((d for k in want if (d := difference(got[k], want[k], f"{path}.{k}"))), None)
    if isinstance(want, list):
        if len(got) != len(want):
            return f"{path}: length {len(got)} != {len(want)}"
        return next((d for i, (g, w) in enumerate(zip(got, want)) if (d := difference(g, w, f"{path}[{i}]"))), None)
    return None if got == want else f"{path}: {got!r} != {want!r}"


def vector_files(directory: pathlib.Path = HERE) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    """Message type -> (msgpack file, json file) for every vector on disk."""
    return {p.stem: (p, p.with_suffix(".json")) for p in sorted(directory.glob("*.msgpack"))}


def write(directory: pathlib.Path = HERE) -> list[str]:
    names = []
    for msg in VECTORS:
        raw = codec.encode(msg)
        decoded = msgpack.unpackb(raw, raw=False)
        name = msg.TYPE.value
        (directory / f"{name}.msgpack").write_bytes(raw)
        (directory / f"{name}.json").write_text(json.dumps(to_json(decoded), indent=2) + "\n")
        names.append(name)
    return names


if __name__ == "__main__":
    written = write(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
    print(f"wrote {len(written)} vectors: {', '.join(written)}")
