"""Property: requests arriving at random steps, under any budget, chunk and cache size, get exactly the
greedy tokens they get alone; no step exceeds the budget; every block comes back."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixserve import SamplingParams

request = st.tuples(
    st.lists(st.integers(10, 300), min_size=1, max_size=30),  # prompt
    st.integers(1, 8),  # max_tokens
    st.integers(0, 12),  # the step it arrives before
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=1, max_size=6),
    chunk=st.integers(0, 9),
    budget=st.integers(4, 32),
    num_blocks=st.integers(10, 40),
    max_num_seqs=st.integers(1, 4),
)
def test_random_arrivals_match_each_request_alone(
    make_llm, requests, chunk, budget, num_blocks, max_num_seqs
) -> None:
    alone = make_llm(prefill_chunk=0, max_num_seqs=1)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n, _ in requests]
    expected = [alone.generate([p], sp)[0].token_ids for (p, _, _), sp in zip(requests, params, strict=True)]

    engine = make_llm(prefill_chunk=chunk, max_batch_tokens=budget, num_blocks=num_blocks,
                      max_num_seqs=max_num_seqs).engine
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    outputs: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), requests[i][0], params[i])
        updates = engine.step()
        s = engine.stats().scheduler
        whole_alone = chunk == 0 and s.step_decode_tokens == 0  # WholePrompt may run one prompt alone
        assert s.step_tokens <= budget or whole_alone
        outputs.update({u.request_id: u.output.token_ids for u in updates if u.output is not None})
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert [outputs[str(i)] for i in range(len(requests))] == expected
    assert engine.stats().scheduler.num_free_blocks == num_blocks
