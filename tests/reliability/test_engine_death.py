"""A torch engine whose thread dies, in a real fleet: its worker exits and is restarted, and
its requests resume on the other worker; none fails, none is left waiting. One that dies in a
weight update fails that update, and the next one goes to the restarted worker.

Nothing a request or an update can carry makes the engine thread raise, so the workers of
these tests load a ``sitecustomize`` (on their PYTHONPATH only) that makes the layers under
rollfleet fail, with a BaseException (which the thread does not catch, as it would an
Exception): transformers' Llama model, on the prefill of one given prompt, and torch's
``state_dict`` of that model (the first thing a weight load reads), once a marker file says
so. Each fires once only (a marker file), so the request that set one off completes where it
resumes, and the restarted worker loads weights.
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

KILLER_PROMPT = [1, 5]  # the killer's first prefill sets off the fault

HOOK = textwrap.dedent(f"""
    import os

    if "ROLLFLEET_WORKER_CONFIG" in os.environ and "ENGINE_FAULT_MARKER" in os.environ:
        import torch
        from transformers import LlamaForCausalLM

        class InjectedFault(BaseException):
            pass

        def _fire(path):
            # True the first time in any worker: the marker is created, or taken away, once.
            try:
                if path.endswith("fired"):
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL))
                else:
                    os.unlink(path)
            except (FileExistsError, FileNotFoundError):
                return False
            return True

        _forward = LlamaForCausalLM.forward

        def _failing_forward(self, *args, **kwargs):
            ids = kwargs.get("input_ids")
            if ids is not None and ids.tolist() == [{KILLER_PROMPT}] and _fire(os.environ["ENGINE_FAULT_MARKER"]):
                raise InjectedFault("injected fault in the engine thread")
            return _forward(self, *args, **kwargs)

        LlamaForCausalLM.forward = _failing_forward

        _state_dict = torch.nn.Module.state_dict

        def _failing_state_dict(self, *args, **kwargs):
            if isinstance(self, LlamaForCausalLM) and _fire(os.environ["LOAD_FAULT_MARKER"]):
                raise InjectedFault("injected fault in the engine thread")
            return _state_dict(self, *args, **kwargs)

        torch.nn.Module.state_dict = _failing_state_dict
""")


def hooked_workers(tmp_path) -> dict[str, str]:
    """The environment of workers that load HOOK."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
            "ENGINE_FAULT_MARKER": str(tmp_path / "fired"), "LOAD_FAULT_MARKER": str(tmp_path / "kill-on-load")}


LONG = 500  # tokens (of the tiny model's context of 512): the greedy requests still run when the killer comes


async def test_a_dead_torch_engine_thread_restarts_its_worker_and_its_requests_resume(tmp_path):
    env = hooked_workers(tmp_path)
    marker = tmp_path / "fired"
    cfg = FleetConfig(engine="torch", num_workers=2, deterministic_routing=True, worker_env=env)
    sup = Supervisor(cfg)
    async with sup:
        pids = worker_pids(sup)
        client = sup.client()
        greedy = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate(f"r{i}", [1, 10 + i], greedy)) for i in range(6)]
        # They are decoding on both workers when the killer comes (long enough not to be done by
        # the time it is: 300 tokens could all be made before it, on a fast machine).
        assert await wait_for(lambda: len({e.worker_id for e in sup.table if e.worker_id}) == 2
                              and sum(1 for e in sup.table if e.worker_id) == 6, 30)
        sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=424242, ignore_eos=True)
        tasks.append(asyncio.create_task(client.generate("killer", KILLER_PROMPT, sampled)))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert marker.exists()  # the engine thread of one worker did die
        for r in results:
            assert r.finish_reason == "length" and len(r.token_ids) == (40 if r.request_id == "killer" else LONG)
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
        (tmp_path / "kill-on-load").touch()  # the next weight load in a worker dies
        with pytest.raises(WeightUpdateError, match="EngineDead: torch engine thread died") as info:
            await client.update_weights(tiny_llama_model(seed=2).named_parameters(), version=1)
        assert not (tmp_path / "kill-on-load").exists()  # it did fire
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
