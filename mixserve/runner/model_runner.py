"""ModelRunner: one ForwardBatch (decodes and prefill chunks mixed) -> one model forward -> logits per seq."""

from __future__ import annotations

from pathlib import Path

import torch

from mixserve.core.batch import ForwardBatch
from mixserve.model.attention import get_backend
from mixserve.model.attention.base import AttentionBackend, logits_index, packed_tokens
from mixserve.model.config import ModelConfig
from mixserve.model.decoder import DecoderModel
from mixserve.model.loader import load_model
from mixserve.model.ops import CpuFeatures, LayerOps, cpu_features, log_bf16_on_cpu, select_ops
from mixserve.model.tokenizer import Tokenizer
from mixserve.runner.heap import keep_freed_memory
from mixserve.runner.kv_cache import KVCache, num_blocks_for_memory


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else as torch names it."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: expected auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/"auto" -> float32 on CPU, bfloat16 on CUDA; names like "bfloat16" or "fp32" are accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: expected auto, float32, bfloat16 or float16")
    return names[dtype]


class ModelRunner:
    """Holds the model, its paged KV cache and an attention backend; forward() runs one mixed batch."""

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        *,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend,
        model_name: str,
        path: Path | None = None,
        cuda_graphs: bool,
        max_num_seqs: int,
    ):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device: torch.device = model.device
        self.dtype: torch.dtype = model.dtype
        self.max_model_len: int = self.config.max_position_embeddings
        self.model_name = model_name
        self.path = path
        self.attention = attention
        on_cuda = self.device.type == "cuda"
        # On CUDA one more block than the scheduler knows: the scratch block decode-graph padding rows write.
        self.kv_cache = KVCache(self.config, num_blocks + int(on_cuda), block_size, self.dtype, self.device)
        # The Triton kernels (mixserve/kernels) are checked on this device once: a triton that cannot build
        # them turns them off (one warning) instead of failing the first step. None = fine or not used.
        self.kernels_off_reason: str | None = None
        if on_cuda:
            from mixserve.kernels.self_check import check_or_disable

            self.kernels_off_reason = check_or_disable(self.device, self.dtype)
        # After the self-check: a backend that composes its kernels per device (GpuAttention) does it here.
        attention.configure(self.config.num_heads, self.config.num_kv_heads, self.device)
        # The layer ops, decided once here and handed to the model (which packs its weights for them): the
        # Triton set on CUDA, prepacked oneDNN linears on a CPU (mixserve/model/ops.py).
        self.cpu_features: CpuFeatures | None = None
        if self.device.type == "cpu":
            self.cpu_features = cpu_features()
            log_bf16_on_cpu(self.cpu_features, self.dtype)
        self.ops: LayerOps = select_ops(self.device, self.dtype, self.config.hidden_size)
        model.prepare(self.ops)
        self.graphs = None  # DecodeGraphs (runner/cuda_graph.py): decode-only steps replay CUDA graphs
        if cuda_graphs and on_cuda and attention.supports_graphs:
            from mixserve.runner.cuda_graph import DecodeGraphs, decode_model_fn

            # The graphs run this runner's own backend: its decode part decides which steps they take.
            model_fn = decode_model_fn(self.model, self.kv_cache.layers, attention)
            self.graphs = DecodeGraphs(model_fn, attention, block_size=block_size, max_num_seqs=max_num_seqs,
                                       scratch_block=num_blocks, device=self.device)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        *,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        attention_backend: str = "auto",
        cpu_kv_cache_gib: float = 2.0,
        gpu_memory_utilization: float = 0.9,
        cuda_graphs: bool = True,
        max_num_seqs: int = 256,
        quantization: str = "auto",
        int8_activations: bool = False,
    ) -> ModelRunner:
        """Load a GGUF file or HF folder (None: the default model) and allocate `num_blocks` KV blocks.

        num_blocks=0 sizes the cache from memory: `cpu_kv_cache_gib` on the CPU, `gpu_memory_utilization` of
        the GPU. On CUDA, decode-only steps of up to `max_num_seqs` sequences replay CUDA graphs
        (`cuda_graphs=False` runs every step eagerly). `quantization`, `int8_activations`:
        model/quantization.py."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be 0 (size from memory) or positive, got {num_blocks}")
        dev = resolve_device(device)
        if dev.type == "cpu":
            keep_freed_memory()  # the steps' buffers reused, not faulted in again (runner/heap.py)
        dt = resolve_dtype(dtype, dev)
        attention = get_backend(attention_backend, dev, dt)
        loaded = load_model(model, device=dev, dtype=dt, quantization=quantization,
                            int8_activations=int8_activations)
        if num_blocks == 0:
            num_blocks = num_blocks_for_memory(loaded.config, block_size, dt, dev, cpu_kv_cache_gib,
                                               gpu_memory_utilization)
        return cls(loaded.model, loaded.tokenizer, num_blocks=num_blocks, block_size=block_size,
                   attention=attention, model_name=loaded.name, path=loaded.path, cuda_graphs=cuda_graphs,
                   max_num_seqs=max_num_seqs)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in the cache over all layers."""
        return self.config.kv_bytes_per_token(torch.empty((), dtype=self.dtype).element_size())

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """(batch.num_logits, vocab) float32 logits: the last `num_logits` tokens of each seq in order
        (one row per seq, its last token, unless a decode verifies drafts).

        Writes every token's K/V into the slots its block table names; one model forward for all seqs.
        A decode-only step may replay a CUDA graph: its logits stay valid until the next forward."""
        top = max((max(s.block_table, default=0) for s in batch.seqs), default=0)
        if top >= self.num_blocks:
            raise ValueError(f"block id {top} out of range: the KV cache has {self.num_blocks} blocks")
        if self.graphs is not None and self.graphs.key(batch) is not None:
            return self.graphs.run(batch)
        with torch.inference_mode():
            meta = self.attention.prepare(batch, self.block_size, self.device)
            rows = logits_index(batch)
            if rows is not None:
                meta.logits_index = torch.tensor(rows, dtype=torch.int64).to(self.device)
            if self.device.type == "cuda":
                # Pinned and non-blocking: the host queues the copy instead of waiting for the device.
                input_ids = packed_tokens(batch, torch.device("cpu")).pin_memory().to(self.device,
                                                                                      non_blocking=True)
            else:
                input_ids = packed_tokens(batch, self.device)
            return self.model(input_ids, meta, self.kv_cache.layers, self.attention)
