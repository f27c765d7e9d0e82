"""ModelRunner construction: cache sizing, dtype/device defaults, the public import."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.runner.kv_cache import block_bytes


def test_public_import_and_attributes(tiny_model_dir: Path) -> None:
    from mixserve import ModelRunner

    r = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=10, block_size=8)
    assert (r.num_blocks, r.block_size, r.dtype, r.device.type) == (10, 8, torch.float32, "cpu")
    assert r.max_model_len == r.config.max_position_embeddings == 1024
    assert r.model_name == tiny_model_dir.name
    k, v = r.kv_cache.layers[0]
    assert k.shape == v.shape == (10, 8, r.config.num_kv_heads, r.config.head_dim)
    assert len(r.kv_cache.layers) == r.config.num_layers
    out = r.forward(ForwardBatch([ForwardSeq("a", [1, 2, 3], 0, [0]), ForwardSeq("b", [4], 0, [1])]))
    assert out.shape == (2, r.config.vocab_size) and out.dtype == torch.float32


def test_num_blocks_zero_sizes_the_cache_from_memory(tiny_model_dir: Path) -> None:
    from mixserve import ModelRunner

    r = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=0, block_size=16, cpu_kv_cache_gib=0.01)
    assert r.num_blocks == int(0.01 * (1 << 30) // block_bytes(r.config, 16, torch.float32))
    assert r.kv_cache.nbytes <= 0.01 * (1 << 30)


def test_bfloat16_on_request(tiny_model_dir: Path) -> None:
    from mixserve import ModelRunner

    r = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=4, dtype="bfloat16")
    assert r.dtype == torch.bfloat16 and r.kv_cache.layers[0][0].dtype == torch.bfloat16
    out = r.forward(ForwardBatch([ForwardSeq("a", [1, 2, 3], 0, [0])]))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_blocks": -1}, "num_blocks must be 0"),
    ({"num_blocks": 4, "block_size": 0}, "block_size must be at least 1"),
    ({"num_blocks": 4, "dtype": "int7"}, "unknown dtype 'int7'"),
    ({"num_blocks": 4, "device": "tpu9"}, "unknown device 'tpu9'"),
    ({"num_blocks": 4, "attention_backend": "nope"}, "unknown attention backend"),
])
def test_bad_arguments_are_clear_errors(tiny_model_dir: Path, kwargs: dict, message: str) -> None:
    from mixserve import ModelRunner

    with pytest.raises(ValueError, match=message):
        ModelRunner.from_pretrained(str(tiny_model_dir), **kwargs)
