"""RL loop under torchrun: every rank owns a small policy and its own engine worker (hybrid mode).

    torchrun --nproc_per_node=2 examples/torchrun_rl.py --steps 3
    python examples/torchrun_rl.py --steps 3      # one rank, no torchrun

Each step: wake the engine, generate rollouts, put the engine to sleep, take a real
policy-gradient step (REINFORCE on the generated tokens' log-probs, gradients averaged
across ranks with gloo/NCCL), then push the new weights with version = step. The printed
lines show each batch's weight versions advancing with the steps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from rollfleet.actors import FleetConfig, SyncClient
from rollfleet.engines.tiny import tiny_llama_model
from rollfleet.transport.messages import SamplingParams


def reward(tokens: list[int]) -> float:
    """A toy verifiable reward: the share of even token ids in the completion."""
    return sum(1 for t in tokens if t % 2 == 0) / max(1, len(tokens))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    distributed = "MASTER_ADDR" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")

    # The same initial policy on every rank and in every engine: the tiny model of seed 0.
    policy = tiny_llama_model(0).to(device)
    optim = torch.optim.SGD(policy.parameters(), lr=args.lr)

    # Hybrid: the engine lives on this rank's device; weights go over cuda_ipc or shm.
    fleet = SyncClient(FleetConfig(
        engine="torch",
        num_workers=1,
        devices=[f"cuda:{local_rank}" if cuda else "cpu"],
        # seed 0 picks the tiny model's weights (the same on every rank); sampling_seed keeps the
        # ranks' draws apart (each rank's fleet derives one per worker from it).
        engine_options={"seed": 0, "sampling_seed": 1000 + rank},
        frontend_addr=None,
    ))
    gen = torch.Generator().manual_seed(1000 + rank)
    try:
        for step in range(1, args.steps + 1):
            fleet.wake_up()
            prompts = [[1] + torch.randint(3, 500, (6,), generator=gen).tolist() for _ in range(args.batch)]
            # No per-request seed: one seed for a whole batch would give a group of samples of one
            # prompt (GRPO) the same tokens; each request draws from its worker's own source.
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
            results = fleet.generate_batch(prompts, params)
            fleet.sleep()

            # REINFORCE: loss = -(r - mean r) * sum log pi(token | prefix)
            rewards = torch.tensor([reward(r.token_ids) for r in results], device=device)
            advantages = rewards - rewards.mean()
            policy.train()
            optim.zero_grad()
            loss = torch.zeros((), device=device)
            for prompt, res, adv in zip(prompts, results, advantages):
                ids = torch.tensor([prompt + res.token_ids], device=device)
                logits = policy(ids).logits[0, len(prompt) - 1 : -1]
                logp = torch.log_softmax(logits.float(), dim=-1)
                chosen = logp.gather(1, ids[0, len(prompt):, None]).sum()
                loss = loss - adv * chosen / len(results)
            loss.backward()
            for p in policy.parameters():  # average gradients across ranks
                if p.grad is not None and distributed:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= world
            optim.step()

            versions = sorted({v for r in results for v in r.weight_versions})
            report = fleet.update_weights(((n, p.detach()) for n, p in policy.named_parameters()), version=step)
            print(f"rank {rank} step {step}: generated under versions {versions}, "
                  f"mean reward {rewards.mean().item():.3f}, loss {loss.item():.4f}, "
                  f"pushed version {step} ({report.bytes} bytes)", flush=True)
        fleet.wake_up()
        final = fleet.generate("final", [1, 5, 9], SamplingParams(max_tokens=4, temperature=0))
        print(f"rank {rank} done: final weight versions {final.weight_versions}", flush=True)
    finally:
        fleet.shutdown()
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
