"""Text side of serving: the model's tokenizer and chat template, and stateless incremental detokenization."""
