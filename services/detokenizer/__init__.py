"""Detokenizer service: stateless incremental detokenization of TokenDeltas (NATS queue group)."""
