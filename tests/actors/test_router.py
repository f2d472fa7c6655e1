import pytest

from rollfleet.actors.router import Router


def make(n=3, **kw):
    r = Router(deterministic=True, **kw)
    for i in range(n):
        r.add_worker(f"w{i}")
    return r


def test_least_inflight():
    r = make()
    r.on_dispatch("w0")
    r.on_dispatch("w0")
    r.on_dispatch("w1")
    assert r.choose() == "w2"
    r.on_dispatch("w2")
    r.on_dispatch("w2")
    assert r.choose() == "w1"
    r.on_finish("w0")
    r.on_finish("w0")
    assert r.choose() == "w0"


def test_deterministic_ties_go_to_registration_order():
    r = make()
    assert [r.choose() for _ in range(3)] == ["w0", "w0", "w0"]


def test_random_ties_spread():
    r = Router(seed=1)
    for i in range(4):
        r.add_worker(f"w{i}")
    assert len({r.choose() for _ in range(50)}) > 1


def test_sticky_key_returns_to_same_worker_even_when_busier():
    r = make()
    first = r.choose("session-a")
    for _ in range(5):
        r.on_dispatch(first)
    assert r.choose("session-a") == first
    assert r.choose("session-b") != first


def test_sticky_falls_back_when_worker_unavailable_or_removed():
    r = make()
    w = r.choose("s")
    r.set_available(w, False)
    other = r.choose("s")
    assert other != w
    r.remove_worker(other)
    assert r.choose("s") not in (other,)


def test_sticky_cache_is_bounded_lru():
    r = make(max_sticky=2)
    r.choose("a")
    r.choose("b")
    r.choose("a")  # refresh a
    r.choose("c")  # evicts b
    assert r.num_sticky == 2
    assert r._sticky.keys() == {"a", "c"}


def test_no_available_worker():
    r = Router()
    assert r.choose("x") is None
    r.add_worker("w0")
    r.set_available("w0", False)
    assert r.choose() is None
    assert r.choose(exclude={"w0"}) is None


def test_finish_never_goes_negative():
    r = make(1)
    r.on_finish("w0")
    assert r.load("w0") == 0


def test_bad_config():
    with pytest.raises(ValueError):
        Router(max_sticky=-1)


def test_a_preferred_worker_is_taken_while_available_and_remembers_nothing():
    r = make()
    r.on_dispatch("w1")
    assert r.choose(prefer="w1") == "w1"  # though busier
    r.set_available("w1", False)
    assert r.choose(prefer="w1") == "w0"
    assert r.choose(prefer="gone") == "w0"
    assert r.num_sticky == 0
