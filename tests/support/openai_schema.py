"""OpenAI's published schemas (tests/data/openai_spec.json, from openai/openai-openapi; regenerate with
tests/support/openai_spec_extract.py) as a test harness: validators for response bodies and SSE chunks, and a
schemathesis schema over those request schemas that generates requests as OpenAI's spec defines them.

OpenAPI 3.1's `nullable: true` (still in OpenAI's file beside `type: "null"`) is read as "or null". Where the
spec and OpenAI's API disagree, the API's behaviour is written in, one named function each."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SPEC_FILE = Path(__file__).resolve().parents[1] / "data" / "openai_spec.json"
_REF = "#/components/schemas/"

# The endpoints as OpenAI documents them (under /v1), with the schemas of their bodies.
OPERATIONS = {
    ("POST", "/v1/chat/completions"): ("CreateChatCompletionRequest", "CreateChatCompletionResponse"),
    ("POST", "/v1/completions"): ("CreateCompletionRequest", "CreateCompletionResponse"),
    ("GET", "/v1/models"): (None, "ListModelsResponse"),
}
STREAM_CHUNK = {
    "/v1/chat/completions": "CreateChatCompletionStreamResponse",
    # The spec gives no chunk schema for completions: its stream is CreateCompletionResponse, whose
    # finish_reason is not nullable, while OpenAI's API sends null until a choice's last chunk. The one
    # difference is made here (see _completion_chunk).
    "/v1/completions": "CompletionStreamChunk",
}


@cache
def spec() -> dict[str, Any]:
    return json.loads(SPEC_FILE.read_text())


def source_commit() -> str:
    return spec()["source"]["commit"]


def _nullable_to_null(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_to_null(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_to_null(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _defs() -> dict[str, Any]:
    text = json.dumps(spec()["schemas"]).replace(_REF, "#/$defs/")
    defs = _nullable_to_null(json.loads(text))
    _echo_first_token_null(defs["CreateCompletionResponse"])
    defs["CompletionStreamChunk"] = _completion_chunk(defs["CreateCompletionResponse"])
    return defs


def _echo_first_token_null(response: dict[str, Any]) -> None:
    """With `echo`, OpenAI's API gives the prompt's first token a null logprob and null alternatives (nothing
    precedes it); the spec's arrays of numbers and objects say otherwise. Only that one entry may be null."""
    logprobs = response["properties"]["choices"]["items"]["properties"]["logprobs"]["anyOf"][0]
    for key in ("token_logprobs", "top_logprobs"):
        array = logprobs["properties"][key]
        array["prefixItems"] = [{"anyOf": [array["items"], {"type": "null"}]}]


def _completion_chunk(response: dict[str, Any]) -> dict[str, Any]:
    chunk = copy.deepcopy(response)
    choice = chunk["properties"]["choices"]["items"]
    choice["properties"]["finish_reason"] = {
        "anyOf": [choice["properties"]["finish_reason"], {"type": "null"}]
    }
    return chunk


@cache
def validator(name: str) -> jsonschema.protocols.Validator:
    """A Draft 2020-12 validator of OpenAI's schema `name`, its references resolved within the file."""
    root = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": _defs(),
        "$ref": f"#/$defs/{name}",
    }
    return jsonschema.Draft202012Validator(
        root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def schema_errors(name: str, body: Any) -> list[str]:
    """Every way `body` breaks OpenAI's schema `name`, as "path: message" lines (empty: it conforms)."""
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {_brief(e)}" for e in errors]


def _brief(e: jsonschema.ValidationError) -> str:
    """anyOf/oneOf failures name the branch error that got deepest, not the whole union."""
    if e.context:
        deepest = max(e.context, key=lambda c: len(c.absolute_path))
        return f"{deepest.message} (at {'/'.join(map(str, deepest.absolute_path))})"
    return e.message


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, up to (not including) `[DONE]`."""
    out = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            out.append(json.loads(data))
    return out


def _closed(schemas: dict[str, Any]) -> dict[str, Any]:
    """Request schemas for generation: OpenAI's objects leave additionalProperties open, but OpenAI refuses
    unknown parameters, so a generated key outside the declared ones tests nothing. `allOf`s of objects are
    merged first (closing each part would forbid the other parts' keys)."""

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        return resolve(schemas[ref[len(_REF) :]]) if isinstance(ref, str) else node

    def merge(node: dict[str, Any]) -> dict[str, Any] | None:
        parts = [close(resolve(p)) for p in node["allOf"]]
        if not all(p.get("type") == "object" or "properties" in p for p in parts):
            return None
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for p in parts:
            merged["properties"].update(p.get("properties", {}))
            merged["required"] += [r for r in p.get("required", []) if r not in merged["required"]]
        merged["additionalProperties"] = False
        return merged

    def close(node: Any) -> Any:
        if isinstance(node, list):
            return [close(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "allOf" in node and (merged := merge(node)) is not None:
            return merged
        out = {k: close(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return {name: close(schema) for name, schema in schemas.items()}


def openapi_document() -> dict[str, Any]:
    """A minimal OpenAPI 3.1 document of our OpenAI endpoints with OpenAI's schemas (objects closed, see
    `_closed`), for schemathesis to generate requests from."""
    paths: dict[str, Any] = {}
    for (method, path), (request, response) in OPERATIONS.items():
        op: dict[str, Any] = {
            "operationId": f"{method.lower()}{path.replace('/', '_')}",
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": {"$ref": _REF + response}}},
                }
            },
        }
        if request:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF + request}}},
            }
        paths.setdefault(path, {})[method.lower()] = op
    schemas = _closed(copy.deepcopy(spec()["schemas"]))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"OpenAI (openai/openai-openapi@{source_commit()[:12]}), our endpoints",
            "version": "1",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
