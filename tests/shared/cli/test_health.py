"""`pdserve health HOST:PORT`: exit 0 only while the server's grpc.health.v1 answers SERVING."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cli.main import cmd_health, main


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield hs, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def refusing_address():
    """host:port of a socket bound but never listening: connections are refused, and no one else can bind it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_serving_is_zero_and_not_serving_is_one(health_server, capsys):
    hs, target = health_server
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", target]) == 0
    assert "SERVING" in capsys.readouterr().out
    hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert cmd_health([target]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_named_service_and_env_target(health_server, monkeypatch):
    hs, target = health_server
    hs.set("pdserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.setenv("PDSERVE_HEALTH_TARGET", target)
    assert cmd_health(["--service", "pdserve.v1.Generation"]) == 0
    assert cmd_health(["--service", "pdserve.v1.Unknown"]) == 1  # NOT_FOUND


def test_unreachable_is_one(refusing_address, capsys):
    assert cmd_health([refusing_address, "--timeout", "0.5"]) == 1
    assert capsys.readouterr().err.startswith("127.0.0.1:")
