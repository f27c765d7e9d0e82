"""Tokenizer.decode calls the Rust tokenizer directly, with exactly transformers' result."""

from __future__ import annotations

import random
from types import SimpleNamespace

from mixserve.model.loader import default_model_path
from mixserve.model.tokenizer import Tokenizer, load_tokenizer


def test_fast_decode_equals_transformers_decode() -> None:
    tok = load_tokenizer(default_model_path())
    assert tok._fast_decode is not None  # SmolLM2's tokenizer cleans up no spaces: the fast path is on
    rng = random.Random(0)
    texts = ["Hello, world! Ça va? 日本語 🎉", "  spaces\tand\nlines", "<|im_start|>user\nhi<|im_end|>"]
    seqs = [tok.encode(t) for t in texts]
    seqs += [[rng.randrange(len(tok.hf)) for _ in range(rng.randrange(1, 20))] for _ in range(300)]
    for ids in seqs:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers() -> None:
    calls: list[list[int]] = []
    hf = SimpleNamespace(eos_token_id=None, clean_up_tokenization_spaces=True,
                         backend_tokenizer=SimpleNamespace(decode=lambda ids, **kw: "raw"),
                         decode=lambda ids, **kw: calls.append(ids) or "cleaned")
    tok = Tokenizer(hf)
    assert tok.decode([1, 2]) == "cleaned" and calls == [[1, 2]]
