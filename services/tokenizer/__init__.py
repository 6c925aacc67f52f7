"""Tokenizer service: chat template + tokenization + routing to a scheduler instance (NATS queue group)."""
