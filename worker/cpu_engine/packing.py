"""Several prompts that share a start, computed in one forward pass: the shared tokens once, then every
prompt's own tail packed after them in one sequence, each tail attending to the shared tokens and to
itself only (a block mask), at its own positions. This is how the reference engine computes a batched
/generate call as a batch: one pass over the question suffixes of a job instead of one per question."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.cpu_engine.model import LoadedModel
    from worker.cpu_engine.prefix_cache import KeyValues


@dataclass(frozen=True)
class PackedResult:
    """The next-token logits of each prompt, and the KV the pass computed."""

    logits: list[torch.Tensor]  # float32 [vocab] per prompt, in order
    kv: KeyValues  # the past, the shared tokens and every tail, packed: [1, kv_heads, tokens, head_dim]
    shared_end: int  # KV positions [0, shared_end) are the past and the shared tokens
    tails: list[tuple[int, int]]  # each prompt's [start, end) in the packed KV

    def prompt_kv(self, index: int) -> KeyValues:
        """The KV of prompt `index` alone, as one computed by itself would be (a copy)."""
        start, end = self.tails[index]
        return tuple((torch.cat([k[..., :self.shared_end, :], k[..., start:end, :]], dim=-2),
                      torch.cat([v[..., :self.shared_end, :], v[..., start:end, :]], dim=-2)) for k, v in self.kv)


def forward_packed(model: LoadedModel, past: KeyValues | None, past_length: int, shared: list[int],
                   tails: list[list[int]]) -> PackedResult:
    """Run `shared` after the KV `past` (`past_length` tokens), then each of `tails` after `shared`.

    Every tail needs at least one token: its last token's logits are that prompt's answer.
    """
    from transformers import DynamicCache

    new, positions, owners, lasts, spans = _pack(past_length, shared, tails)
    mask = _block_mask(past_length, torch.tensor(owners), dtype=model.model.dtype)  # sdpa wants the query's
    cache = DynamicCache(ddp_cache_data=past, config=model.model.config)
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([new]), position_ids=torch.tensor([positions]),
                          attention_mask=mask, use_cache=True, logits_to_keep=torch.tensor(lasts),
                          **{model.cache_argument: cache})
    kv = tuple((layer.keys, layer.values) for layer in cache.layers)
    logits = [row.float() for row in out.logits[0]]
    return PackedResult(logits, kv, past_length + len(shared), spans)


def _pack(past_length: int, shared: list[int], tails: list[list[int]]
          ) -> tuple[list[int], list[int], list[int], list[int], list[tuple[int, int]]]:
    """The packed ids, their positions, their owner (-1: shared, i: tail i), each tail's last index in the
    packed sequence, and each tail's span in the packed KV."""
    new = list(shared)
    tail_start = past_length + len(shared)
    positions = list(range(past_length, tail_start))
    owners = [-1] * len(shared)
    lasts: list[int] = []
    spans: list[tuple[int, int]] = []
    for index, tail in enumerate(tails):
        if not tail:
            raise ValueError("every packed prompt needs at least one token of its own")
        spans.append((past_length + len(new), past_length + len(new) + len(tail)))
        new += tail
        positions += range(tail_start, tail_start + len(tail))
        owners += [index] * len(tail)
        lasts.append(len(new) - 1)
    return new, positions, owners, lasts, spans


def _block_mask(past_length: int, owners: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive [1, 1, new, past + new] mask: every token sees the past; within the new tokens, causal
    and only its own tail and the shared tokens. Additive (0 / min) so eager and sdpa attention read it alike."""
    count = len(owners)
    index = torch.arange(count)
    causal = index[None, :] <= index[:, None]
    related = (owners[None, :] == owners[:, None]) | (owners[None, :] == -1)
    allowed = torch.cat([torch.ones(count, past_length, dtype=torch.bool), causal & related], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def chunks(lengths: list[int], budget: int) -> Iterator[range]:
    """Consecutive index ranges whose `lengths` sum to at most `budget` (at least one index each)."""
    start, total = 0, 0
    for index, length in enumerate(lengths):
        if index > start and total + length > budget:
            yield range(start, index)
            start, total = index, 0
        total += length
    if start < len(lengths):
        yield range(start, len(lengths))
