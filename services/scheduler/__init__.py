"""Scheduler service: one instance per pod; rank 0 drives the engine and talks to NATS."""
