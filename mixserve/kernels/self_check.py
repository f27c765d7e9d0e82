"""Start-up check of the Triton kernels on the device that will run them.

A triton build that cannot compile one of our kernels (an older or newer release, an unsupported GPU)
must not take the engine down: each kernel runs once on small inputs against its PyTorch reference, and
the first failure or mismatch comes back as one line; the runner then turns the kernels off and the
eager PyTorch ops run instead. The check also moves the kernels' JIT compiles out of the first request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# bf16 keeps 8 bits of mantissa: the kernels and the references round at different points.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
    if not err <= TOLERANCE.get(dtype, 3e-2):  # also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3g} against its PyTorch reference")


def _check_norms(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    from mixserve.kernels import norm

    x, res = (torch.randn(5, 96, generator=gen).to(device, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(device, dtype)
    _close("rms_norm", norm.rms_norm(x, weight, 1e-5), norm.rms_norm_reference(x, weight, 1e-5), dtype)
    got, got_res = norm.add_rms_norm(x, res, weight, 1e-5)
    want, want_res = norm.add_rms_norm_reference(x, res, weight, 1e-5)
    _close("add_rms_norm", got, want, dtype)
    _close("add_rms_norm (residual)", got_res, want_res, dtype)


def _check_activation(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    from mixserve.kernels import activation

    gate_up = torch.randn(5, 2 * 48, generator=gen).to(device, dtype)
    _close("silu_and_mul", activation.silu_and_mul(gate_up), activation.silu_and_mul_reference(gate_up),
           dtype)


def _check_rope(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    from mixserve.kernels import rope

    tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 16
    angles = torch.rand(32, head_dim // 2, generator=gen) * 6.28
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    positions = torch.tensor([3, 0, 17, 31, 8], device=device)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    want_q, want_k = rope.rotary_qk_reference(q.clone(), k.clone(), cos, sin, positions)
    rope.rotary_qk_(q, k, cos, sin, positions)
    _close("rotary_qk_ (q)", q, want_q, dtype)
    _close("rotary_qk_ (k)", k, want_k, dtype)


def _check_paged_attention(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    from mixserve.kernels import paged_attention as pa

    num_blocks, block_size, kv_heads, head_dim, q_heads = 24, 16, 2, 64, 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    k_new, v_new = (torch.randn(3, kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    slots = torch.tensor([5, 40, 77], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    pa.store_kv_ref(k_new, v_new, want_k, want_v, slots)
    pa.store_kv(k_new, v_new, k_cache, v_cache, slots)
    _close("store_kv (k)", k_cache, want_k, dtype)
    _close("store_kv (v)", v_cache, want_v, dtype)
    ctx = 128
    q = torch.randn(3, q_heads, head_dim, generator=gen).to(device, dtype)
    order = torch.randperm(num_blocks, generator=gen)[: 3 * ctx // block_size]
    tables = order.view(3, ctx // block_size).to(device)
    seq_lens = torch.tensor([128, 1, 70], device=device)
    want = pa.paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, ctx)
    # One split (a single kernel) and two (split kernel + merge): both variants a CUDA graph may capture.
    for splits in (1, 2):
        got = pa.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, ctx, num_splits=splits)
        _close(f"paged_decode_attention ({splits} split{'s' if splits > 1 else ''})", got, want, dtype)


def _check_varlen_attention(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    from mixserve.kernels import varlen_attention as va

    num_blocks, block_size, kv_heads, head_dim, q_heads = 24, 16, 2, 64, 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    # A decode at context 100, a 37-token chunk resuming at position 20, a whole 21-token prompt.
    query_lens, seq_lens = [1, 37, 21], [100, 57, 21]
    q = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:21].view(3, 7).to(device)  # scattered pages
    query_start = torch.tensor([0, 1, 38, 59], device=device)
    lens = torch.tensor(seq_lens, device=device)
    want = va.paged_varlen_attention_ref(q, k_cache, v_cache, tables, lens, query_start)
    block_m = va.default_block_m(q_heads // kv_heads)  # the variant serving compiles for this group
    tile_seq, tile_start = (torch.tensor(t, device=device) for t in va.build_tiles(query_lens, block_m))
    got = va.paged_varlen_attention(q, k_cache, v_cache, tables, lens, query_start, tile_seq, tile_start,
                                    block_m)
    _close("paged_varlen_attention", got, want, dtype)


CHECKS: list[Callable[[torch.device, torch.dtype, torch.Generator], None]] = [
    _check_norms, _check_activation, _check_rope, _check_paged_attention, _check_varlen_attention,
]


def self_check(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Run every kernel once on `device` in `dtype` against its reference: None when all agree, else
    one line naming the first kernel that failed to build, run or agree."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    for check in CHECKS:
        try:
            with torch.inference_mode():
                check(device, dtype, gen)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - any failure (compile, launch, mismatch) turns the kernels off
            message = " ".join(str(e).split())[:300]
            return f"{check.__name__.removeprefix('_check_')}: {type(e).__name__}: {message}"
    return None


def check_or_disable(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """On a device where the kernels would run, self_check them; on failure warn once and turn them off
    (set_enabled(False)) so the eager PyTorch ops run. Returns the failure, or None."""
    import warnings

    from mixserve import kernels

    device = torch.device(device)
    if not kernels.use_triton(torch.empty(0, device=device)):
        return None
    reason = self_check(device, dtype)
    if reason is not None:
        kernels.set_enabled(False)
        warnings.warn(f"Triton kernels turned off, eager PyTorch ops run instead: {reason}", RuntimeWarning,
                      stacklevel=2)
    return reason
