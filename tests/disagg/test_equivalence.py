"""Greedy outputs through a prefill engine plus a decode engine equal one `both` engine's, token for token,
with chunked and whole prompts, and the decode side waits (never drops) when its blocks run short."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mixserve.disagg.kv_blocks import num_full_blocks
from mixserve.engine.llm_engine import LLMEngine, RequestError
from mixserve.engine.sampling_params import SamplingParams
from tests.disagg.conftest import BLOCK_SIZE, DEADLINE_S, drive, options, run_both, run_pair, tiny_runner

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# lengths around block boundaries: 3 has no full block to hand over (served locally), 16 and 17 end on
# and just past a block, 61 spans several chunks
LENGTHS = [3, 9, 16, 17, 30, 61]


def prompts(lengths: list[int], salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * n + 31 * k + salt) % 300 + 5 for i in range(n)] for k, n in enumerate(lengths)]


@pytest.mark.parametrize("chunk", [8, 0], ids=["chunked", "whole"])
def test_greedy_outputs_equal_one_both_engine(make_pair, tiny_model_dir: Path, chunk: int):
    cfg = options(num_blocks=256, prefill_chunk=chunk, max_batch_tokens=64 if chunk == 0 else 32)
    batch = prompts(LENGTHS)
    both = run_both(LLMEngine(tiny_runner(tiny_model_dir, 256), cfg), batch, GREEDY)
    prefill, decode = make_pair(cfg, cfg)
    paired = run_pair(prefill, decode, batch, GREEDY)
    assert paired == both
    handed_over = sum(num_full_blocks(n, BLOCK_SIZE) > 0 for n in LENGTHS)
    assert decode.num_imported == prefill.num_shipped == handed_over  # the KV really crossed the link
    assert decode.num_local == len(LENGTHS) - handed_over and decode.num_fallbacks == 0
    assert decode.pool.num_held() == 0  # every hold and every request's blocks given back
    decode.pool.check()


def test_seeded_sampling_equals_one_both_engine(make_pair, tiny_model_dir: Path):
    cfg = options(num_blocks=256, prefill_chunk=8, max_batch_tokens=32)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    batch = prompts([21, 40], salt=3)
    both = run_both(LLMEngine(tiny_runner(tiny_model_dir, 256), cfg), batch, params)
    prefill, decode = make_pair(cfg, cfg)
    assert run_pair(prefill, decode, batch, params) == both


def test_the_decode_side_waits_for_free_blocks_and_drops_nothing(make_pair, tiny_model_dir: Path):
    # 16 blocks of 4 on the decode side: once A (40-token prompt, 9 full blocks) is imported, 7 are free,
    # and B's 9 (+1 for its tail) cannot come in until A (growing to 15 blocks) has finished
    long_out = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    batch = prompts([40, 40], salt=9)
    big, small = options(num_blocks=256, prefill_chunk=8), options(num_blocks=16, prefill_chunk=8)
    expected = run_both(LLMEngine(tiny_runner(tiny_model_dir, 16), small), batch, long_out)
    prefill, decode = make_pair(big, small)
    seen_waiting = []

    def watch() -> None:
        waiting = [r for r in decode._remote.values() if r.payload is not None]
        if waiting:  # arrived, not imported (this step's end may have freed blocks for the next one)
            seen_waiting.append((decode.pool.num_free() < waiting[0].num_blocks + 1,
                                 decode.stats().scheduler.num_requests_waiting))

    got = run_pair(prefill, decode, batch, long_out, on_step=watch)
    assert got == expected
    assert sum(short for short, _ in seen_waiting) >= 3  # it waited several steps for blocks
    assert all(n >= 1 for _, n in seen_waiting)  # counted as waiting meanwhile
    assert decode.num_imported == 2 and decode.num_fallbacks == 0


def test_prompts_under_kv_peer_min_tokens_are_prefilled_on_the_decode_side(make_pair, tiny_model_dir: Path):
    cfg = options(num_blocks=256, prefill_chunk=8, max_batch_tokens=32)
    batch = prompts([9, 17, 30, 61], salt=5)
    both = run_both(LLMEngine(tiny_runner(tiny_model_dir, 256), cfg), batch, GREEDY)
    prefill, decode = make_pair(cfg, cfg, min_tokens=20)
    assert run_pair(prefill, decode, batch, GREEDY) == both
    assert decode.num_local == 2 and decode.num_imported == prefill.num_shipped == 2


def test_an_id_in_use_is_refused_before_it_goes_out(make_pair):
    cfg = options(num_blocks=256, prefill_chunk=8)
    _, decode = make_pair(cfg, cfg)
    decode.add_request("a", prompts([3])[0], GREEDY)  # no full block: admitted here at once
    decode.add_request("b", prompts([30])[0], GREEDY)  # out at the prefill instance
    for rid in ("a", "b"):
        with pytest.raises(RequestError, match="already in use"):
            decode.add_request(rid, prompts([30], salt=1)[0], GREEDY)


def test_a_refused_prompt_is_prefilled_on_the_decode_side(make_pair, tiny_model_dir: Path):
    # the prefill side's KV cache (8 blocks of 4) cannot hold the 61-token prompt: it refuses, and the
    # decode side computes it itself; the 17-token one still goes through the prefill side
    cfg = options(num_blocks=256, prefill_chunk=8)
    batch = prompts([61, 17], salt=2)
    both = run_both(LLMEngine(tiny_runner(tiny_model_dir, 256), cfg), batch, GREEDY)
    prefill, decode = make_pair(options(num_blocks=8, prefill_chunk=8), cfg)
    assert run_pair(prefill, decode, batch, GREEDY) == both
    assert decode.num_fallbacks == 1 and decode.num_imported == prefill.num_shipped == 1


def test_a_prompt_whose_kv_is_late_is_prefilled_on_the_decode_side(make_pair, tiny_model_dir: Path):
    cfg = options(num_blocks=256, prefill_chunk=8)
    batch = prompts([30], salt=4)
    both = run_both(LLMEngine(tiny_runner(tiny_model_dir, 256), cfg), batch, GREEDY)
    prefill, decode = make_pair(cfg, cfg, timeout_s=0.2)
    # the prefill engine is never stepped (a peer alive but stuck): only the decode side runs
    decode.add_request("r0", batch[0], GREEDY)
    assert drive([decode], decode, 1) == both
    assert decode.num_fallbacks == 1 and decode.num_imported == 0


def test_an_import_waiting_behind_others_holds_no_blocks_past_its_step(make_pair, tiny_model_dir: Path):
    # 16 blocks of 4, whole prompts. X (3 tokens, no full block: served here) grows to 13 blocks; then A's
    # KV (2 blocks) is imported into 2 of the 3 free ones, and X's next decode takes the third, so A waits.
    # X later preempts itself for block 15 and, restarting whole, needs 15 of the 16: had A kept its hold
    # until admission, X could never restart and A (behind it) never start, both unfinished forever.
    whole = options(num_blocks=16, prefill_chunk=0, max_batch_tokens=64)
    params = [SamplingParams(max_tokens=58, temperature=0, ignore_eos=True), GREEDY]
    batch = [[5, 6, 7], prompts([9], salt=6)[0]]
    both = LLMEngine(tiny_runner(tiny_model_dir, 256), options(num_blocks=256, prefill_chunk=0))
    for i, (p, sp) in enumerate(zip(batch, params, strict=True)):
        both.add_request(f"r{i}", p, sp)
    expected = drive([both], both, 2)
    prefill, decode = make_pair(options(num_blocks=256, prefill_chunk=0), whole)
    decode.add_request("r0", batch[0], params[0])
    while len(decode.scheduler.request("r0").tokens) < 53:  # X holds 13 blocks: 3 free
        decode.step()
    decode.add_request("r1", batch[1], params[1])
    deadline = time.monotonic() + DEADLINE_S
    while not decode._arrivals:  # A's KV on its way back (the link's receiver thread delivers it)
        assert time.monotonic() < deadline, "A's KV never came back"
        if prefill.has_unfinished():
            prefill.step()
        time.sleep(0.001)
    done: dict[str, list[int]] = {}
    for _ in range(200):  # a few dozen steps suffice; a deadlock steps forever
        for u in decode.step():
            if u.finished:
                done[u.request_id] = list(u.output.token_ids)
        if len(done) == 2:
            break
    assert done == expected
    assert decode.num_imported == 1 and decode.pool.num_held() == 0
    decode.pool.check()


def test_kv_arriving_for_an_aborted_prompt_leaves_nothing_unfinished(make_pair):
    # after a failed step the async engine aborts every request and restarts only if nothing is left
    # unfinished: KV that comes back for a prompt aborted meanwhile must not count as work
    cfg = options(num_blocks=256, prefill_chunk=8)
    prefill, decode = make_pair(cfg, cfg)
    decode.add_request("r0", prompts([30], salt=7)[0], GREEDY)
    deadline = time.monotonic() + DEADLINE_S
    while not decode._arrivals:  # its KV on the way back, not yet taken by a step
        assert time.monotonic() < deadline, "the KV never came back"
        if prefill.has_unfinished():
            prefill.step()
        time.sleep(0.001)
    assert decode.has_unfinished()
    decode.abort("r0")
    assert decode._arrivals and not decode.has_unfinished()
