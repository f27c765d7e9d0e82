"""Tokenizer: a thin wrapper over transformers' tokenizer with the few calls the engine makes."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mixserve.model.errors import ModelLoadError


class Tokenizer:
    """encode/decode/chat template plus the set of end-of-sequence ids; `hf` is the wrapped tokenizer."""

    def __init__(self, hf: Any, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf
        # The engine decodes twice per generated token (incremental detokenization): calling the Rust
        # tokenizer directly skips transformers' per-call Python (about 6x faster per call). Only when
        # transformers would add nothing to it: no clean-up of tokenization spaces.
        backend = getattr(hf, "backend_tokenizer", None)
        cleans = bool(getattr(hf, "clean_up_tokenization_spaces", False))
        self._fast_decode = backend.decode if backend is not None and not cleans else None
        eos = set(extra_eos_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        if self._fast_decode is not None:
            return self._fast_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat rendered with the model's own template."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
        if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, through the Rust tokenizer's `encode_batch`, which releases the GIL while it works:
        the server runs it on a worker thread and its event loop keeps answering (plain `encode` holds
        the GIL for the whole text)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return self.encode(text, add_special_tokens)
        return list(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as text through the model's template; `encode_releasing_gil(text, False)` of it gives
        `apply_chat_template`'s ids (transformers tokenizes the rendered text without special tokens)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token's text takes: a text of B bytes is at least
        B / max_token_bytes tokens, a bound that refuses a huge prompt without tokenizing it."""
        vocab = self.hf.get_vocab() if hasattr(self.hf, "get_vocab") else {}
        return max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=1) or 1

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def load_tokenizer(path: Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
    """The tokenizer of a GGUF file (from its metadata) or of a model folder (its tokenizer files)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_file():
            # Not AutoTokenizer: it also rebuilds the model config through gguf.GGUFReader (tens of seconds);
            # the fast class reads only the tokenizer and gives the same tokenizer.
            hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({' '.join(str(e).split())})") from None
    return Tokenizer(hf, extra_eos_ids)
