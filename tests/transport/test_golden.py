"""The golden vectors in tests/golden pin the wire format: any change to it fails here.

Each ``<type>.msgpack`` must decode to exactly the map in ``<type>.json`` (same keys in the
same order, same value kinds: int is not float is not bool), and the message that map
describes must encode back to exactly the same bytes.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Any

import msgpack
import pytest

from rollfleet.transport import codec
from rollfleet.transport.messages import MESSAGE_CLASSES, PROTOCOL_VERSION, MsgType, SamplingParams

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"


def _load_make_vectors() -> Any:
    spec = importlib.util.spec_from_file_location("make_vectors", GOLDEN / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_vectors = _load_make_vectors()
FILES = make_vectors.vector_files(GOLDEN)
TYPES = [t.value for t in MsgType]


def assert_same(got: Any, want: Any) -> None:
    """Equality that also compares value kinds and map key order."""
    diff = make_vectors.difference(got, want)
    assert diff is None, diff


def _read(name: str) -> tuple[bytes, Any]:
    raw_path, json_path = FILES[name]
    return raw_path.read_bytes(), make_vectors.from_json(json.loads(json_path.read_text()))


def _message_from_map(data: dict[str, Any]) -> Any:
    cls = MESSAGE_CLASSES[data["type"]]
    fields = {k: v for k, v in data.items() if k not in ("v", "type")}
    if "sampling" in fields:
        fields["sampling"] = SamplingParams(**fields["sampling"])
    return cls(**fields)


def test_every_message_type_has_a_vector_and_nothing_else():
    assert sorted(FILES) == sorted(TYPES)
    for raw_path, json_path in FILES.values():
        assert json_path.exists(), f"{json_path.name} is missing"


@pytest.mark.parametrize("name", TYPES)
def test_vector_decodes_to_exactly_its_json_map(name):
    raw, want = _read(name)
    got = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    assert_same(got, want)
    assert got["v"] == PROTOCOL_VERSION and got["type"] == name


@pytest.mark.parametrize("name", TYPES)
def test_codec_decodes_vector_and_encodes_the_same_bytes(name):
    raw, _ = _read(name)
    msg = codec.decode([raw])
    assert msg.TYPE.value == name
    assert codec.encode(msg) == raw


@pytest.mark.parametrize("name", TYPES)
def test_message_described_by_json_encodes_to_the_vector_bytes(name):
    raw, want = _read(name)
    assert codec.encode(_message_from_map(want)) == raw


def test_vector_files_are_up_to_date_with_make_vectors():
    for msg in make_vectors.VECTORS:
        raw, _ = _read(msg.TYPE.value)
        assert codec.encode(msg) == raw, f"{msg.TYPE.value}: run tests/golden/make_vectors.py and review the diff"


def test_json_convention_marks_binary_values_and_float_kinds():
    # weights_begin carries a bin (a CUDA IPC handle); result carries whole-valued floats.
    text = FILES["weights_begin"][1].read_text()
    assert '"$bin": "0004080c' in text
    result = json.loads(FILES["result"][1].read_text())
    assert isinstance(result["logprobs"][3], float) and result["logprobs"][3] == -2.0
