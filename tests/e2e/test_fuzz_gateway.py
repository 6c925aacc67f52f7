"""Fuzzing the gateway of a live stack with schemathesis: bodies, query and path parameters generated from the
gateway's own /openapi.json (valid and invalid ones) for every operation. No response may be a 5xx, and every
refusal carries OpenAI's error body. `model` is pinned to the served model so that valid requests really reach
the scheduler; token budgets are capped so that they finish quickly.

Under `make test` the examples are derandomized (the same ones on every run, so CI decides the same way each
time); `make fuzz` sets KUBESGL_FUZZ_EXAMPLES and a fresh `--hypothesis-seed` (printed, to replay a failure).
Every case fuzzing ever found is kept in FOUND below and sent on every run."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from hypothesis import HealthCheck, given, settings
from kubesgl.launcher import Stack
from schemathesis import GenerationMode

FUZZING = int(os.environ.get("KUBESGL_FUZZ_EXAMPLES", "0"))  # examples per operation, from `make fuzz`
pytestmark = pytest.mark.timeout(300 + FUZZING)

MODEL = "demo"
# 4 operations take generated input: several hundred requests in all.
EXAMPLES_PER_OPERATION = FUZZING or 150
TOKEN_CAP = 4

# Every request fuzzing has found a server error with, and the status it must get now.
FOUND: list[tuple[str, str, int]] = [
    # msgpack could not encode an integer below int64 in the template kwargs: was a 500.
    (
        "/v1/chat/completions",
        '{"messages":[{"role":"user","content":""}],"model":"demo",'
        '"chat_template_kwargs":{"":-9223372036854775809},"max_tokens":4,"n":2}',
        400,
    ),
]


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
        derandomize=not FUZZING,
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


@pytest.mark.parametrize(("path", "body", "status"), FOUND)
def test_cases_fuzzing_found_stay_fixed(served: Stack, path: str, body: str, status: int) -> None:
    response = httpx.post(
        f"{served.gateway_urls[0]}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_a_body_too_big_for_the_bus_is_413_not_500(served: Stack) -> None:
    # Under the 1 MiB HTTP limit as JSON (4 bytes a float), over NATS' 1 MiB max_payload as msgpack (9 bytes).
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"weights": [0.5] * 180_000},
    }
    raw = json.dumps(body, separators=(",", ":"))
    assert len(raw) < 1 << 20
    response = httpx.post(
        f"{served.gateway_urls[0]}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413, response.text
    assert "message bus" in response.json()["error"]["message"]
