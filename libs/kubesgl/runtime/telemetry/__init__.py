"""Observability for kubesgl services: Prometheus metrics (metrics.py), OpenTelemetry traces (tracing.py)
and the per-request scheduler timeline that feeds both (scheduler.py)."""
