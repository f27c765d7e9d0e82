"""A prefill engine and a decode engine joined by a real KV link (gloo on 127.0.0.1) in this process.

Each engine has its own runner (so its own KV cache: nothing reaches the decode side but the link's
tensors), and one thread steps both in turn, which is what two step threads would do, minus the races.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mixserve.config import EngineConfig
from mixserve.disagg.decode_side import DecodeEngine
from mixserve.disagg.kv_blocks import describe
from mixserve.disagg.link import DECODE, PREFILL, KVLink
from mixserve.disagg.prefill_side import PrefillEngine
from mixserve.distributed.group import free_port
from mixserve.engine.llm_engine import LLMEngine
from mixserve.engine.sampling_params import SamplingParams
from mixserve.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
DEADLINE_S = 120.0


def tiny_runner(model: Path | None, num_blocks: int) -> Any:
    return ModelRunner.from_pretrained(str(model) if model else None, num_blocks=num_blocks,
                                       block_size=BLOCK_SIZE, device="cpu", dtype="float32",
                                       attention_backend="torch")


def connect(prefill: PrefillEngine, decode: DecodeEngine, timeout_s: float = 60.0,
            min_tokens: int = 0) -> None:
    """Build both ends of a link (each blocks until the other comes, so one in a thread) and attach."""
    port, links = free_port(), {}

    def end(role: str, engine: LLMEngine) -> None:
        links[role] = KVLink.connect(role, "127.0.0.1", port, describe(engine.runner))

    other = threading.Thread(target=end, args=(PREFILL, prefill))
    other.start()
    end(DECODE, decode)
    other.join()
    prefill.attach(links[PREFILL])
    decode.attach(links[DECODE], timeout_s, min_tokens)


def options(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"threads": 1, "block_size": BLOCK_SIZE, "dtype": "float32", **kw})


def run_pair(prefill: PrefillEngine, decode: DecodeEngine, prompts: list[list[int]],
             params: SamplingParams, on_step: Any = None) -> dict[str, list[int]]:
    """Each prompt through the decode engine; both engines stepped in turn until every one finished."""
    for i, p in enumerate(prompts):
        decode.add_request(f"r{i}", p, params)
    return drive([prefill, decode], decode, len(prompts), on_step)


def run_both(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    return drive([engine], engine, len(prompts))


def drive(engines: list[LLMEngine], front: LLMEngine, count: int,
          on_step: Any = None) -> dict[str, list[int]]:
    """Step every engine that has work (polling with a deadline) until `front` finished `count` requests."""
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(done) < count:
        assert time.monotonic() < deadline, f"only {len(done)} of {count} requests finished"
        for engine in engines:
            if engine.has_unfinished():
                for u in engine.step():
                    if engine is front and u.finished:
                        done[u.request_id] = list(u.output.token_ids)
        if on_step is not None:
            on_step()
        time.sleep(0.001)  # the link's threads deliver meanwhile (polling, not a synchronisation)
    return done


def until(check, within_s: float, what: str) -> float:
    """Poll `check` until true; the seconds it took (AssertionError past `within_s`)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within_s, f"{what} not within {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def make_pair(tiny_model_dir: Path) -> Iterator[Any]:
    """make_pair(prefill_options, decode_options) -> (PrefillEngine, DecodeEngine), closed afterwards."""
    made: list[LLMEngine] = []

    def make(prefill_cfg: EngineConfig, decode_cfg: EngineConfig, timeout_s: float = 60.0,
             default_model: bool = False, min_tokens: int = 0) -> tuple[PrefillEngine, DecodeEngine]:
        model = None if default_model else tiny_model_dir
        prefill = PrefillEngine(tiny_runner(model, prefill_cfg.num_blocks), prefill_cfg)
        decode = DecodeEngine(tiny_runner(model, decode_cfg.num_blocks), decode_cfg)
        connect(prefill, decode, timeout_s, min_tokens)
        made.extend([prefill, decode])
        return prefill, decode

    yield make
    for engine in made:
        engine.close()
