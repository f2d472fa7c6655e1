import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from rollfleet.actors import FleetConfig, SyncClient
from rollfleet.errors import FleetClosed, InvalidRequest
from rollfleet.transport.messages import SamplingParams

from .test_fleet_echo import expected_tokens

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_generate_batch_update_and_controls_from_plain_code():
    with SyncClient(FleetConfig(engine="echo", num_workers=2)) as fleet:
        prompts = [[i + 1, i + 2] for i in range(10)]
        results = fleet.generate_batch(prompts, SamplingParams(max_tokens=8))
        assert [r.token_ids for r in results] == [expected_tokens(p, 8) for p in prompts]
        fleet.update_weights([("offset", torch.tensor([3]))], version=4)
        r = fleet.generate("x", [5], SamplingParams(max_tokens=3))
        assert r.token_ids == expected_tokens([5], 3, offset=3) and r.weight_versions == [4]
        fleet.sleep()
        fleet.wake_up()
        workers = fleet.control("clear_kv_cache")
        assert sorted(workers) == sorted(w["worker_id"] for w in fleet.stats()["workers"])
        assert all(data == {"op": "clear_kv_cache"} for data in workers.values())
        # bad sampling given as a map fails each slot with the library's error, not a ValueError
        bad = fleet.generate_batch([[1], [2]], {"max_tokens": -1}, return_exceptions=True)
        assert all(isinstance(e, InvalidRequest) and e.code == "bad_field" for e in bad)
        stats = fleet.stats()
        assert stats["weight_version"] == 4 and stats["num_workers"] == 2
        pids = [w["pid"] for w in stats["workers"]]
    assert not any(psutil.pid_exists(p) for p in pids)
    with pytest.raises(FleetClosed):
        fleet.generate("y", [1])


def test_fleet_is_shut_down_at_interpreter_exit():
    script = textwrap.dedent("""
        from rollfleet.actors import SyncClient, FleetConfig
        fleet = SyncClient(FleetConfig(engine="echo", num_workers=2))
        print(fleet.supervisor.private_dir, *[w["pid"] for w in fleet.stats()["workers"]], flush=True)
        # no shutdown: atexit must do it
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    fields = out.stdout.split()
    pids = [int(p) for p in fields[1:]]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) for p in pids)
    import os

    assert not os.path.exists(fields[0])
