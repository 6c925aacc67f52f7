"""Test helpers for models: driving a loaded model directly (one request, a paged KV cache, torch attention), the
model families every parity test covers, and tokenizers put into small random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.torch_backend import TorchAttention
from kubesgl.kv.kv_cache import KVCache
from kubesgl.layers.forward import ForwardBatch
from kubesgl.models.decoder import CausalLM
from kubesgl.models.random_init import TINY_EOS

# The parity set: the model families (random_init's tiny configs) every "same outputs as ..." test runs over.
PARITY_ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe"]


class SingleRequestRunner:
    """Feeds one request's tokens through `model` step by step, as the engine would, and returns logits."""

    def __init__(self, model: CausalLM, page_size: int, max_tokens: int = 64) -> None:
        self.model = model
        self.page_size = page_size
        num_pages = 1 + -(-max_tokens // page_size)  # + scratch page 0
        device = model.lm_head.weight.device
        self.kv = KVCache(
            model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim, model.dtype, device
        )
        # Pages in reverse order, so a request's KV is not contiguous and the page table matters.
        self.pages = torch.arange(num_pages - 1, 0, -1, device=device)
        self.attn = TorchAttention()
        self.length = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Appends `token_ids` (one token after the first step = a decode batch); logits [n, vocab]."""
        n, p, device = len(token_ids), self.page_size, self.pages.device
        mode = "decode" if self.length > 0 and n == 1 else "extend"
        positions = torch.arange(self.length, self.length + n, device=device)
        out_loc = self.pages[positions // p] * p + positions % p
        meta = AttentionMetadata(
            mode=mode,
            page_size=p,
            seq_lens=[self.length + n],
            extend_lens=[n],
            prefix_lens=[self.length],
            page_table=self.pages[None].to(torch.int32),
            seq_lens_dev=torch.tensor([self.length + n], dtype=torch.int32, device=device),
        )
        self.attn.plan(meta)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        fb = ForwardBatch(mode, ids, positions, out_loc, self.attn, self.kv)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(fb))
        self.length += n
        return logits


CHAT_TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def with_chat_template(model_dir: str | Path, template: str) -> Path:
    """Puts `template` (a file name under tests/data/chat_templates, or Jinja text) into the checkpoint's
    tokenizer_config.json as its chat template: a small HF-built model then renders that family's prompts."""
    path = CHAT_TEMPLATES / template
    text = path.read_text() if path.suffix == ".jinja" and path.is_file() else template
    config_path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = text
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return Path(model_dir)


def with_byte_level_tokenizer(model_dir: str | Path) -> Path:
    """Gives a tiny random checkpoint (random_init's 512-token vocab) a byte-level BPE tokenizer of exactly that
    size, trained here on a fixed corpus of JSON lines, with `<|endoftext|>` at the checkpoint's EOS id: what
    structured outputs need (xgrammar builds its token table from the tokenizer), at a 300th of the real Qwen3
    tokenizer's 152k tokens, whose table takes seconds per engine to build and whose logits make every step slow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    config = json.loads((Path(model_dir) / "config.json").read_text())
    special = ["<|pad|>", "<|endoftext|>"]  # trained first: ids 0 and 1
    assert special.index("<|endoftext|>") == TINY_EOS
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config["vocab_size"],
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        json.dumps({"id": i, "name": f"item {i}", "ok": i % 2 == 0, "tags": ["a", "b"][: i % 3]})
        for i in range(300)
    ]
    bpe.train_from_iterator(corpus, trainer)
    assert bpe.get_vocab_size() == config["vocab_size"], "the corpus is too small for the vocab"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=special[0], eos_token=special[1])
    tokenizer.save_pretrained(model_dir)
    return Path(model_dir)
