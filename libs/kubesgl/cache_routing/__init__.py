"""Cache-aware routing: which scheduler instance already holds a request's prefix (from its KV events), and
how that trades against load. Pure bookkeeping; the NATS side lives in the tokenizer and scheduler services."""
