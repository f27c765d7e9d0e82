"""Incremental detokenization: the text each new token adds, stable across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens of the prompt decoded with the first outputs, so a leading space or a merged byte sequence
# comes out as it would in the whole text (what vLLM does for sentencepiece-style tokenizers).
PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing token list one token at a time.

    Keeps two offsets into the ids: text up to `read` has been returned, decoding restarts at `prefix`
    for context. A token that ends in the middle of a UTF-8 character (decodes to U+FFFD) returns ""
    until the character completes.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text it completes (possibly "")."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
