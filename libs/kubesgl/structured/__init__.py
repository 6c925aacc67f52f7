"""Grammar-constrained decoding with xgrammar: the constraint a request carries (`Constraint`), its
compilation against one model's vocabulary (`GrammarCompiler`, cached), the per-request grammar state that
advances with each sampled token (`GrammarState`), and the sampler-side masking of the logits
(`apply_token_bitmask_`). Nothing here knows about HTTP or NATS."""
