"""Stop conditions and streamed text, on a toy tokenizer whose tokens are fixed strings."""

from __future__ import annotations

import pytest

from mixserve import SamplingParams
from mixserve.core.request import Request
from mixserve.engine.request_state import RequestState

PIECES = ["<eos>", "Hel", "lo", " wor", "ld", "!", "\n", "ab", "c", "\xe2", "\x82\xac"]
EOS = 0


class PieceTokenizer:
    """Token i is PIECES[i]; two tokens together spell "€" (a UTF-8 character split across tokens)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raw = "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))
        return raw.encode("latin-1").decode("utf-8", errors="replace")


def run(tokens: list[int], **params) -> tuple[list[str], RequestState, str | None]:
    """Feed `tokens` one step at a time (appended to the record, as the scheduler does); returns the
    streamed deltas, the state, and the finish reason."""
    record = Request("r", [1], prompt_len=1, max_tokens=len(tokens))
    state = RequestState(record, SamplingParams(max_tokens=len(tokens), **params), PieceTokenizer(),
                         frozenset({EOS}), arrival=0.0)
    deltas, reason = [], None
    for step, t in enumerate(tokens, 1):
        record.tokens.append(t)
        reason = state.take(None, float(step))
        if reason is None and step == len(tokens):
            reason = "length"
        deltas.append(state.update(reason, float(step)).new_text)
        if reason is not None:
            break
    return deltas, state, reason


def test_plain_text_streams_token_by_token() -> None:
    deltas, state, reason = run([1, 2, 3, 4])
    assert deltas == ["Hel", "lo", " wor", "ld"] and reason == "length"
    assert state.output().text == "Hello world"


def test_stop_string_across_token_boundaries_ends_the_text_before_it() -> None:
    deltas, state, reason = run([1, 2, 3, 4, 5], stop=["lo wo"])
    out = state.output()
    assert reason == "stop" and out.text == "Hel"
    assert "".join(deltas) == "Hel"  # "lo" was held back: it could have been (and was) the stop's start
    assert out.token_ids == [1, 2, 3]  # the tokens generated up to the stop are kept


def test_held_back_text_is_released_when_the_stop_does_not_complete() -> None:
    deltas, _, reason = run([1, 2, 5, 4], stop=["lo wo"])
    assert reason == "length" and deltas == ["He", "l", "lo!", "ld"]  # "l", then "lo", could begin "lo wo"


def test_earliest_of_several_stop_strings_wins() -> None:
    _, state, _ = run([7, 8, 1, 2, 6], stop=["\n", "cHe"])
    assert state.output().text == "ab"


def test_eos_stops_unless_ignored_and_stop_token_ids() -> None:
    _, state, reason = run([1, EOS, 2])
    assert reason == "stop" and state.output().token_ids == [1, EOS] and state.output().text == "Hel"
    _, state, reason = run([1, EOS, 2], ignore_eos=True)
    assert reason == "length" and state.output().text == "Hello"
    _, state, reason = run([1, 2, 5, 3], stop_token_ids=[5])
    assert reason == "stop" and state.output().token_ids == [1, 2, 5] and state.output().text == "Hello"


def test_split_utf8_character_waits_for_its_second_token() -> None:
    deltas, state, _ = run([1, 9, 10, 5])
    assert deltas == ["Hel", "", "€", "!"] and state.output().text == "Hel€!"


def test_metrics_record_every_token_time() -> None:
    _, state, _ = run([1, 2, 3])
    m = state.output().metrics
    assert (m.arrival, m.first_token, m.token_times, m.finished) == (0.0, 1.0, (1.0, 2.0, 3.0), 3.0)
    assert m.ttft == 1.0 and m.tpot == 1.0


def test_a_request_ending_inside_a_character_keeps_its_bytes_as_replacement() -> None:
    deltas, state, reason = run([1, 9])
    assert reason == "length" and deltas == ["Hel", "\ufffd"] and state.output().text == "Hel\ufffd"


def test_the_state_reads_its_tokens_from_the_schedulers_record() -> None:
    record = Request("r", [1], prompt_len=1, max_tokens=4)
    state = RequestState(record, SamplingParams(max_tokens=4), PieceTokenizer(), frozenset({EOS}), 0.0)
    with pytest.raises(IndexError):  # nothing appended to the record: nothing to take
        state.take(None, 1.0)
    record.tokens += [1, 2]  # the scheduler appended two tokens: the state takes them in order
    assert (state.take(None, 1.0), state.take(None, 2.0)) == (None, None)
    update = state.update(None, 2.0)
    assert update.new_token_ids == [1, 2] == state.token_ids and update.new_text == "Hello"
    assert state.prompt_token_ids == [1] and state.output().token_ids == record.tokens[1:]
