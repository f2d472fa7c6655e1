"""actors.process helpers that need no process: the per-worker sampling seed."""

from __future__ import annotations

from rollfleet.actors.process import sampling_seed


def test_sampling_seed_differs_per_worker_and_restart_and_follows_the_base_seed():
    ids = ["w0-0", "w1-0", "w0-1", "node-a/w0-0", "node-b/w0-0"]
    seeds = [sampling_seed(7, worker_id) for worker_id in ids]
    assert len(set(seeds)) == len(ids)  # every slot and every restart of it draws apart
    assert seeds == [sampling_seed(7, worker_id) for worker_id in ids]  # reproducible from the base
    assert sampling_seed(8, "w0-0") != seeds[0]
    assert all(0 <= s < 2**31 for s in seeds)  # fits numpy's and the engines' seeds
    unseeded = {sampling_seed(None, "w0-0") for _ in range(8)}
    assert len(unseeded) > 1 and all(0 <= s < 2**31 for s in unseeded)
