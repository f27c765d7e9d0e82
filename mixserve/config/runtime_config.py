"""The configuration dataclasses: the keys and defaults of runtime.toml (DESIGN.md section 3)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    """The `[engine]` table: scheduling, KV cache, model and device."""

    model: str = ""
    prefill_chunk: int = 256
    max_batch_tokens: int = 512
    max_num_seqs: int = 64
    block_size: int = 16
    num_blocks: int = 0
    cpu_kv_cache_gib: float = 2
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    step_trace: str = ""
    tpot_target_ms: float = 0
    waiting_share: float = 0.15  # core/waiting_share.py
    slo_ttft_ms: float = 0  # serve to an SLO (core/slo.py); 0 = off
    slo_tpot_ms: float = 0  # supersedes tpot_target_ms when set
    max_partial_prefills: int = 0
    long_prefill_threshold: int = 0
    max_long_partial_prefills: int = 0
    cost_model: str = ""
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    threads: int = 0
    tensor_parallel_size: int = 1
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"  # auto | none | int8 (mixserve/model/quantization.py)
    int8_activations: bool = False  # quantized weights multiply int8-rounded inputs (llama.cpp's rounding)
    speculative: str = ""  # "" (off) | ngram (core/speculative.py) | a draft model's path (draft_model.py)
    num_speculative_tokens: int = 4  # k: the most drafts a decode carries


@dataclass(frozen=True)
class ServerConfig:
    """The `[server]` table: where the HTTP server listens and how much it queues."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    max_waiting: int = 1024
    max_body_bytes: int = 2 * 1024 * 1024
    body_timeout_s: float = 30.0
    step_timeout_s: float = 0.0
    max_engine_restarts: int = 3
    served_model_name: list[str] = field(default_factory=list)  # names clients may use; [] = the model's
    role: str = "both"  # disaggregated prefill: both | prefill | decode (mixserve/disagg/)
    kv_peer: str = ""  # HOST:PORT of the KV link, hosted by the prefill instance
    kv_peer_timeout_s: float = 60.0  # KV not back by then: the decode instance prefills the prompt itself
    kv_peer_min_tokens: int = 0  # prompts with fewer uncached tokens are prefilled on the decode instance


@dataclass(frozen=True)
class RuntimeConfig:
    """The whole runtime.toml."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
