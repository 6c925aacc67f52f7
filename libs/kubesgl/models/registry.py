"""Maps a checkpoint's `architectures` entry to the class that implements it."""

from __future__ import annotations

from kubesgl.errors import UnsupportedModelError
from kubesgl.models.decoder import (
    CausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from kubesgl.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM)
}


def model_class(architectures: list[str] | None) -> type[CausalLM]:
    """The first supported entry of `architectures`; UnsupportedModelError naming what is supported."""
    for arch in architectures or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise UnsupportedModelError(
        f"model architecture {architectures!r} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
