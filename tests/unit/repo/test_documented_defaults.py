"""What the docs say a request gets without `max_tokens` is what `kubesgl up` gives it: the demo's cap is one
constant (launcher.DEMO_DEFAULT_MAX_TOKENS, which tests/e2e/test_launcher.py serves), and every place that
tells a user the default names it and the scheduler flag behind it."""

from __future__ import annotations

from pathlib import Path

from kubesgl.launcher import DEMO_DEFAULT_MAX_TOKENS

REPO = Path(__file__).resolve().parents[3]


def _row(doc: str, field: str, after: str) -> str:
    """The table row of `field` in the first table after the heading `after`."""
    text = (REPO / doc).read_text()
    section = text[text.index(after) :]
    return next(line for line in section.splitlines() if line.startswith(f"| {field} |"))


def test_the_api_doc_states_the_default_max_tokens_kubesgl_up_applies() -> None:
    rows = [
        _row("docs/openai-api.md", "`max_completion_tokens`, `max_tokens`", "## POST /v1/chat/completions"),
        _row("docs/openai-api.md", "`max_tokens`", "## POST /v1/completions"),
    ]
    for row in rows:
        assert "--default-max-tokens" in row, row
        assert str(DEMO_DEFAULT_MAX_TOKENS) in row, row
        assert "the rest of the context" in row, row  # what a real model gets with the flag unset


def test_the_readme_states_the_demo_cap() -> None:
    readme = (REPO / "README.md").read_text()
    assert f"without `max_tokens` at most {DEMO_DEFAULT_MAX_TOKENS} tokens" in " ".join(readme.split())
