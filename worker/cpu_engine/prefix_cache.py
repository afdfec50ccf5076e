"""The reference engine's prefix KV cache: the keys and values of recently computed prompts, so a prompt
that starts like one of them computes only the tokens after the longest common prefix.

An LRU over whole prompts, bounded by the total number of cached tokens. Entries are namespaced by a salt
(`extra_key`/`cache_salt`): a prompt only reuses KV computed under the same salt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# Per layer (keys, values), each [1, kv_heads, tokens, head_dim].
KeyValues = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class PrefixHit:
    """The reusable start of a prompt."""

    length: int  # prompt tokens whose KV is reused; 0 when nothing matched
    kv: KeyValues | None  # a private copy of that KV, cropped to `length`; None when `length` is 0


@dataclass
class _Entry:
    salt: str
    tokens: torch.Tensor  # 1-D int64 token ids of the whole prompt
    kv: KeyValues  # KV of every token in `tokens`


class PrefixCache:
    """Longest-prefix lookup over recently computed prompts; used from one thread only."""

    def __init__(self, capacity_tokens: int) -> None:
        """`capacity_tokens`: the most prompt tokens whose KV is kept, over all entries."""
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.size_tokens = 0

    def longest_prefix(self, salt: str, tokens: torch.Tensor, limit: int) -> PrefixHit:
        """The longest cached prefix of `tokens` under `salt`, at most `limit` tokens long.

        The returned KV is a copy: callers may extend it freely.
        """
        best_id, best_len = self._longest(salt, tokens, limit)
        if best_id is None or best_len <= 0:
            return PrefixHit(0, None)
        self._entries.move_to_end(best_id)
        kv = tuple((k[..., :best_len, :].clone(), v[..., :best_len, :].clone()) for k, v in
                   self._entries[best_id].kv)
        return PrefixHit(best_len, kv)

    def match_length(self, salt: str, tokens: torch.Tensor, limit: int) -> int:
        """How many leading tokens of `tokens` (at most `limit`) a `longest_prefix` would reuse; no copy."""
        return self._longest(salt, tokens, limit)[1]

    def _longest(self, salt: str, tokens: torch.Tensor, limit: int) -> tuple[int | None, int]:
        best_id, best_len = None, 0
        for entry_id, entry in self._entries.items():
            if entry.salt == salt:
                length = common_prefix_length(entry.tokens, tokens)
                if length > best_len:
                    best_id, best_len = entry_id, length
        return best_id, min(best_len, limit)

    def store(self, salt: str, tokens: torch.Tensor, kv: KeyValues) -> None:
        """Keep the KV of a computed prompt, evicting the least recently used prompts beyond capacity.

        The cache takes ownership of `kv`. Entries that are a prefix of `tokens` are dropped (the new entry
        serves every lookup they served); if `tokens` is a prefix of an entry, nothing new is stored.
        """
        for entry_id, entry in list(self._entries.items()):
            if entry.salt != salt:
                continue
            length = common_prefix_length(entry.tokens, tokens)
            if length == len(tokens):
                self._entries.move_to_end(entry_id)
                return
            if length == len(entry.tokens):
                self._remove(entry_id)
        if len(tokens) > self.capacity_tokens:
            return
        self._entries[self._next_id] = _Entry(salt, tokens, kv)
        self._next_id += 1
        self.size_tokens += len(tokens)
        while self.size_tokens > self.capacity_tokens:
            self._remove(next(iter(self._entries)))

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, entry_id: int) -> None:
        self.size_tokens -= len(self._entries.pop(entry_id).tokens)


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two 1-D id tensors share (vectorised: a lookup is linear in the tokens)."""
    n = min(len(a), len(b))
    mismatches = torch.nonzero(a[:n] != b[:n])
    return int(mismatches[0]) if len(mismatches) else n
