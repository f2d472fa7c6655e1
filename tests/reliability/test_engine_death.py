"""A torch engine whose thread dies, in a real fleet: its worker exits and is restarted, and
its requests resume on the other worker; none fails, none is left waiting.

Nothing a request can ask makes the engine thread raise, so the workers of this test load a
``sitecustomize`` (on their PYTHONPATH only) that makes it raise once, while it samples a
request with a given seed; the marker file makes it fire in one worker only, so the request
that set it off completes where it resumes.
"""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollfleet.actors import FleetConfig, Supervisor  # noqa: E402
from rollfleet.transport.messages import SamplingParams  # noqa: E402

from .helpers import assert_clean, wait_for, worker_pids  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")

KILLER_SEED = 424242

HOOK = textwrap.dedent(f"""
    import os

    if "ROLLFLEET_WORKER_CONFIG" in os.environ and "ENGINE_FAULT_MARKER" in os.environ:
        from rollfleet.engines import torch_runner

        _emit = torch_runner.Runner._emit

        def _failing_emit(self, seqs, logits, out):
            if any(s.params.seed == {KILLER_SEED} and len(s.tokens) >= 3 for s in seqs):
                try:
                    os.close(os.open(os.environ["ENGINE_FAULT_MARKER"], os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    raise RuntimeError("injected fault in the engine thread")
            return _emit(self, seqs, logits, out)

        torch_runner.Runner._emit = _failing_emit
""")


async def test_a_dead_torch_engine_thread_restarts_its_worker_and_its_requests_resume(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    marker = tmp_path / "fired"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
           "ENGINE_FAULT_MARKER": str(marker)}
    cfg = FleetConfig(engine="torch", num_workers=2, deterministic_routing=True, worker_env=env)
    sup = Supervisor(cfg)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        greedy = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [1, 10 + i], greedy)) for i in range(6)]
        sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=KILLER_SEED, ignore_eos=True)
        tasks.append(asyncio.create_task(client.generate("killer", [1, 5], sampled)))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert marker.exists()  # the engine thread of one worker did die
        for r in results:
            assert r.finish_reason == "length" and len(r.token_ids) == (40 if r.request_id == "killer" else 300)
        killer = results[-1]
        # It resumed on the other worker; so did the requests running beside it.
        assert killer.num_preemptions == 1 and len(killer.weight_versions) == 2
        assert sum(r.num_preemptions for r in results) >= 2
        assert sup.counters["failed"] == 0 and len(sup.table) == 0
        assert await wait_for(lambda: len(sup.ready_workers()) == 2 and worker_pids(sup) != pids, 60)
        stats = await client.stats()
        assert sum(w["restarts"] for w in stats["workers"]) == 1
        (restarted,) = [w for w in stats["workers"] if w["restarts"]]
        assert "torch engine thread died" in restarted["last_error"]
        assert "injected fault in the engine thread" in restarted["last_error"]
        assert all(w["state"] == "ready" for w in stats["workers"])
        # Both workers serve again, the restarted one included.
        again = await asyncio.gather(*(client.generate(f"after{i}", [1, 20 + i], greedy.replace(max_tokens=8))
                                       for i in range(4)))
        assert {r.worker for r in again} == {h.worker_id for h in sup.ready_workers()}
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)
