"""The dense decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

The families differ only in flags: Qwen2 has a q/k/v bias, Qwen3 normalises q and k per head before
RoPE. Module names follow HF's so checkpoint names map one to one, except the fused q/k/v and gate/up
projections (see `stacked_params`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubesgl.distributed import TPGroup
from kubesgl.errors import UnsupportedModelError
from kubesgl.kernels.dispatch import use_triton
from kubesgl.kernels.fused_mlp import fused_mlp, fused_mlp_applies
from kubesgl.kernels.gemv import gate_up_silu, norm_linear, qkv_linear_prep
from kubesgl.kernels.qkv_prep import QkvPrep
from kubesgl.layers import opaque
from kubesgl.layers.activation import SiluAndMul
from kubesgl.layers.attention import Attention
from kubesgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kubesgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kubesgl.layers.norm import RMSNorm
from kubesgl.layers.rotary import RotaryEmbedding
from kubesgl.models.hf_config import eos_token_ids, head_dim_of, rope_settings

if TYPE_CHECKING:
    from kubesgl.layers.forward import ForwardBatch

# HF checkpoint name piece -> (our fused parameter's name piece, shard id).
STACKED_PARAMS: dict[str, tuple[str, Any]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class DecoderAttention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj."""

    def __init__(self, config: Any, layer_id: int, *, qkv_bias: bool, qk_norm: bool, tp: TPGroup) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            tp=tp,
        )
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=False, tp=tp
        )
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, layer_id)

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        t = x.shape[0]
        return norm(x.view(t, -1, self.head_dim)).view(t, -1)  # type: ignore[union-attr]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The fused qkv projection, then norms, RoPE, KV store, attention and o_proj."""
        if opaque.tracing():  # torch.compile: the block between the projections is one opaque op
            qkv = self.qkv_proj(hidden)
            return self.o_proj(opaque.attention_block(qkv, positions, self.attn.layer_id, self.q_size))
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        # The projection and its prep in one mid-batch GEMM where its table says (5-256 rows on CUDA).
        q = qkv_linear_prep(hidden, w, b, lambda: self._prep_args(positions, fb))
        if q is None:
            q = self.prep(self.qkv_proj(hidden), positions, fb)
        return self.o_proj(self.attn(q, fb))

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """From the fused qkv projection to the attention output: norms, RoPE, KV store, attention."""
        return self.attn(self.prep(qkv, positions, fb), fb)

    def prep(
        self, qkv: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q/k norms, RoPE and the K/V store into the cache; returns q [T, heads * head_dim], written into
        `out` (a dense tensor of that shape) when given."""
        if use_triton(qkv):
            return self._prep_fused(qkv, positions, fb, out)
        q = self._prep(qkv, positions, fb)
        return q if out is None else out.copy_(q)

    def _prep_args(self, positions: torch.Tensor, fb: ForwardBatch) -> QkvPrep:
        """This layer's prep after the qkv projection, for the rows of `fb`."""
        layer, qn, kn = self.attn.layer_id, self.q_norm, self.k_norm
        return QkvPrep(
            positions,
            fb.out_loc,
            self.rotary_emb.cos,
            self.rotary_emb.sin,
            qn.weight if qn is not None else None,
            kn.weight if kn is not None else None,
            qn.eps if qn is not None else 0.0,
            fb.kv.k_flat(layer),
            fb.kv.v_flat(layer),
            self.attn.num_heads,
            self.attn.num_kv_heads,
        )

    def _prep(self, qkv: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q/k norms and RoPE op by op (HF's arithmetic, bit for bit on CPU), K/V into the cache; returns q."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        t, heads, d = q.shape[0], self.attn.num_kv_heads, self.head_dim
        fb.kv.store(self.attn.layer_id, fb.out_loc, k.view(t, heads, d), v.view(t, heads, d))
        return q

    def _prep_fused(
        self, qkv: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same in one Triton kernel (`kernels/qkv_prep_triton.py`)."""
        return self._prep_args(positions, fb).run(qkv, out).view(qkv.shape[0], -1)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) with gate/up fused and the intermediate dim sharded."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act_fn = SiluAndMul()
        # The one-kernel decode MLP has no bias and no all-reduce (kernels/fused_mlp.py).
        self.fusable = tp.size == 1 and not bias

    def after_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`norm` (with its residual add) and this MLP, the norm inside the gate_up GEMV (kernels/gemv.py):
        (output, residual); None where that does not apply (the caller runs the norm, then `forward`)."""
        if self.fusable and fused_mlp_applies(x):
            return None
        gate_up = self.gate_up_proj
        fused = norm_linear(x, residual, norm.weight, norm.eps, gate_up.weight, gate_up.bias, silu=True)
        if fused is None:
            return None
        act, residual = fused
        return self.down_proj(act), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]; float32 from the fused small-batch kernel, which only a residual norm reads."""
        if self.fusable and fused_mlp_applies(x):
            return fused_mlp(x, self.gate_up_proj.weight, self.down_proj.weight)
        if (act := gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)) is not None:
            return self.down_proj(act)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm can fuse the add."""

    def __init__(self, config: Any, self_attn: DecoderAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, norm = self.self_attn, self.input_layernorm
        fused = norm_linear(hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        if fused is None:
            hidden, residual = self._input_norm(hidden, residual)
            return self._mlp_block(attn(positions, hidden, fb), residual)
        qkv, residual = fused  # the input norm inside the qkv GEMV (a decode step of a few rows on CUDA)
        return self._mlp_block(attn.o_proj(attn.attend(qkv, positions, fb)), residual)

    def _input_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the embedding is the residual stream
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def _mlp_block(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.mlp, DenseMLP):
            fused = self.mlp.after_norm(hidden, residual, self.post_attention_layernorm)
            if fused is not None:
                return fused
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    # The layer in two pieces around its attention kernel, for the piecewise prefill graphs
    # (engine/piecewise_graph.py): attention_input, then `self_attn.attn`, then attention_output is `forward`.
    def attention_input(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm, the qkv projection, q/k norms, RoPE and the K/V store: (q, residual); q is written
        into `q_out` when given."""
        hidden, residual = self._input_norm(hidden, residual)
        attn = self.self_attn
        return attn.prep(attn.qkv_proj(hidden), positions, fb, q_out), residual

    def attention_output(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the residual norm and the MLP: (hidden, residual) for the next layer."""
        return self._mlp_block(self.self_attn.o_proj(attn_out), residual)


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: Any, layers: list[DecoderLayer], *, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb)
        out, _ = self.norm(hidden, residual)
        return out

    def piece(
        self,
        i: int,
        fb: ForwardBatch,
        attn_out: torch.Tensor | None,
        residual: torch.Tensor | None,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` cut at its attention kernels into len(layers) + 1 pieces (engine/piecewise_graph.py): piece
        0 embeds and runs layer 0 up to its attention kernel; piece i (0 < i < L) finishes layer i - 1 from its
        attention output and runs layer i up to its kernel; each returns (q of that layer, residual). Piece L
        finishes the last layer and the final norm: (hidden [T, hidden_size], None). Run in order with
        `layers[i].self_attn.attn` between them, they compute `forward`'s ops in its order."""
        layers = self.layers
        if i == 0:
            return layers[0].attention_input(fb.positions, self.embed_tokens(fb.input_ids), None, fb, q_out)
        assert attn_out is not None and residual is not None
        hidden, residual = layers[i - 1].attention_output(attn_out, residual)
        if i < len(layers):
            return layers[i].attention_input(fb.positions, hidden, residual, fb, q_out)
        out, _ = self.norm(hidden, residual)
        return out, None


MlpFactory = Callable[[Any, int, TPGroup], nn.Module]


def dense_mlp(config: Any, layer_id: int, tp: TPGroup) -> nn.Module:
    return DenseMLP(
        config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False), tp=tp
    )


class CausalLM(nn.Module):
    """A decoder with an LM head: the object the engine drives (`forward`, `compute_logits`, shapes)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any, *, tp: TPGroup, eos_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
            raise UnsupportedModelError(
                f"{type(self).__name__} with sliding-window attention (window {config.sliding_window}) "
                "is not supported"
            )
        self.hf_config = config
        self.tp = tp
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        layers = [
            DecoderLayer(
                config,
                DecoderAttention(config, i, qkv_bias=qkv_bias, qk_norm=self.qk_norm, tp=tp),
                self.make_mlp(config, i, tp),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers, tp=tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        attn = layers[0].self_attn.attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.context_len = config.max_position_embeddings
        self.eos_token_ids = eos_ids or eos_token_ids(config)

    def make_mlp(self, config: Any, layer_id: int, tp: TPGroup) -> nn.Module:
        return dense_mlp(config, layer_id, tp)

    def map_weight_name(self, name: str) -> tuple[str, Any]:
        """HF checkpoint tensor name -> (our parameter name, shard id for its weight_loader)."""
        for piece, (fused, shard_id) in STACKED_PARAMS.items():
            if piece in name:
                return name.replace(piece, fused), shard_id
        return name, None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """[T] tokens -> final hidden states [T, hidden_size]."""
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab_size] in the model dtype, the full vocab on every rank."""
        return self.lm_head(hidden)


class LlamaForCausalLM(CausalLM):
    pass


class MistralForCausalLM(CausalLM):
    pass


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
