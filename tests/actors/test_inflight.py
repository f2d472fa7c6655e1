import pytest

from rollfleet.actors.inflight import Entry, InflightTable, State
from rollfleet.errors import DuplicateRequest
from rollfleet.transport.messages import SamplingParams


def entry(rid, origin="local"):
    return Entry(origin=origin, request_id=rid, prompt_ids=[1], params=SamplingParams(max_tokens=8), sink=lambda m: None)


def test_add_bind_remove():
    t = InflightTable()
    e = entry("r")
    t.add(e)
    inner = t.bind(e, "w0")
    assert t.by_inner(inner) is e and e.state is State.RUNNING and e.num_attempts == 1
    assert t.on_worker("w0") == [e]
    inner2 = t.bind(e, "w1")
    assert inner2 != inner and t.by_inner(inner) is None and t.by_inner(inner2) is e
    t.remove(e)
    assert len(t) == 0 and t.num_inner == 0


def test_duplicate_ids_are_per_origin():
    t = InflightTable()
    t.add(entry("r", "a"))
    t.add(entry("r", "b"))
    with pytest.raises(DuplicateRequest):
        t.add(entry("r", "a"))


def test_segment_bookkeeping():
    t = InflightTable()
    e = entry("r")
    t.add(e)
    t.bind(e, "w0")
    e.token_ids.extend([1, 2, 3])
    t.bind(e, "w1")
    assert e.segment_start == 3 and e.remaining_tokens == 5
