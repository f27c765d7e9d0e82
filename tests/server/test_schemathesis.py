"""schemathesis over /openapi.json against a live `mixserve serve` on a tiny random model: never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.modes import GenerationMode

from tests.server.conftest import start_server

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# never a 5xx, and the schema says what the server does: its statuses, content types and bodies, and every
# request the schema forbids refused with a 4xx
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def app_schema(tiny_model_dir, tmp_path_factory) -> Iterator[schemathesis.schemas.BaseSchema]:
    # a short context keeps every generated request small (max_tokens can only be what fits)
    log = tmp_path_factory.mktemp("schemathesis") / "stderr.log"
    server = start_server(tiny_model_dir, log, "--num-blocks", "32", "--max-model-len", "32",
                          "--max-waiting", "64")
    try:
        yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    finally:
        server.stop()


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
            case.call_and_validate(checks=CHECKS)

        check()
