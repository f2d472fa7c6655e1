"""A torch engine whose thread dies, in a real fleet: its worker exits and is restarted, and
its requests resume on the other worker; none fails, none is left waiting. One that dies in a
weight update fails that update, and the next one goes to the restarted worker.

Nothing a request or an update can carry makes the engine thread raise, so the workers of
these tests load a ``sitecustomize`` (on their PYTHONPATH only) that makes it raise: once,
while it samples a request with a given seed (the marker file makes it fire in one worker
only, so the request that set it off completes where it resumes), or when it is given a
tensor named ``kill.engine``.
"""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollfleet.actors import FleetConfig, Supervisor  # noqa: E402
from rollfleet.engines.tiny import tiny_llama_model  # noqa: E402
from rollfleet.errors import WeightUpdateError  # noqa: E402
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

        class InjectedFault(BaseException):  # not an Exception: the thread does not catch it
            pass

        _load_weights = torch_runner.Runner.load_weights

        def _failing_load_weights(self, weights):
            weights = list(weights)
            if any(name == "kill.engine" for name, _ in weights):
                raise InjectedFault("injected fault in the engine thread")
            return _load_weights(self, weights)

        torch_runner.Runner.load_weights = _failing_load_weights
""")


def hooked_workers(tmp_path) -> dict[str, str]:
    """The environment of workers that load HOOK."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
            "ENGINE_FAULT_MARKER": str(tmp_path / "fired")}


async def test_a_dead_torch_engine_thread_restarts_its_worker_and_its_requests_resume(tmp_path):
    env = hooked_workers(tmp_path)
    marker = tmp_path / "fired"
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
        # It resumed on the other worker; so did the requests running beside it. (Its first
        # segment may hold no token: one made just before the death may not have been reported.)
        assert killer.num_preemptions == 1 and killer.weight_versions in ([0], [0, 0])
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


async def test_an_engine_that_dies_in_a_weight_update_is_restarted_and_the_next_update_reaches_it(tmp_path):
    sup = Supervisor(FleetConfig(engine="torch", num_workers=1, worker_env=hooked_workers(tmp_path)))
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        with pytest.raises(WeightUpdateError, match="EngineDead: torch engine thread died") as info:
            await client.update_weights([("kill.engine", torch.zeros(2))], version=1)
        assert "injected fault in the engine thread" in str(info.value)
        # The worker said why and exited, and the failed update did not end before it was gone:
        # the next one waits for the restarted worker instead of reaching the dead one.
        await client.update_weights(tiny_llama_model(seed=1).named_parameters(), version=2)
        stats = await client.stats()
        (worker,) = stats["workers"]
        assert worker["state"] == "ready" and worker["restarts"] == 1 and worker["weight_version"] == 2
        assert "engine died loading weights" in worker["last_error"] or "engine is dead" in worker["last_error"]
        result = await client.generate("after", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
        assert len(result.token_ids) == 8 and result.weight_versions == [2]
        pids |= worker_pids(sup)
    assert_clean(sup.private_dir, pids)
