"""The output projection in float32 for a model that computes in bfloat16. bfloat16 keeps 8 significant
bits, so logits of magnitude 16-32 come out in steps of 1/8: two labels a little apart read as the same
logprob, and an answer's probabilities fall on a coarse grid (the 1.5B's noul answers took 56 distinct
values over 300 items, 22 of them exactly 0.5; bench/RESULTS-quality.md). Projecting the last hidden
state in float32 costs one float32 copy of the projection's weights and one float32 matrix-vector product
per answered position, while every layer below it stays in bfloat16."""

from __future__ import annotations

import torch


class Float32Head(torch.nn.Module):
    """An `nn.Linear` output projection held and computed in float32, whatever its input's dtype."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(head.weight.detach().float(), requires_grad=False)
        self.bias = None if head.bias is None else torch.nn.Parameter(head.bias.detach().float(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight, self.bias)


def project_in_float32(model: torch.nn.Module) -> None:
    """Give `model` (a transformers causal LM) a float32 output projection, through its public
    `set_output_embeddings`; the input embeddings keep the original, tied or not."""
    model.set_output_embeddings(Float32Head(model.get_output_embeddings()))
