"""Fuzzing the gateway of a live stack with schemathesis: bodies, query and path parameters generated from the
gateway's own /openapi.json (valid and invalid ones) for every operation. No response may be a 5xx, and every
refusal carries OpenAI's error body. `model` is pinned to the served model so that valid requests really reach
the scheduler; token budgets are capped so that they finish quickly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from hypothesis import HealthCheck, given, settings
from kubesgl.launcher import Stack
from schemathesis import GenerationMode

pytestmark = pytest.mark.timeout(300)

MODEL = "demo"
EXAMPLES_PER_OPERATION = 150  # 4 operations take generated input: several hundred requests in all
TOKEN_CAP = 4


@pytest.fixture(scope="module")
def served(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A short context, so a generated prompt or budget beyond it is a 400, not a long generation.
    args = (*TEST_SCHEDULER_ARGS, "--context-length", "256")
    stack = stack_factory(tmp_path_factory.mktemp("fuzz"), scheduler_args=args)
    yield stack
    stack.stop(timeout_s=10)


def _cap(fields: dict[str, Any], key: str, cap: int) -> None:
    """Lowers an integer field above `cap` (or a missing one) to `cap`; other values stay as generated."""
    value = fields.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > cap):
        fields[key] = cap


def pin(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    if "model" in body:
        body["model"] = MODEL
    if "messages" in body or "prompt" in body:
        _cap(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", TOKEN_CAP)
        _cap(body, "n", 2)
    if isinstance(body.get("sampling_params"), dict):
        _cap(body["sampling_params"], "max_new_tokens", TOKEN_CAP)
    return body


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
        ("GET", "/v1/models/{model}"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/ready"),
        ("GET", "/metrics"),
    ],
)
def test_no_generated_request_gets_a_server_error(served: Stack, method: str, path: str) -> None:
    schema = schemathesis.openapi.from_url(f"{served.gateway_urls[0]}/openapi.json")
    operation = schema[path][method]

    statuses: Counter[int] = Counter()
    # Valid requests (which reach the model) and invalid ones (which the gateway must refuse cleanly).
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case: Any) -> None:
        case.body = pin(case.body)
        response = case.call(timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text

    call()
    print(f"{method} {path}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    if path.startswith("/v1/") and method == "POST":
        # The pinned model lets valid requests through to the scheduler. (/generate's schema leaves sampling
        # values unconstrained, so its generated requests are nearly all refusals.)
        assert statuses[200] > 0, statuses
