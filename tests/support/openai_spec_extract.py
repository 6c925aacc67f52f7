"""Regenerates tests/data/openai_spec.json: the schemas of OpenAI's published OpenAPI spec
(github.com/openai/openai-openapi, file openapi.json) that our endpoints answer to, with everything they
reference, stripped of prose and examples, and the source commit recorded.

    git clone https://github.com/openai/openai-openapi /tmp/openai-openapi
    python tests/support/openai_spec_extract.py --repo /tmp/openai-openapi
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
)
OUT = Path(__file__).resolve().parents[1] / "data" / "openai_spec.json"
_PREFIX = "#/components/schemas/"
_DROP = {"description", "example", "examples", "title", "deprecated", "discriminator"}


def _strip(node: Any) -> Any:
    """Drops prose, examples and vendor keys from a schema; the keys of a `properties` map are field names
    (a field may well be called "title") and are all kept."""
    if isinstance(node, list):
        return [_strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _DROP or k.startswith("x-"):
            continue
        if k == "properties" and isinstance(v, dict):
            out[k] = {field: _strip(schema) for field, schema in v.items()}
        else:
            out[k] = _strip(v)
    return out


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return out + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def extract(spec: dict[str, Any], commit: str) -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    keep: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        for ref in _refs(schemas[name]):
            if not ref.startswith(_PREFIX):
                raise ValueError(f"{name} references {ref}, outside components/schemas")
            todo.append(ref[len(_PREFIX) :])
    return {
        "source": {
            "repo": "openai/openai-openapi",
            "commit": commit,
            "file": "openapi.json",
            "openapi": spec["openapi"],
            "info_version": spec["info"]["version"],
        },
        "roots": list(ROOTS),
        "schemas": {name: _strip(schemas[name]) for name in sorted(keep)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", required=True, help="a clone of openai/openai-openapi (bare or not)")
    ap.add_argument("--rev", default="HEAD")
    args = ap.parse_args()
    git = ["git", "-C", args.repo]
    commit = subprocess.run(
        [*git, "rev-parse", args.rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    raw = subprocess.run([*git, "show", f"{commit}:openapi.json"], check=True, capture_output=True).stdout
    out = extract(json.loads(raw), commit)
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(out['schemas'])} schemas from openai/openai-openapi@{commit}")


if __name__ == "__main__":
    main()
