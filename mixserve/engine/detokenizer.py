"""Incremental detokenization: the text each new token adds, stable across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens of the prompt decoded with the first outputs, so a leading space or a merged byte sequence
# comes out as it would in the whole text (what vLLM does for sentencepiece-style tokenizers).
PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing token list one token at a time, reading the list it is given (the scheduler's
    record of the request: engine/request_state.py) instead of keeping a copy of it.

    Three offsets into that list: tokens before `end` are decoded, text up to `read` has been returned,
    and decoding restarts at `prefix` for context. A token that ends in the middle of a UTF-8 character
    (decodes to U+FFFD) returns "" until the character completes.
    """

    def __init__(self, tokenizer: Decoder, tokens: Sequence[int], start: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens  # appended to by its owner; only read here
        self.prefix = max(0, start - PROMPT_CONTEXT)
        self.read = self.end = start

    def add(self) -> str:
        """Decode the next token of the list; returns the new text it completes (possibly "")."""
        if self.end >= len(self.tokens):
            raise IndexError(f"no token at {self.end} to decode: the list holds {len(self.tokens)}")
        self.end += 1
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix : self.end], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, self.end
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix : self.end], skip_special_tokens=True)
        self.prefix = self.read = self.end
        return after[len(before) :]
