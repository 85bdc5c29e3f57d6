"""A scripted `pdserve.v1.Generation` servicer served on a free loopback port, for tests of the router's clients
(the gateway, the CLI) without a model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from pdserve.v1 import generate_pb2_grpc


@contextmanager
def generation_server(servicer: generate_pb2_grpc.GenerationServicer, threads: int = 8) -> Iterator[str]:
    """Serve `servicer` (plaintext, 127.0.0.1, a free port) until the block ends; yields its host:port."""
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
