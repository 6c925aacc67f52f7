"""kubesgl: Kubernetes-native LLM serving."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kubesgl` stays cheap for the CPU-only services (no torch import).
    if name == "LLM":
        from kubesgl.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kubesgl.values.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
