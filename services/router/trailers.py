"""Trailing-metadata keys the router sets and its clients (the gateway) read; torch-free, so the gateway can
import them without the router's servicer."""

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED: when to try again
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # the same delay in gRPC's own key (its retry policies honour it)
