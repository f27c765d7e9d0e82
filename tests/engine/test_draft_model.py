"""A draft model proposes the drafts (`speculative` = its path): output the one without speculation, and
with the target itself as its draft every draft is kept, which holds only if the draft's K/V, written
through the target's block tables, is right at every position it reads (chunks, preemption, caching)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from mixserve import SamplingParams
from mixserve.core.draft_gate import DraftGate
from mixserve.engine.sampling_params import StructuredOutput
from tests.tiny_model import make_tiny_llama


@pytest.fixture(autouse=True)
def drafts_always_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """What drafts do, not when the timed gate lets them run."""
    monkeypatch.setattr(DraftGate, "allows", lambda self, num_decodes, chunks=False: True)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny random Llama with the same tokenizer: its drafts are mostly wrong."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=1)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def greedy(max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def counts(llm: Any) -> tuple[int, int]:
    s = llm.engine.stats().scheduler
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def run(make_llm, draft: str, ps: list, params: Any, **options: Any) -> tuple[list, list, Any]:
    off = make_llm(**options).generate(ps, params, use_tqdm=False)
    llm = make_llm(speculative=draft, **options)
    return off, llm.generate(ps, params, use_tqdm=False), llm


@pytest.mark.parametrize(("chunk", "caching"), [(0, False), (16, False), (8, True)])
def test_the_target_as_its_own_draft_has_every_draft_kept(make_llm, tiny_model_dir, chunk, caching):
    ps = prompts(6)
    ps += [ps[0] + [7, 8, 9]]  # with caching: a prompt that begins where another did
    off, on, llm = run(make_llm, str(tiny_model_dir), ps, greedy(), prefill_chunk=chunk,
                       max_batch_tokens=64, enable_prefix_caching=caching)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    drafted, accepted = counts(llm)
    assert drafted > 100 and accepted == drafted
    assert llm.engine.stats().kv_cache_usage == 0


def test_preempted_requests_draft_from_a_fresh_start(make_llm, tiny_model_dir):
    opts = dict(num_blocks=24, prefill_chunk=8, max_batch_tokens=32)  # never all six at once
    off, on, llm = run(make_llm, str(tiny_model_dir), prompts(6, seed=1), greedy(), **opts)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert llm.engine.stats().num_preemptions_total > 0
    drafted, accepted = counts(llm)
    assert drafted > 0 and accepted == drafted


def test_another_draft_gives_the_output_without_speculation(make_llm, other_draft):
    off, on, llm = run(make_llm, str(other_draft), prompts(6, seed=2), greedy(40), prefill_chunk=16)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    drafted, accepted = counts(llm)
    assert drafted > accepted  # a different model: some drafts rejected, and the output still exact


def test_max_tokens_and_stops_are_exact(make_llm, tiny_model_dir):
    for max_tokens in (1, 2, 5, 9):
        off, on, _ = run(make_llm, str(tiny_model_dir), prompts(4, seed=3), greedy(max_tokens))
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert all(len(o.token_ids) == max_tokens for o in on)
    eos = SamplingParams(max_tokens=40, temperature=0.0)
    off, on, _ = run(make_llm, str(tiny_model_dir), prompts(4, seed=4), eos)
    assert [(o.token_ids, o.finish_reason) for o in on] == [(o.token_ids, o.finish_reason) for o in off]


def test_sampled_with_a_draft_repeats_with_its_seed(make_llm, other_draft):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = make_llm(speculative=str(other_draft))
        runs.append([o.token_ids for o in llm.generate(prompts(3, seed=5), params, use_tqdm=False)])
        assert counts(llm)[0] > 0
    assert runs[0] == runs[1] and all(len(t) == 30 for t in runs[0])


def test_under_a_grammar(make_llm, tiny_model_dir):
    pytest.importorskip("xgrammar")
    regex = StructuredOutput("regex", "(ab){6}")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=regex)
    off, on, llm = run(make_llm, str(tiny_model_dir), prompts(2, seed=6), params)
    assert [o.text for o in on] == [o.text for o in off] == ["ab" * 6] * 2
    assert counts(llm)[0] > 0


def test_a_bad_draft_is_refused_in_one_line_naming_speculative(make_llm, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^speculative: .*does not exist") as e:
        make_llm(speculative=str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^speculative: cannot load the draft model") as e:
        make_llm(speculative=str(tmp_path / "empty"))
    assert "\n" not in str(e.value)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tiny_model_dir, other)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match=r"^speculative: .*another tokenizer"):
        make_llm(speculative=str(other))
