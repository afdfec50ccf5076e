"""A cheap lower bound on a text's token count, so a state that cannot fit the token budget is
refused without tokenizing all of it (a 1.9 MB state takes ~4.6 s to tokenize whole): first from its
bytes and the longest token, then from its words, then by tokenizing it in pieces until the count passes."""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

PIECE_CHARS = 16384  # characters tokenized at a time, ~4k tokens: the bound stops a piece past the limit
BATCH = 4  # pieces tokenized together (in parallel where the tokenizer can)
WINDOW = 32  # characters on either side of a cut that the pre-tokenizer is asked about
# Where a text may be cut: a space after a letter or digit and before a letter, or after a line break
# and before a letter. Regex pre-tokenizers (GPT-2's, Qwen's, Llama 3's) start a new pre-token there, and
# tokens never cross pre-tokens, so the pieces' tokens are exactly the text's; each cut is checked with
# the tokenizer's own pre-tokenizer, and one that it does not split at is not used.
CUT = re.compile(r"(?<=[^\W_]) (?=[^\W\d_])|(?<=\n)(?=[^\W\d_])")


class TokenFloor:
    """Counts at least how many tokens a text needs, stopping as soon as that passes a limit."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        # A vocabulary entry's UTF-8 length is at least the bytes its token stands for (byte-level
        # BPE writes one byte as one or two UTF-8 bytes), so no token covers more than this.
        self.longest_token_bytes = max(len(token.encode("utf-8", "surrogatepass"))
                                       for token in tokenizer.get_vocab())
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust one
        self._pre_tokenizer = self._backend.pre_tokenizer if self._backend is not None else None
        self._word_per_token = self._pre_tokenizer is not None and _word_per_token(tokenizer, self._pre_tokenizer)

    def at_least(self, text: str, limit: int) -> int:
        """A number no greater than `text`'s token count (without special tokens added); once it is
        shown to exceed `limit`, the rest of the text is not tokenized."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size <= limit:  # a token is at least one byte: it fits, whatever it holds
            return 0
        counted = -(-size // self.longest_token_bytes)
        if counted > limit:
            return counted
        if self._word_per_token and not PYTHON_ONLY_SPACES.search(text):
            words = len(text.split(maxsplit=limit))  # the last item holds the rest: at least one more word
            if words > limit:
                return words
        counted = cuts = start = 0
        while start < len(text) and counted - cuts <= limit:
            pieces = []
            while start < len(text) and len(pieces) < BATCH:
                end = self._cut(text, start + PIECE_CHARS)
                pieces.append(text[start:end])
                cuts += end < len(text)  # one token of slack per cut, for a tokenizer that adds a prefix space
                start = end
            counted += sum(self._count(pieces))
        return counted - cuts

    def _count(self, pieces: list[str]) -> list[int]:
        if self._backend is not None and hasattr(self._backend, "encode_batch_fast"):  # no offsets: ~3x faster
            return [len(encoding.ids) for encoding in self._backend.encode_batch_fast(pieces, add_special_tokens=False)]
        return [len(ids) for ids in self._tokenizer(pieces, add_special_tokens=False)["input_ids"]]

    def _cut(self, text: str, after: int) -> int:
        """The first place at or after `after` where the pre-tokenizer splits `text`; its end if none."""
        if self._pre_tokenizer is None:
            return len(text)
        for candidate in CUT.finditer(text, after):
            cut = candidate.start()
            left = max(0, cut - WINDOW)
            starts = {start for _, (start, _) in self._pre_tokenizer.pre_tokenize_str(text[left:cut + WINDOW])}
            if cut - left in starts:
                return cut
        return len(text)


PROBE = "Ab cd\nef 12 gh, ij. kl émigré Ωx 数据 de\n\nmn  op\tqr !! \n \n st\u3000uv\xa0wx 'll y"
PYTHON_ONLY_SPACES = re.compile("[\x1c-\x1f]")  # str.split's whitespace beyond Unicode's White_Space


def _word_per_token(tokenizer: PreTrainedTokenizerBase, pre_tokenizer: Any) -> bool:
    """Whether a text has at least as many tokens as whitespace-separated words: true when no pre-token
    reaches over whitespace into a second word (regex pre-tokenizers: a word's first token may carry the
    space before it, never the word before), checked on a probe text, and no added token (taken out
    before pre-tokenizing) holds two words."""
    pieces = [PROBE[start:end] for _, (start, end) in pre_tokenizer.pre_tokenize_str(PROBE)]
    return (all(len(piece.split()) <= 1 for piece in pieces)
            and all(len(token.split()) <= 1 for token in tokenizer.get_added_vocab()))
