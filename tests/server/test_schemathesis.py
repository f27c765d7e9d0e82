"""schemathesis over /openapi.json, in process against the app on a tiny random model: never a 5xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from mixserve.config import EngineConfig, ServerConfig
from mixserve.engine.llm_engine import LLMEngine
from mixserve.runner.model_runner import ModelRunner
from mixserve.server import create_app

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app_schema(tiny_model_dir) -> Iterator[schemathesis.schemas.BaseSchema]:
    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=32)
    # a short context keeps every generated request small (max_tokens can only be what fits)
    llm = LLMEngine(runner, EngineConfig(threads=1, max_model_len=32))
    app = create_app(llm, ServerConfig(max_waiting=64))
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    finally:
        asyncio.run(app.state.mixserve.engine.stop(5.0))
        torch.set_num_threads(threads)


# schemathesis.pytest.from_fixture trips over pytest 9's internals, so the operations are driven here
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_makes_a_server_error(app_schema, mode):
    operations = [result.ok() for result in app_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:
            case.call_and_validate(checks=[not_a_server_error])

        check()
