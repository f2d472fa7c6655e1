"""The running batch of the torch engine, and its sampler: tensors only, no threads.

``Batch`` keeps one left-padded KV cache for all running requests: row i holds its n_i
cached tokens in the last n_i columns, ``mask`` hides the padding, ``pos`` counts each
row's own tokens (its next position id) and ``last`` is each row's next input token.
Rows join after their own unpadded prefill and leave when they finish; the transformers
``DynamicCache`` is rebuilt only then, and grows in place during decode steps. Meant for
full-attention models (Llama, Qwen, ...); sliding-window layers would need their own care.

``sample`` draws a token per row under that row's temperature, top-k and top-p.
"""

from __future__ import annotations

from typing import Any

import torch

from ..transport.messages import SamplingParams

__all__ = ["Batch", "SAMPLING_EPS", "pad_left", "sample"]

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy, as in vLLM: dividing float32 logits by a tinier one
overflows to inf, and the softmax of that is NaN."""


class Batch:
    """The running requests and their left-padded KV cache (one row each)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seqs: list[Any] = []
        self.cache: Any = None  # a DynamicCache, rebuilt when rows join or leave
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)  # tokens cached per row
        self.last = torch.zeros(0, dtype=torch.long, device=device)  # next input per row

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers] if self.cache else []

    def add(self, parts: list[tuple[Any, Any, int]], config: Any) -> None:
        """Append rows, one per (seq, its own prefill DynamicCache, its next input token)."""
        from transformers import DynamicCache

        lengths = [cache.layers[0].keys.shape[2] for _, cache, _ in parts]
        width = max([self.mask.shape[1], *lengths])
        keys: list[list[torch.Tensor]] = [[] for _ in parts[0][1].layers]
        values: list[list[torch.Tensor]] = [[] for _ in parts[0][1].layers]
        caches = ([(self.layers(), self.mask.shape[1])] if self.seqs else []) + [
            ([(layer.keys, layer.values) for layer in cache.layers], n) for (_, cache, _), n in zip(parts, lengths)
        ]
        for layers, n in caches:
            for i, (k, v) in enumerate(layers):
                keys[i].append(pad_left(k, width - n))
                values[i].append(pad_left(v, width - n))
        columns = torch.arange(width, device=self.device)
        masks = [pad_left(self.mask, width - self.mask.shape[1])] if self.seqs else []
        masks += [(columns >= width - n).long()[None] for n in lengths]
        self.mask = torch.cat(masks)
        self.cache = DynamicCache(ddp_cache_data=[(torch.cat(k), torch.cat(v)) for k, v in zip(keys, values)],
                                  config=config)
        self.seqs += [seq for seq, _, _ in parts]
        new = torch.tensor([[n, token] for (_, _, token), n in zip(parts, lengths)], device=self.device)
        self.pos = torch.cat([self.pos, new[:, 0]])
        self.last = torch.cat([self.last, new[:, 1]])

    def keep(self, rows: list[int], config: Any) -> None:
        """Keep only these rows, then trim columns that are padding in every row."""
        from transformers import DynamicCache

        if not rows:
            self.seqs, self.cache = [], None
            self.mask, self.pos, self.last = self.mask[:0, :0], self.pos[:0], self.last[:0]
            return
        index = torch.tensor(rows, device=self.device)
        self.seqs = [self.seqs[i] for i in rows]
        self.pos, self.last = self.pos[index], self.last[index]
        cut = self.mask.shape[1] - int(self.pos.max())
        self.mask = self.mask[index, cut:]
        self.cache = DynamicCache(ddp_cache_data=[(k[index, :, cut:], v[index, :, cut:]) for k, v in self.layers()],
                                  config=config)


def pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """Add n zero columns before the sequence axis (the last-but-one of KV, the last of a mask)."""
    if n == 0:
        return t
    if t.dim() == 2:
        return torch.cat([t.new_zeros(t.shape[0], n), t], dim=1)
    shape = list(t.shape)
    shape[2] = n
    return torch.cat([t.new_zeros(shape), t], dim=2)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row of raw logits under each row's temperature, top-k and top-p.

    Row work is batched; only the one uniform draw per row comes from that row's own
    generator, so a seeded request draws the same tokens in any batch. Sorting the vocab
    is slow on a CPU, so only rows with top_p < 1 are sorted. Temperatures must be at least
    ``SAMPLING_EPS`` (the caller takes the argmax below it).
    """
    vocab = logits.shape[1]
    device, dtype = logits.device, logits.dtype
    x = logits / torch.tensor([p.temperature for p in params], device=device, dtype=dtype)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks], device=device)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=device)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value stay in
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=device, dtype=dtype)[:, None]
        sub = x[nucleus]
        sorted_x = torch.sort(sub, dim=-1, descending=True).values
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep tokens while the mass before them is below top_p, and always the most likely one
        # (as vLLM does): a top_p that float32 rounds to 0 (1e-300) would otherwise keep none.
        num_keep = ((torch.cumsum(probs, dim=-1) - probs) < top_p).sum(dim=1, keepdim=True).clamp(min=1)
        x[nucleus] = sub.masked_fill(sub < sorted_x.gather(1, num_keep - 1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, generator=g, device=device, dtype=dtype) for g in generators])
    # right=True skips zero-probability tokens; the fix-up covers u * total rounding up to total.
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    last = vocab - 1 - (probs > 0).flip(1).int().argmax(dim=1, keepdim=True)
    index = torch.where(probs.gather(1, index) > 0, index, last)
    return index[:, 0]
