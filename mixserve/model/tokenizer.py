"""Tokenizer: a thin wrapper over transformers' tokenizer with the few calls the engine makes."""

from __future__ import annotations

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
