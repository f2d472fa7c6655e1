"""A seeded, sampled request resumed after a weight update draws afresh, not its first draws again.

With its own seed at the resume point, the engine would start its uniforms over: the token after
the resume would be chosen by the uniform that chose the first token, and so on, which correlates
the continuation with the start instead of sampling the policy (with the tiny model, token ids
right after a resume then track the first ones almost exactly).
"""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.actors import FleetConfig, StreamChunk, Supervisor
from rollfleet.actors.supervisor import resume_seed
from rollfleet.engines.tiny import tiny_llama_model
from rollfleet.transport.messages import SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPT = [1, 17, 42, 99]


def test_resume_seed_is_a_reproducible_64_bit_seed_of_its_own():
    assert resume_seed(7, 12) == resume_seed(7, 12)
    assert len({resume_seed(7, 12), resume_seed(7, 13), resume_seed(8, 12), 7}) == 4
    assert all(0 <= resume_seed(s, n) < 1 << 63 for s in (-(1 << 63), -1, 0, (1 << 63) - 1) for n in (1, 10**6))


async def test_a_seeded_request_resumed_after_an_update_does_not_replay_its_first_draws():
    model = tiny_llama_model(0)  # the engine's own weights: the update changes the version, not the policy
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=1234, ignore_eos=True)
    async with Supervisor(FleetConfig(engine="torch", num_workers=1, engine_options={"seed": 0},
                                      frontend_addr=None)) as fleet:
        client = fleet.client()
        versions: list[int] = []
        result = None

        async def run() -> None:
            nonlocal result
            async for item in client.stream("seeded", PROMPT, params):
                if isinstance(item, StreamChunk):
                    versions.extend([item.weight_version] * len(item.token_ids))
                else:
                    result = item

        task = asyncio.ensure_future(run())
        while len(versions) < 5:
            await asyncio.sleep(0.005)
        await fleet.update_weights(model.named_parameters(), version=1)
        await task
        assert result is not None and result.weight_versions == [0, 1] and len(result.token_ids) == 400
        split = versions.index(1)
        assert 5 <= split < 400
        tokens = result.token_ids
        # What the continuation would be with the request's own seed: the first draws again.
        replay = await client.generate("replay", PROMPT + tokens[:split], params.replace(max_tokens=400 - split))
        assert tokens[split:] != replay.token_ids
        # It is the continuation of the derived seed: reproducible from the interruption point.
        derived = await client.generate("derived", PROMPT + tokens[:split],
                                        params.replace(max_tokens=400 - split, seed=resume_seed(1234, split)))
        assert tokens[split:] == derived.token_ids
