"""The fleet on a CUDA GPU: torch engine on the device, weights over cuda_ipc (GPU only)."""

import pytest
import torch

from rollfleet.actors import FleetConfig, Supervisor
from rollfleet.transport.messages import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leaks")]

PROMPTS = [[1, 5, 9, 200], [1, 300, 2, 44, 17]]


def transformers_greedy(model, n):
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p], device=model.device), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(ids[0, len(p):].tolist())
    return outs


async def test_cuda_fleet_takes_weights_over_cuda_ipc_and_generates_what_they_give():
    from rollfleet.engines.tiny import tiny_llama_model

    trainer = tiny_llama_model(0).cuda()
    async with Supervisor(FleetConfig(engine="torch", num_workers=1, devices=["cuda:0"],
                                      engine_options={"seed": 0})) as sup:
        client = sup.client()
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        before = [(await client.generate(f"b{i}", p, params)).token_ids for i, p in enumerate(PROMPTS)]
        assert before == transformers_greedy(trainer, 16)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        report = await sup.update_weights(((n, p.detach()) for n, p in trainer.named_parameters()), version=1,
                                          bucket_bytes=1 << 20)
        assert {w.transport for w in report.workers.values()} == {"cuda_ipc"} and report.num_buckets > 1
        after = [(await client.generate(f"a{i}", p, params)) for i, p in enumerate(PROMPTS)]
        assert [r.token_ids for r in after] == transformers_greedy(trainer, 16)
        assert all(r.weight_versions == [1] for r in after)
