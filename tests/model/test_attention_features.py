"""Per-layer attention features (score scale, sliding window, logit softcap) in every CPU-runnable backend,
against attention by its definition: explicit float64 scores, softcap, mask and softmax, written here.

Each case runs steps the way the scheduler sends them: the chunks of one sequence over several steps (each
step's K/V written by the backend, read back by the later ones), decodes beside them, history older than
the case's first step written straight into the cache.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mixserve import kernels
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.attention import get_backend
from mixserve.model.attention.dense_decode import DecodePlan
from mixserve.model.attention.gpu import GpuAttention
from tests.model.test_cpu_attention import bf16_bound, error_past_rounding

BS = 16  # block size: every window below is not a multiple of it
Step = list[tuple[int, int, int]]  # (sequence, start, tokens) for each sequence the step runs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float | None = None,
              window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q (n, Hq, D) at positions start.., k/v (L, Hkv, D) -> (n, Hq, D) float64, by the definition."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    qpos, keys = torch.arange(start, start + q.shape[0]).unsqueeze(1), torch.arange(k.shape[0]).unsqueeze(0)
    hidden = keys > qpos
    if window > 0:
        hidden |= keys <= qpos - window
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def decodes() -> list[Step]:
    # contexts from 1 to 300: shorter and longer than every window, across key tiles, blocks and spans
    return [[(i, c - 1, 1) for i, c in enumerate((1, 6, 17, 33, 64, 100, 131, 300))]]


def even_decodes() -> list[Step]:
    # contexts alike (GpuAttention's dense decode path takes them), two of them inside a window of 37
    return [[(i, c - 1, 1) for i, c in enumerate((30, 53, 90, 101, 118, 130))]]


def verifies() -> list[Step]:
    # decodes verifying 1-7 drafts (queries of 2-8 tokens), last tokens on both sides of windows and spans
    ends = (2, 9, 17, 40, 129, 257, 300)
    return [[(i, c - n, n) for i, (c, n) in enumerate(zip(ends, (2, 8, 3, 5, 8, 2, 4), strict=True))]]


def one_chunk() -> list[Step]:
    return [[(0, 0, 75), (1, 90, 45)]]  # a first chunk, a chunk resuming at position 90


def chunked(size: int) -> list[Step]:
    return [[(0, s, min(size, 150 - s))] for s in range(0, 150, size)]  # a 150-token prompt in chunks


def mixed() -> list[Step]:
    # two prompts in chunks of 23 and 40 (the second resuming at 10), two decodes advancing each step
    steps = []
    for t in range(4):
        step = [(0, 23 * t, 23), (2, 50 + t, 1), (3, 200 + t, 1)]
        steps.append(step + ([(1, 10 + 40 * t, 40)] if t < 3 else []))
    return steps


SCENARIOS = {"decodes": decodes, "even-decodes": even_decodes, "verifies": verifies, "one-chunk": one_chunk,
             **{f"chunks-{n}": functools.partial(chunked, n) for n in (5, 16, 37)}, "mixed": mixed}
# id -> (forward's keywords, how far q is spread): softcap 50 with q spread so that scores pass the cap;
# "scale" here is a factor of head_dim ** -0.5 (check makes it the scale itself)
FEATURES = {
    "defaults": ({}, 1.0),
    "window-7-scale": ({"window": 7, "scale": 0.6}, 1.0),
    "window-20": ({"window": 20}, 1.0),
    "window-1000": ({"window": 1000}, 1.0),  # longer than every context: full attention
    "softcap-50-scale": ({"softcap": 50.0, "scale": 0.6}, 40.0),
    "window-37-softcap-50": ({"window": 37, "softcap": 50.0, "scale": 0.6}, 40.0),
}


def run_case(backend, steps: list[Step], hq: int, hkv: int, d: int, dtype: torch.dtype, features: dict,
             q_scale: float, bs: int = BS, seed: int = 0) -> tuple[float, dict[str, float]]:
    """Runs the steps through `backend`; returns its largest error against the reference past the output's
    own rounding (error_past_rounding), and per keyword how far the reference without it lies."""
    g = torch.Generator().manual_seed(seed)
    lengths: dict[int, int] = {}
    first: dict[int, int] = {}
    for step in steps:
        for s, start, n in step:
            lengths[s] = max(lengths.get(s, 0), start + n)
            first.setdefault(s, start)
    num_blocks = sum(-(-n // bs) for n in lengths.values()) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables = {s: [order.pop() for _ in range(-(-n // bs))] for s, n in lengths.items()}
    data = {s: (torch.randn(n, hq, d, generator=g) * q_scale, torch.randn(n, hkv, d, generator=g),
                torch.randn(n, hkv, d, generator=g)) for s, n in lengths.items()}
    data = {s: tuple(x.to(dtype) for x in qkv) for s, qkv in data.items()}
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)  # garbage where nothing is written
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    for s, start in first.items():  # what earlier steps wrote
        for p in range(start):
            k_cache[tables[s][p // bs], p % bs] = data[s][1][p]
            v_cache[tables[s][p // bs], p % bs] = data[s][2][p]
    worst, spread = 0.0, dict.fromkeys(features, 0.0)
    for step in steps:
        batch = ForwardBatch([ForwardSeq(str(s), [0] * n, start, tables[s]) for s, start, n in step])
        meta = backend.prepare(batch, bs, torch.device("cpu"))
        q, k, v = (torch.cat([data[s][i][start:start + n] for s, start, n in step]) for i in range(3))
        out = backend.forward(q, k, v, k_cache, v_cache, meta, **features)
        begin = 0
        for s, start, n in step:
            qs, ks, vs = data[s][0][start:start + n], data[s][1][:start + n], data[s][2][:start + n]
            want = reference(qs, ks, vs, start, **features)
            worst = max(worst, error_past_rounding(out[begin:begin + n], want))
            for key in features:
                without = reference(qs, ks, vs, start, **{k: x for k, x in features.items() if k != key})
                spread[key] = max(spread[key], (without - want).abs().max().item())
            begin += n
    return worst, spread


def bound(name: str, dtype: torch.dtype, d: int, q_scale: float) -> float:
    """float32: float32's own error (2e-5 at q_scale 1, as test_cpu_attention.py), growing with the scores
    it rounds (q spread by 40: scores of up to the cap of 50). bf16 adds the kernel's P.V term (bf16_bound:
    probabilities rounded to bf16 where the build has vdpbf16ps); torch's CPU SDPA rounds them always."""
    fp32 = 2e-5 * max(1.0, q_scale / 8)
    if dtype == torch.float32:
        return fp32
    return fp32 + (bf16_bound(d) - 2e-5 if name == "cpu" else 2 ** -9 * 4.5)


def check(name: str, backend, scenario: str, feature: str, dtype: torch.dtype, hq: int = 8, hkv: int = 2,
          d: int = 64, bs: int = BS) -> None:
    features, q_scale = FEATURES[feature]
    features = {k: x * d ** -0.5 if k == "scale" else x for k, x in features.items()}
    worst, spread = run_case(backend, SCENARIOS[scenario](), hq, hkv, d, dtype, features, q_scale, bs)
    tol = bound(name, dtype, d, q_scale)
    assert worst < tol
    # honest: a backend ignoring any one keyword would miss by far more (a window past every context aside)
    for key, far in spread.items():
        assert far > 10 * tol or feature == "window-1000", key


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CASES = pytest.mark.parametrize(("scenario", "feature"), [(s, f) for s in SCENARIOS for f in FEATURES])


@DTYPES
@CASES
def test_torch_backend_matches_the_definition(scenario: str, feature: str, dtype: torch.dtype) -> None:
    check("torch", get_backend("torch", "cpu"), scenario, feature, dtype)


@DTYPES
@CASES
def test_cpu_kernel_matches_the_definition(kernel_build: str, scenario: str, feature: str,
                                           dtype: torch.dtype) -> None:
    check("cpu", get_backend("cpu", "cpu"), scenario, feature, dtype)


# The kernel's other paths: head dims 16 and 256 (Gemma's: the generic tile loop), 80 (bf16 widened, no
# vdpbf16ps), 128 with a key row of every KV head past the widening buffer (bf16 decodes per KV head without
# vdpbf16ps); no GQA; blocks of 5 (windows cross block edges mid-tile).
@DTYPES
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 1, 16, 16), (8, 4, 256, 16), (6, 2, 80, 16),
                                                    (16, 16, 128, 16), (4, 4, 32, 5)])
@pytest.mark.parametrize("feature", ["window-7-scale", "window-37-softcap-50"])
def test_cpu_kernel_paths_match_the_definition(kernel_build: str, hq: int, hkv: int, d: int, bs: int,
                                               feature: str, dtype: torch.dtype) -> None:
    for scenario in ("mixed", "decodes"):
        check("cpu", get_backend("cpu", "cpu"), scenario, feature, dtype, hq, hkv, d, bs)


@pytest.mark.parametrize("scenario", ["decodes", "even-decodes", "mixed"])
@pytest.mark.parametrize("feature", ["window-7-scale", "window-20", "softcap-50-scale",
                                     "window-37-softcap-50"])
def test_gpu_backend_on_the_cpu_matches_the_definition(scenario: str, feature: str) -> None:
    # no triton on a CPU tensor: even decodes take the dense decode path, the others eager FlexAttention
    backend = GpuAttention()
    first = SCENARIOS[scenario]()[0]
    batch = ForwardBatch([ForwardSeq(str(s), [0] * n, p, [0] * ((p + n) // BS + 1)) for s, p, n in first])
    plan = backend.prepare(batch, BS, torch.device("cpu")).plan
    assert isinstance(plan, DecodePlan) == (scenario == "even-decodes")
    check("gpu", backend, scenario, feature, torch.float32)


@pytest.mark.parametrize("feature", ["window-7-scale", "window-37-softcap-50"])
def test_triton_kernels_in_the_interpreter_match_the_definition(feature: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # paged flash-decoding for the decode-only step, the varlen kernel for the mixed ones (TRITON_INTERPRET)
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    backend = GpuAttention()
    assert [part.name for part in backend.parts(torch.device("cpu"))] == ["triton", "triton"]
    for scenario in ("decodes", "mixed"):
        check("gpu", backend, scenario, feature, torch.float32, hq=4, hkv=2, d=16)


@pytest.mark.parametrize("name", ["torch", "cpu", "gpu"])
def test_a_negative_window_or_softcap_is_a_clear_error(name: str) -> None:
    backend = GpuAttention() if name == "gpu" else get_backend(name, "cpu")
    meta = backend.prepare(ForwardBatch([ForwardSeq("x", [1], 0, [0])]), 4, torch.device("cpu"))
    x, cache = torch.zeros(1, 1, 16), torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="window"):
        backend.forward(x, x, x, cache, cache, meta, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        backend.forward(x, x, x, cache, cache, meta, softcap=-1.0)
