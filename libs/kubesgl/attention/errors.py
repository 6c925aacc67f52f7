"""Errors raised when an attention backend is asked for but cannot be built here."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """The backend exists but its package or device is missing (e.g. flashinfer on a CPU machine)."""
