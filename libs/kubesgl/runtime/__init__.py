"""The service runtime: what every kubesgl process that talks to NATS runs on, and nothing the engine may import.

The bus-service runner (admin endpoint, NATS connection, signals, drain), the NATS client settings, the admin
HTTP endpoint, task lifecycle, Prometheus metrics and OpenTelemetry tracing (`telemetry/`), and the local
process helpers (`nats_server`, `process`) that `kubesgl up` and the tests start services with.
"""
