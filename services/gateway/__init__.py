"""The OpenAI-compatible HTTP gateway: FastAPI in front of the tokenizer/scheduler/detokenizer mesh on NATS."""
