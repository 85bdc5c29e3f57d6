"""Static checks of deploy/ (no Docker engine here): the compose file parses, every service command is
accepted by the real `pdserve serve` parser, addresses point at services that exist, and the Dockerfile copies
what the package needs."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from pdserve.cli.main import _service
from pdserve.config import add_dataclass_args, config_from

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load():
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


PDSERVE = ("prefill", "decode", "router")
OBSERVABILITY = ("jaeger", "prometheus", "grafana")


def parsed_configs(compose) -> dict:
    """Each pdserve service's config as its real parser and environment handling build it."""
    out = {}
    for name in PDSERVE:
        svc = compose["services"][name]
        cls, prefix = _service(name)
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        out[name] = config_from(cls, parser.parse_args(svc["command"][2:]), prefix, environ=env)
    return out


def test_compose_services_commands_parse():
    compose = load()
    assert set(compose["services"]) == {*PDSERVE, *OBSERVABILITY, "redis", "gateway"}
    ports = {}
    for name, cfg in parsed_configs(compose).items():  # router last: prefill/decode ports known
        svc = compose["services"][name]
        assert svc["command"][:2] == ["serve", name]
        assert cfg.model == "/models/model"
        ports[name] = cfg.port
        if name == "router":
            for target in cfg.prefill + cfg.decode:
                host, port = target.split(":")
                assert host in compose["services"] and int(port) == ports.get(host, int(port))
            assert "50051:50051" in svc["ports"]
    assert ports["prefill"] != ports["decode"]


def test_gateway_points_at_the_router():
    compose = load()
    svc = compose["services"]["gateway"]
    cls, prefix = _service("gateway")
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, cls)
    assert svc["command"][:2] == ["serve", "gateway"]
    cfg = config_from(cls, parser.parse_args(svc["command"][2:]), prefix, environ={})
    router = parsed_configs(compose)["router"]
    assert cfg.router == f"router:{router.port}" and f"{cfg.port}:{cfg.port}" in svc["ports"]


def test_dockerfile_copies_package_sources():
    text = (DEPLOY / "Dockerfile").read_text()
    for path in ("pyproject.toml", "shared", "services", "protos"):
        assert f"COPY {path}" in text
    assert 'ENTRYPOINT ["pdserve"]' in text


def test_observability_wiring():
    """Every service exports traces to the compose Jaeger and serves /metrics where Prometheus scrapes it; Grafana
    mounts files that exist and points at the compose Prometheus and Jaeger."""
    from pdserve.telemetry.tracing import tracing_enabled

    compose = load()
    services = compose["services"]
    cfgs = parsed_configs(compose)
    for name in PDSERVE:
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert tracing_enabled(env), name
        host, port = env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://").split(":")
        assert host == "jaeger" and port == "4317"
        assert cfgs[name].metrics_port > 0
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in prom["scrape_configs"]}
    assert jobs == {name: [f"{name}:{cfgs[name].metrics_port}"] for name in PDSERVE}
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]

    grafana = services["grafana"]
    for vol in grafana["volumes"]:
        assert (DEPLOY / vol.split(":")[0]).exists(), vol
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in ds}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and by_uid["jaeger"]["url"] == "http://jaeger:16686"
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "jaeger"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text())["providers"][0]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]


def test_dashboard_queries():
    """The dashboard parses, uses the provisioned Prometheus, and selects jobs Prometheus has. (That every metric
    it names is exported is checked against live /metrics in tests/services/test_tracing_e2e.py.)"""
    import json
    import re

    dash = json.loads((DEPLOY / "grafana/dashboards/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and all(
        t["datasource"]["uid"] == "prometheus" for p in dash["panels"] for t in p["targets"]
    )
    for job in {j for e in exprs for j in re.findall(r'job=~"([a-z]+)"', e)}:
        assert job in PDSERVE
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_prompt_cache_wiring():
    """Prefill reaches the compose Redis through REDIS_URL (what build_prompt_cache reads), and that Redis evicts
    instead of failing writes when full and persists nothing."""
    from pdserve.cache.prompt_cache import build_prompt_cache

    services = load()["services"]
    env = {k: str(v) for k, v in services["prefill"]["environment"].items()}
    cache = build_prompt_cache(parsed_configs(load())["prefill"], environ=env)
    assert cache.store.remote and cache.store.url == "redis://redis:6379/0"
    cache.close()
    cmd = services["redis"]["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert cmd[cmd.index("--save") + 1] == "" and cmd[cmd.index("--appendonly") + 1] == "no"
