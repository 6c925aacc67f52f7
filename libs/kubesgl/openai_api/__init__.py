"""The OpenAI-compatible HTTP surface as pure data: request models, validation into SamplingParams, response and
chunk builders, error bodies, and stop-string handling. No I/O here; the gateway service wires it to NATS."""
