"""Helpers shared by the tests (tests/layout.toml lists them)."""
