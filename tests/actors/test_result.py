"""GenerationResult: the per-token weight versions a result's segments give."""

from __future__ import annotations

import msgpack
import pytest

from rollfleet.actors import GenerationResult
from rollfleet.transport import codec
from rollfleet.transport.messages import Result


def result(tokens: int, versions: list[int], starts: list[int]) -> GenerationResult:
    return GenerationResult(request_id="r", token_ids=list(range(tokens)), finish_reason="length",
                            weight_versions=versions, weight_version_starts=starts)


def test_segments_give_each_token_its_version():
    assert result(5, [3, 4, 4], [0, 2, 4]).token_weight_versions() == [3, 3, 4, 4, 4]
    assert result(3, [7], [0]).token_weight_versions() == [7, 7, 7]
    assert result(0, [], []).token_weight_versions() == []


def test_a_peer_that_does_not_say_where_segments_begin():
    # One segment needs no starts; two cannot be split without them.
    assert result(4, [2], []).token_weight_versions() == [2] * 4
    with pytest.raises(ValueError, match="2 segments and 0 segment starts"):
        result(4, [2, 3], []).token_weight_versions()


def test_the_starts_cross_the_wire_and_default_to_none():
    msg = Result(id="r", token_ids=[1, 2, 3], finish_reason="stop", weight_versions=[1, 2],
                 weight_version_starts=[0, 1])
    back = codec.decode([codec.encode(msg)])
    got = GenerationResult.from_message(back)
    assert got.weight_version_starts == [0, 1] and got.token_weight_versions() == [1, 2, 2]
    assert got.to_dict()["weight_version_starts"] == [0, 1]
    # A peer that leaves the key out (it is optional): the default, an empty list.
    older = codec.decode([msgpack.packb({"v": 1, "type": "result", "id": "r", "token_ids": [1],
                                         "finish_reason": "stop", "weight_versions": [1]})])
    assert older.weight_version_starts == [] and GenerationResult.from_message(older).token_weight_versions() == [1]
    with pytest.raises(codec.DecodeError, match="weight_version_starts"):
        codec.decode([msgpack.packb({"v": 1, "type": "result", "id": "r", "token_ids": [1],
                                     "finish_reason": "stop", "weight_version_starts": ["0"]})])
