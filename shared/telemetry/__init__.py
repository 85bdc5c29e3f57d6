"""Observability: OpenTelemetry tracing (`tracing.py`), Prometheus metrics (`metrics.py`) and the per-service
bundle with its per-RPC scope (`service.py`)."""
