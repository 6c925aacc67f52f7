"""Checkpoint loading: sharded files, tied heads, dtypes, dummy weights, and the errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kubesgl.errors import ModelNotFoundError, UnsupportedModelError
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import (
    QWEN3_EOS,
    QWEN3_VOCAB,
    build_demo_model,
    build_random_model,
    write_config_only,
)
from safetensors.torch import load_file, save_file
from support.model_helpers import SingleRequestRunner


def logits_of(path: Path, token_ids: list[int]) -> torch.Tensor:
    return SingleRequestRunner(load_model(path), page_size=1).step(token_ids)


def test_sharded_checkpoint_loads_same_as_single_file(tmp_path: Path) -> None:
    single = build_random_model("qwen3_moe", tmp_path / "single")
    sharded = build_random_model("qwen3_moe", tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(logits_of(single, ids), logits_of(sharded, ids))


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path = build_random_model("qwen3", tmp_path)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_head_is_loaded_from_checkpoint(tmp_path: Path) -> None:
    path = build_random_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_missing_lm_head_falls_back_to_embeddings(tmp_path: Path) -> None:
    path = build_random_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    model = load_model(path)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_model_reports_shapes_and_eos(tmp_path: Path) -> None:
    model = load_model(build_random_model("qwen3", tmp_path, overrides={"max_position_embeddings": 512}))
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
    assert (model.hidden_size, model.vocab_size, model.context_len) == (64, 512, 512)
    assert model.eos_token_ids == (1,)
    assert model.dtype == torch.float32


def test_dtype_defaults_to_checkpoint_and_can_be_overridden(tmp_path: Path) -> None:
    path = build_random_model("qwen2", tmp_path, dtype=torch.bfloat16)
    assert load_model(path).dtype == torch.bfloat16
    assert (
        load_model(path, dtype=torch.float32).model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
    )


def test_unknown_architecture_is_rejected_by_name(tmp_path: Path) -> None:
    path = build_random_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: .*Qwen3ForCausalLM"):
        load_model(path)


def test_missing_directory_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


def test_directory_without_config_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_directory_without_weights_is_model_not_found(tmp_path: Path) -> None:
    path = build_random_model("qwen3", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(path)


def test_unknown_weight_names_are_reported(tmp_path: Path) -> None:
    path = build_random_model("qwen3", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.surprise\.weight"):
        load_model(path)


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    path = build_random_model("qwen3_moe", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(2/3\)") as err:
        load_model(path)
    assert "layers.2.mlp.experts.w13 (15/16)" in str(err.value)


def test_wrongly_shaped_weight_is_reported(tmp_path: Path) -> None:
    path = build_random_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.weight.*\(64, 100\)"):
        load_model(path)


def test_dummy_weights_need_no_weight_files(tmp_path: Path) -> None:
    path = write_config_only("Qwen3-0.6B", tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json"]
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1  # the real widths, one layer: enough to exercise every shape
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path, dummy=True)
    assert model.dtype == torch.bfloat16
    assert (model.num_kv_heads, model.head_dim, model.vocab_size) == (8, 128, QWEN3_VOCAB)
    assert model.context_len == 40960 and model.eos_token_ids == QWEN3_EOS
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = SingleRequestRunner(model, page_size=16).step([1, 2, 3])
    assert logits.shape == (3, QWEN3_VOCAB) and torch.isfinite(logits).all()


def test_unsupported_rope_scaling_is_rejected(tmp_path: Path) -> None:
    path = write_config_only("Qwen3-0.6B", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(path, dummy=True)


def test_demo_model_is_built_once_with_real_tokenizer(tmp_path: Path) -> None:
    path = build_demo_model(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= {
        p.name for p in path.iterdir()
    }
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dir left behind
    model = load_model(path)
    assert model.vocab_size == QWEN3_VOCAB and model.eos_token_ids == QWEN3_EOS
