"""Builds a model from an HF checkpoint directory: config.json + *.safetensors, sharded for this TP rank."""

from __future__ import annotations

import contextlib
import json
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from kubesgl.distributed import TPGroup
from kubesgl.errors import ModelNotFoundError, UnsupportedModelError
from kubesgl.models.decoder import CausalLM
from kubesgl.models.hf_config import eos_token_ids, generation_eos_ids
from kubesgl.models.registry import model_class

# Checkpoint tensors that carry nothing we need (precomputed RoPE tables of old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_model(
    model_path: str | Path,
    *,
    tp: TPGroup | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    dummy: bool = False,
    seed: int = 0,
) -> CausalLM:
    """Loads this rank's shard of the checkpoint at `model_path` onto `device`.

    dtype None takes the checkpoint's own; `dummy` skips the weight files and fills random values (for
    benchmarks that only need the real shapes).
    """
    tp = tp or TPGroup()
    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.is_file():
        what = "directory does not exist" if not path.is_dir() else "config.json not found"
        raise ModelNotFoundError(f"no model at {path}: {what}", param="model")
    cls = model_class(json.loads(config_file.read_text()).get("architectures"))
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(f"cannot read {config_file}: {e}") from e
    dtype = dtype or config_dtype(hf_config)
    eos_ids = generation_eos_ids(path) or eos_token_ids(hf_config)
    with default_dtype(dtype), torch.device(device):
        model = cls(hf_config, tp=tp, eos_ids=eos_ids)
    if dummy:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, path, tp)
    return model.eval()


def config_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint's dtype (`dtype` in transformers 5, `torch_dtype` before); float32 when unset."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    return getattr(torch, str(value).removeprefix("torch."))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Creates parameters directly in `dtype` (no float32 copy of a large model on the way)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelNotFoundError(f"{index} names weight files that are missing: {absent}", param="model")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weight files in {path}", param="model")
    return files


def _checkpoint_names(files: list[Path]) -> dict[Path, list[str]]:
    names = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names[file] = [n for n in f.keys() if not n.endswith(_IGNORED_SUFFIXES)]  # noqa: SIM118
    return names


def load_weights(model: CausalLM, path: Path, tp: TPGroup) -> None:
    """Checks every checkpoint name maps to a parameter and every parameter is filled, then loads."""
    names = _checkpoint_names(checkpoint_files(path))
    all_names = {n for file_names in names.values() for n in file_names}
    if "lm_head.weight" not in all_names and not model.tie_word_embeddings:
        # Checkpoints saved with tied weights may omit the head entirely.
        model.lm_head.tie_to(model.model.embed_tokens)
        model.tie_word_embeddings = True
    if model.tie_word_embeddings:
        all_names.discard("lm_head.weight")
    params = dict(model.named_parameters())
    targets = {n: model.map_weight_name(n) for n in all_names}
    unknown = sorted(n for n, (p, _) in targets.items() if p not in params)
    if unknown:
        raise UnsupportedModelError(
            f"checkpoint {path} has {len(unknown)} weights this {type(model).__name__} does not know: "
            f"{unknown[:10]}"
        )
    filled = Counter(p for p, _ in targets.values())
    missing = [f"{n} ({filled[n]}/{p.num_shards})" for n, p in params.items() if filled[n] != p.num_shards]
    if missing:
        raise UnsupportedModelError(f"checkpoint {path} lacks weights for: {missing[:10]}")
    quiet = tp.rank != 0 or not sys.stderr.isatty()
    for file, file_names in tqdm(names.items(), desc="Loading weights", unit="file", disable=quiet):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in file_names:
                if name not in targets:
                    continue
                param_name, shard_id = targets[name]
                param = params[param_name]
                try:
                    param.weight_loader(param, f.get_tensor(name), shard_id)
                except ValueError as e:
                    raise UnsupportedModelError(f"{file.name}: {name}: {e}") from e


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights with sane scales: norms 1, biases 0, matrices N(0, 0.02)."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
