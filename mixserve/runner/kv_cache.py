"""The paged KV cache: per layer a K and a V tensor of (num_blocks, block_size, num_kv_heads, head_dim)."""

from __future__ import annotations

import torch

from mixserve.model.config import ModelConfig

GIB = 1 << 30


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    return block_size * cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def num_blocks_for_memory(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    cpu_kv_cache_gib: float,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks fit: `cpu_kv_cache_gib` on the CPU; on CUDA, what is left of the utilization target
    (the defaults are ModelRunner.from_pretrained's)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Keep (1 - utilization) of the device free; weights are already loaded, so `free` counts them.
        budget = free - (1.0 - gpu_memory_utilization) * total
    else:
        budget = cpu_kv_cache_gib * GIB
    n = int(budget // block_bytes(cfg, block_size, dtype))
    if n < 1:
        raise ValueError(
            f"no memory left for the KV cache on {device} (one block needs "
            f"{block_bytes(cfg, block_size, dtype)} bytes): raise cpu_kv_cache_gib or gpu_memory_utilization"
        )
    return n


class KVCache:
    """K and V tensors per layer; the block tables of a ForwardBatch index their first dimension."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Total bytes of every K and V tensor."""
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
