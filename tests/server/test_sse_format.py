"""The fast SSE delta (Formatter.delta_event) is byte for byte the dict path's `sse(delta_chunk(...))`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixserve.server.openai_format import Formatter, TokenLogprob, Usage, sse


@pytest.mark.parametrize("chat", [False, True])
@settings(max_examples=200, deadline=None)
@given(text=st.text(), index=st.integers(0, 9), request_id=st.text(min_size=1), model=st.text())
def test_text_delta_equals_the_dumped_chunk(chat: bool, text: str, index: int, request_id: str, model: str):
    fmt = Formatter(request_id, model, chat, tokenizer=None)
    fast = fmt.delta_event(text, None, None, None, index)
    assert fast == sse(fmt.delta_chunk(text, None, None, None, index))


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.mark.parametrize("chat", [False, True])
def test_finish_logprobs_and_usage_go_through_the_dict(chat: bool):
    cases = [("x", "stop", None, None), ("", "length", None, None),
             ("y", None, [TokenLogprob(3, -0.5, {3: -0.5, 4: -1.0})], None), ("z", None, None, Usage(7, 2))]
    for text, finish, lps, usage in cases:
        a, b = Formatter("id", "m", chat, _Tok()), Formatter("id", "m", chat, _Tok())
        b.created = a.created
        assert a.delta_event(text, finish, lps, usage, 1) == sse(b.delta_chunk(text, finish, lps, usage, 1))
