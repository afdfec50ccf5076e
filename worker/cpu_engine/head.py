"""Logits a bfloat16 model can be read by. bfloat16 keeps 8 significant bits, so logits of magnitude
16-32 come out in steps of 1/8: two labels a little apart read as the same logprob, and an answer's
probabilities fall on a coarse grid (the 1.5B's noul answers took 56 distinct values over 300 items, 22
of them exactly 0.5; bench/RESULTS-quality.md). A float32 copy of the whole projection fixes that but
doubles its weight traffic and runs float32 GEMMs, slow on a CPU built for bfloat16 (bench/cpu_head.py);
so the projection stays bfloat16 and only each position's largest logits, where every label an answer
reads carries weight, are computed again in float32 from the same weights."""

from __future__ import annotations

import torch

REFINED = 64  # logits per position recomputed in float32


class RefinedHead(torch.nn.Module):
    """A bfloat16 `nn.Linear` output projection whose `REFINED` largest logits per position are exact
    float32 dot products (the rest, far below them, keep bfloat16's rounding); float32 logits out."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head  # the original module: its weights are shared, not copied

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        top = logits.topk(min(REFINED, logits.shape[-1]), dim=-1).indices  # [..., REFINED]
        exact = torch.einsum("...kd,...d->...k", self.head.weight[top].float(), hidden.float())
        if self.head.bias is not None:
            exact += self.head.bias[top].float()
        return logits.scatter(-1, top, exact)


def refine_logits(model: torch.nn.Module) -> None:
    """Give `model` (a transformers causal LM in bfloat16) a `RefinedHead`, through its public
    `set_output_embeddings`; the input embeddings keep their module, tied or not."""
    model.set_output_embeddings(RefinedHead(model.get_output_embeddings()))
