"""Static checks of deploy/ (no Docker engine here): the compose file parses, every service command is
accepted by the real `pdserve serve` parser, addresses point at services that exist, and the Dockerfile copies
what the package needs."""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from pdserve.cli import _service
from pdserve.config import add_dataclass_args, config_from

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load():
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_services_commands_parse():
    compose = load()
    assert set(compose["services"]) == {"router", "prefill", "decode"}
    ports = {}
    for name, svc in compose["services"].items():
        cmd = svc["command"]
        assert cmd[:2] == ["serve", name]
        cls, prefix = _service(name)
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        cfg = config_from(cls, parser.parse_args(cmd[2:]), prefix, environ=env)
        assert cfg.model == "/models/model"
        ports[name] = cfg.port
        if name == "router":
            for target in cfg.prefill + cfg.decode:
                host, port = target.split(":")
                assert host in compose["services"] and int(port) == ports.get(host, int(port))
            assert "50051:50051" in svc["ports"]
    assert ports["prefill"] != ports["decode"]


def test_dockerfile_copies_package_sources():
    text = (DEPLOY / "Dockerfile").read_text()
    for path in ("pyproject.toml", "shared", "services", "protos"):
        assert f"COPY {path}" in text
    assert 'ENTRYPOINT ["pdserve"]' in text
