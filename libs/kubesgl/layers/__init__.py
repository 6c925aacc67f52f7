"""Model building blocks: tensor-parallel linear/embedding layers, norms, RoPE, attention and MoE."""
