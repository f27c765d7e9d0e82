"""Prefix caching on the tiny model: greedy tokens and logits are those of caching off (and of HF's
forward, within 2e-3) for prefixes shared up to every block boundary, chunk sizes 1, 7 and 64, forced
preemption and aborts; the shared blocks really are skipped (hits counted, fewer prefill tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mixserve import SamplingParams
from mixserve.core import Chunked, Scheduler, SchedulerConfig, plan
from tests.engine.conftest import TINY_BLOCK_SIZE as BS
from tests.runner.drive import max_rel_error
from tests.runner.test_tiny_vs_hf import TOL, hf_logits

Rows = dict[str, list[tuple[int, torch.Tensor]]]


def prompts_sharing(shared: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(shared)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 5, 9)]


def drive(runner: Any, caching: bool, chunk: int, arrivals: dict[int, list[tuple[str, list[int], int]]],
          *, num_blocks: int = 128, aborts: dict[int, str] | None = None) -> tuple[Scheduler, Rows, int]:
    """The real runner under the scheduler, greedily: every sampled logits row by request, prefill tokens."""
    cfg = SchedulerConfig(64, 8, BS, num_blocks, enable_prefix_caching=caching)
    s = Scheduler(cfg).with_prefill_policy(Chunked(chunk))
    rows: Rows = {}
    prefill = 0
    step = 0
    while step <= max(arrivals) or s.has_unfinished():
        for rid, prompt, max_tokens in arrivals.get(step, []):
            s.add_request(rid, prompt, max_tokens)
            rows[rid] = []
        if aborts and step in aborts:
            s.abort(aborts[step])
            del rows[aborts[step]]
        step += 1
        out = s.schedule()
        if out.num_tokens == 0:
            continue
        p = plan(s, out)
        logits = runner.forward(p.batch)
        sampled = {}
        for i, rid in p.sample:
            seq = p.batch.seqs[i]
            rows[rid].append((seq.start + len(seq.tokens) - 1, logits[i].clone()))
            sampled[rid] = int(logits[i].argmax())
        s.update(out, sampled)
        prefill += sum(c.length for c in out.chunks)
    return s, rows, prefill


@pytest.fixture(scope="module")
def hf_refs(tiny_model_dir: Path):
    """HF's logits for full token lists, memoized (one model load for the module)."""
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def ref(tokens: list[int]) -> torch.Tensor:
        if tuple(tokens) not in memo:
            memo[tuple(tokens)] = hf_logits(tiny_model_dir, [tokens])[0]
        return memo[tuple(tokens)]

    return ref


def check_same(runner: Any, hf_refs: Any, on: tuple[Scheduler, Rows, int], off: tuple[Scheduler, Rows, int],
               prompts: dict[str, list[int]]) -> None:
    (_, rows_on, _), (_, rows_off, _) = on, off
    assert rows_on.keys() == rows_off.keys()
    for rid, rows in rows_on.items():
        tokens_on = [int(r.argmax()) for _, r in rows]
        assert tokens_on == [int(r.argmax()) for _, r in rows_off[rid]], rid
        full = prompts[rid] + tokens_on[:-1]
        assert max_rel_error(rows, hf_refs(full)) < TOL, rid
        for (pos_on, r_on), (pos_off, r_off) in zip(rows, rows_off[rid], strict=True):
            assert pos_on == pos_off
            assert float((r_on - r_off).abs().max() / r_off.abs().max()) < TOL, rid


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("shared", [0, 1, BS - 1, BS, BS + 1])
def test_shared_prefixes_give_the_outputs_of_caching_off(tiny_runner: Any, hf_refs: Any, chunk: int,
                                                         shared: int) -> None:
    a, b, _ = prompts_sharing(shared, tiny_runner.config.vocab_size)  # a and b share `shared` tokens
    # b arrives while a decodes (a's blocks held by both); c, a's very prompt, once a and b are done (a's
    # blocks cached, held by nobody): all of c but its last block comes from the cache
    arrivals = {0: [("a", a, 4)], len(a) // chunk + 2: [("b", b, 4)], 60: [("c", a, 3)]}
    on = drive(tiny_runner, True, chunk, arrivals)
    off = drive(tiny_runner, False, chunk, arrivals)
    check_same(tiny_runner, hf_refs, on, off, {"a": a, "b": b, "c": a})
    hits = shared // BS * BS + (len(a) - 1) // BS * BS
    assert on[0].stats().prefix_cache_hits == hits
    assert on[2] == off[2] - hits


def test_forced_preemption_with_caching(tiny_runner: Any, hf_refs: Any) -> None:
    ps = prompts_sharing(2 * BS + 1, tiny_runner.config.vocab_size)
    arrivals = {0: [(f"r{i}", p, 10) for i, p in enumerate(ps)]}
    on = drive(tiny_runner, True, 7, arrivals, num_blocks=12)
    off = drive(tiny_runner, False, 7, arrivals, num_blocks=12)
    check_same(tiny_runner, hf_refs, on, off, {f"r{i}": p for i, p in enumerate(ps)})
    assert on[0].stats().num_preemptions > 0 and on[0].stats().prefix_cache_hits > 0


def test_aborts_with_caching(tiny_runner: Any, hf_refs: Any) -> None:
    a, b, c = prompts_sharing(3 * BS, tiny_runner.config.vocab_size)
    arrivals = {0: [("a", a, 12)], 3: [("b", b, 8), ("c", c, 5)]}
    aborts = {5: "a", 8: "b"}  # a aborted while b and c share its blocks; b mid-generation
    on = drive(tiny_runner, True, 7, arrivals, aborts=aborts)
    off = drive(tiny_runner, False, 7, arrivals, aborts=aborts)
    check_same(tiny_runner, hf_refs, on, off, {"c": c})
    assert on[0].stats().prefix_cache_hits > 0
    on[0].blocks.check()


def test_llm_generate_on_and_off(make_llm) -> None:
    system = list(range(10, 10 + 5 * BS + 2))
    ps = [system + [200 + i, 201 + i, 50] for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    on_llm = make_llm(prefill_chunk=7, max_batch_tokens=16, max_num_seqs=2)
    on = on_llm.generate(ps, params)
    off = make_llm(prefill_chunk=7, max_batch_tokens=16, max_num_seqs=2,
                   enable_prefix_caching=False).generate(ps, params)
    for x, y in zip(on, off, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs is not None and y.logprobs is not None
        for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
            assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4)
    stats = on_llm.engine.stats().scheduler
    # two requests start together and both compute the system prompt; the two after them skip it
    assert stats.prefix_cache_hits == 2 * (len(system) // BS * BS)


@pytest.fixture(scope="module")
def cpu_runner(tiny_model_dir: Path) -> Any:
    """The tiny model on the C++ paged attention kernel (the serve default on a CPU), 4-token blocks."""
    from mixserve.runner.model_runner import ModelRunner

    return ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=128, block_size=BS, device="cpu",
                                       dtype="float32", attention_backend="cpu")


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_the_cpu_kernel_reads_shared_blocks_too(cpu_runner: Any, hf_refs: Any, chunk: int) -> None:
    ps = prompts_sharing(2 * BS + 1, cpu_runner.config.vocab_size)
    arrivals = {0: [("r0", ps[0], 6)], 2: [("r1", ps[1], 6)], 40: [("r2", ps[0], 3), ("r3", ps[2], 3)]}
    on = drive(cpu_runner, True, chunk, arrivals, num_blocks=8)  # tight: preemption under sharing
    off = drive(cpu_runner, False, chunk, arrivals, num_blocks=8)
    check_same(cpu_runner, hf_refs, on, off, {"r0": ps[0], "r1": ps[1], "r2": ps[0], "r3": ps[2]})
    assert on[0].stats().prefix_cache_hits > 0 and on[0].stats().num_preemptions > 0
