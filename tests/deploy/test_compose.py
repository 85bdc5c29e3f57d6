"""Static checks of deploy/docker-compose.yml (no container engine here): what `docker compose config` checks
(the compose-spec JSON schema after variable substitution, references between services per profile), and that
every service runs a real `pdserve` command with settings its config knows.

tests/deploy/compose-spec.json is the Compose Specification's JSON schema as published in
github.com/compose-spec/compose-spec (schema/compose-spec.json, Apache License 2.0), vendored unmodified so the check
runs offline; refresh it from there when compose gains fields the stack uses."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

PDSERVE = {
    "router": "router",
    "prefill": "prefill",
    "decode": "decode",
    "prefill-gpu": "prefill",
    "decode-gpu": "decode",
}
OBSERVABILITY = ("jaeger", "prometheus", "grafana")


def schema_errors(files, compose: dict) -> list[str]:
    schema = json.loads((files.ROOT / "tests/deploy/compose-spec.json").read_text())
    return [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(compose)]


@pytest.mark.parametrize("env", [{}, {"MODEL_DIR": "/srv/model", "KV_TRANSPORT": "grpc", "DECODE_GPU": "3"}])
def test_compose_file_matches_the_compose_spec(files, env):
    assert schema_errors(files, files.load_compose(env)) == []


def test_schema_check_catches_mistakes(files):
    compose = files.load_compose()
    compose["services"]["router"]["helthcheck"] = {}
    compose["services"]["gateway"]["ports"] = "8000:8000"
    errors = schema_errors(files, compose)
    assert any("helthcheck" in e for e in errors) and any("ports" in e for e in errors)


@pytest.mark.parametrize("profiles", [{"cpu"}, {"gpu"}])
def test_each_profile_is_a_whole_stack(files, profiles):
    """Services that reference another (depends_on, service:X namespaces) find it started under the same
    profiles; each profile runs exactly one prefill and one decode, and the default profile (deploy/.env) is cpu."""
    compose = files.load_compose()
    running = files.enabled(compose, profiles)
    for name, svc in running.items():
        refs = list(svc.get("depends_on") or [])
        refs += [
            svc[k].removeprefix("service:")
            for k in ("network_mode", "pid", "ipc")
            if str(svc.get(k, "")).startswith("service:")
        ]
        for ref in refs:
            assert ref in running, f"{name} references {ref}, not started with profiles {profiles}"
    roles = sorted(PDSERVE[n] for n in running if n in PDSERVE)
    assert roles == ["decode", "prefill", "router"]
    assert {"model", "gateway", "redis", *OBSERVABILITY} <= set(running)
    assert files.env_file()["COMPOSE_PROFILES"] == "cpu"


def parsed(files, compose: dict, name: str):
    svc = compose["services"][name]
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    assert svc["command"][0] == "serve"
    service = svc["command"][1]
    files.check_env_names(service, env)
    return files.service_config(service, svc["command"][2:], env), env


def test_every_command_and_setting_exists(files):
    """Each pdserve service's command parses with the real parser, every PDSERVE_* variable is a field of its
    config, the engines register with the router they can reach, and the model step reads what it is given."""
    compose = files.load_compose()
    services = compose["services"]
    router, _ = parsed(files, compose, "router")
    for name, role in PDSERVE.items():
        cfg, env = parsed(files, compose, name)
        assert services[name]["command"][1] == role and cfg.model == "/models/model"
        assert any(v.endswith(":/models/model:ro") for v in services[name]["volumes"])
        hostname = services.get(services[name].get("network_mode", "").removeprefix("service:"), services[name])
        assert env["PDSERVE_HEALTH_TARGET"] == f"localhost:{cfg.port}"
        if role != "router":  # engines register on the router's internal port
            assert cfg.host == "0.0.0.0" and cfg.router == f"router:{router.internal_port}"
            assert hostname["hostname"] in services  # what the engine advertises (its host name) resolves
    gateway, _ = parsed(files, compose, "gateway")
    assert (
        gateway.router == f"router:{router.port}" and f"{gateway.port}:{gateway.port}" in services["gateway"]["ports"]
    )
    assert f"{router.port}:{router.port}" in services["router"]["ports"]
    model = services["model"]
    assert model["entrypoint"] == ["python", "/opt/pdserve/prepare_model.py"]
    assert model["environment"]["PDSERVE_MODEL_DIR"] == "/models/model"
    assert "models:/models/model" in model["volumes"] and "models" in compose["volumes"]


def test_gpu_profile_placement(files):
    """One GPU each for compute, both visible to both (CUDA IPC), one host to the KV handshake: decode shares
    prefill's network (host name), PID and IPC namespaces; the KV transport is same-host by default."""
    compose = files.load_compose()
    s = compose["services"]
    prefill, _ = parsed(files, compose, "prefill-gpu")
    decode, _ = parsed(files, compose, "decode-gpu")
    assert {prefill.engine.device, decode.engine.device} == {"cuda:0", "cuda:1"}
    assert prefill.kv_transport == decode.kv_transport == "cuda-ipc"
    for ns in ("network_mode", "pid", "ipc"):
        assert s["decode-gpu"][ns] == "service:prefill-gpu"
    assert s["prefill-gpu"]["ipc"] == "shareable"
    for name in ("prefill-gpu", "decode-gpu"):
        (dev,) = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["device_ids"] == ["0", "1"] and dev["capabilities"] == ["gpu"]
        assert s[name]["image"] == "pdserve:cuda" and s[name]["build"]["target"] == "cuda"
    # one network namespace: the two engines' ports differ (gRPC and metrics)
    assert len({prefill.port, decode.port, prefill.metrics_port, decode.metrics_port}) == 4


def test_observability_wiring(files):
    """Every service exports traces to the compose Jaeger and serves /metrics where Prometheus scrapes it; Grafana
    mounts files that exist and points at the compose Prometheus and Jaeger."""
    from pdserve.telemetry.tracing import tracing_enabled

    compose = files.load_compose()
    services = compose["services"]
    scraped: dict[str, set[str]] = {}
    for name, role in PDSERVE.items():
        cfg, env = parsed(files, compose, name)
        assert tracing_enabled(env), name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        host = services[name].get("network_mode", name).removeprefix("service:")
        scraped.setdefault(role, set()).add(f"{host}:{cfg.metrics_port}")
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    prom = yaml.safe_load((files.DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: {t for sc in j["static_configs"] for t in sc["targets"]} for j in prom["scrape_configs"]}
    assert jobs == scraped
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]

    grafana = services["grafana"]
    for vol in grafana["volumes"]:
        assert (files.DEPLOY / vol.split(":")[0]).exists(), vol
    ds = yaml.safe_load((files.DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in ds}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and by_uid["jaeger"]["url"] == "http://jaeger:16686"
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "jaeger"
    provider = yaml.safe_load((files.DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in grafana["volumes"]


def test_dashboard_queries(files):
    """The dashboard parses, uses the provisioned Prometheus, and selects jobs Prometheus has. (That every metric
    it names is exported is checked against live /metrics in tests/services/test_tracing_e2e.py.)"""
    import re

    dash = json.loads((files.DEPLOY / "grafana/dashboards/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    assert all(t["datasource"]["uid"] == "prometheus" for p in dash["panels"] for t in p["targets"])
    for job in {j for e in exprs for j in re.findall(r'job=~"([a-z]+)"', e)}:
        assert job in ("router", "prefill", "decode")
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def make_certs(files, directory):
    """Run deploy/make_certs.py (the compose `certs` step) into `directory`; returns the module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_certs", files.DEPLOY / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(directory)
    return module


def test_prompt_cache_wiring(files, tmp_path):
    """Prefill reaches the compose Redis through REDIS_URL (what build_prompt_cache reads) over mutual TLS as ACL
    user `prefill`, with the password and the cache secret from files the `certs` step writes; that Redis evicts
    instead of failing writes when full and persists nothing."""
    from pdserve.cache.prompt_cache import build_prompt_cache
    from pdserve.cache.value_auth import CacheKeyring

    made = tmp_path / "certs"
    make_certs(files, made)
    compose = files.load_compose()
    for name in ("prefill", "prefill-gpu"):
        cfg, env = parsed(files, compose, name)
        query = files.prefill_redis_query(env["REDIS_URL"])
        assert query == {
            "ssl_ca_certs": "/certs/ca.pem",
            "ssl_certfile": "/certs/stack.pem",
            "ssl_keyfile": "/certs/stack-key.pem",
        }
        assert (env["REDIS_PASSWORD_FILE"], env["PDSERVE_CACHE_SECRET_FILE"]) == (
            "/certs/redis_password",
            "/certs/cache_secret",
        )
        here = {k: v.replace("/certs/", f"{made}/") for k, v in env.items()}  # the volume's files, made here
        cache = build_prompt_cache(cfg, environ=here)  # reads both files (`redis` does not resolve here: misses)
        assert cache.store.remote and cache.store.url == here["REDIS_URL"]
        assert cache.keyring == CacheKeyring.from_file(made / "cache_secret")
        assert cache.key_prefix == "pdserve:kv:"  # what the ACL user `prefill` may touch
        cache.close()
    cmd = compose["services"]["redis"]["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert cmd[cmd.index("--save") + 1] == "" and cmd[cmd.index("--appendonly") + 1] == "no"


def test_compose_redis_is_tls_and_acl_only(files, tmp_path):
    """The compose Redis, run here (redis-server with the file's arguments, the `certs` step's files, free ports):
    no plaintext port and no default user in the file; prefill's settings store and find a page over mutual TLS;
    a client without a certificate, a wrong password, the default user and the wrong ACL user are refused."""
    import dataclasses
    from urllib.parse import urlsplit

    import torch

    from pdserve.cache.keys import CacheNamespace
    from pdserve.cache.prompt_cache import build_prompt_cache
    from pdserve.cache.redis_store import RedisStore, StoreRefused
    from pdserve.kv.codec import KVLayoutSpec
    from pdserve.kv.payload import PagePayload
    from pdserve.testing.redis_server import RedisServer

    made = tmp_path / "certs"
    make_certs(files, made)
    compose = files.load_compose()
    svc = compose["services"]["redis"]
    assert svc["user"] == "10001:10001" and "certs:/certs:ro" in svc["volumes"]
    assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    args = [a.replace("/certs/", f"{made}/") for a in svc["command"][1:]]
    opt = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert (opt("--port"), opt("--tls-port"), opt("--tls-auth-clients")) == ("0", "6379", "yes")
    assert (made / "redis_users.acl").read_text().startswith("user default off")
    del args[args.index("--port") : args.index("--port") + 2]  # the test server keeps a loopback port to probe
    args[args.index("--tls-port") + 1] = RedisServer.FREE_PORT
    srv = RedisServer(tmp_path / "redis", args=args).start()
    try:
        tls_port = srv.extra_ports[0]
        cfg, env = parsed(files, compose, "prefill")
        here = {
            k: v.replace("/certs/", f"{made}/").replace("@redis:6379", f"@127.0.0.1:{tls_port}") for k, v in env.items()
        }
        cache = build_prompt_cache(cfg, environ=here)
        layout = KVLayoutSpec(dtype="float32", page_size=2, num_layers=1, num_kv_heads=1, head_dim=4)
        ns = CacheNamespace("fp", layout, scope="tenant:a")
        data = torch.randn(2, 1, 2, 1, 4)
        key = ns.page_keys([1, 2, 3])[0]
        assert cache.put(ns, key, PagePayload(0, 2, 0, data, None, None, 0)) and cache.flush(10)
        hit = cache.lookup(ns, [1, 2, 3], 1)
        assert hit.num_pages == 1 and torch.equal(hit.pages[0].data, data) and cache.stats.writes == 1
        cache.close()
        url = here["REDIS_URL"]
        no_cert = url.split("&ssl_certfile")[0]
        for bad, reason in [
            (dataclasses.replace(cfg, redis_url=no_cert), "TLS"),
            (dataclasses.replace(cfg, redis_password_file=str(made / "redis_router_password")), "credentials"),
        ]:
            with pytest.raises(SystemExit, match=reason):
                build_prompt_cache(bad, environ=here)
        with pytest.raises(SystemExit, match="refused the credentials"):  # the default user is off
            build_prompt_cache(
                dataclasses.replace(cfg, redis_url=url.replace("prefill@", "")),
                environ={**here, "REDIS_PASSWORD_FILE": ""},
            )
        base = urlsplit(url)._replace(netloc=f"router@127.0.0.1:{tls_port}")
        router = RedisStore(
            base._replace(path="/1").geturl(),
            password=(made / "redis_router_password").read_text().strip(),
            timeout_s=2.0,
        )
        router.set_many([(b"pdserve:router:estimator:m", b"{}")], 60_000)  # its own keys ...
        with pytest.raises(StoreRefused, match="ACL"):
            router.get_many([b"pdserve:kv:anything"], 1000)  # ... not the prompt cache's
        router.close()
    finally:
        srv.stop()


def test_unknown_settings_are_caught(files):
    """The name check is real: a misspelled variable or flag fails."""
    with pytest.raises(AssertionError, match="PDSERVE_PREFILL_KV_DTYP"):
        files.check_env_names("prefill", {"PDSERVE_PREFILL_KV_DTYP": "int8"})
    with pytest.raises(SystemExit):
        files.service_config("decode", ["--kv-format", "int8"], {"PDSERVE_DECODE_MODEL": "/m"})


def test_every_hop_is_tls_with_the_stack_certificates(files, tmp_path):
    """Every gRPC service serves TLS with client-certificate checks on its internal ports and holds the internal
    token; the gateway serves HTTPS and verifies the router; the files they name are what the `certs` step writes
    (run here), into the volume they mount, with SANs for every host name the services dial."""
    from cryptography import x509

    from pdserve.server.security import ServiceSecurity

    compose = files.load_compose()
    services = compose["services"]
    certs = services["certs"]
    assert certs["entrypoint"] == ["python", "/opt/pdserve/make_certs.py"] and "certs:/certs" in certs["volumes"]
    assert "certs" in compose["volumes"]
    made = tmp_path / "certs"
    certs_step = make_certs(files, made)
    written = {p.name for p in made.iterdir()}
    for name in PDSERVE:
        cfg, env = parsed(files, compose, name)
        for path in (env["PDSERVE_TLS_CERT"], env["PDSERVE_TLS_KEY"], env["PDSERVE_TLS_CA"]):
            assert path.startswith("/certs/") and path.removeprefix("/certs/") in written, (name, path)
        here = {k: v.replace("/certs/", f"{made}/") for k, v in env.items()}  # the volume's files, made here
        sec = ServiceSecurity.of(cfg, environ=here)  # reads the token file
        assert sec.tls.on and sec.client_certs and sec.token, name
        assert "certs:/certs:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert sec.refusal(name, cfg.host, internal=True) is None  # would start: TLS + identity
    gateway, env = parsed(files, compose, "gateway")
    assert gateway.tls_cert == "/certs/stack.pem" and gateway.router_tls_ca() == "/certs/ca.pem"
    assert "https://localhost:8000/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    cert = x509.load_pem_x509_certificate((made / "stack.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    sans = set(san.get_values_for_type(x509.DNSName))
    hostnames = {services[n].get("hostname") for n in PDSERVE if services[n].get("hostname")} | {"router", "localhost"}
    assert hostnames <= sans, hostnames - sans
    before = (made / "stack.pem").read_bytes()
    certs_step.make(made)  # a second run keeps what is there
    assert (made / "stack.pem").read_bytes() == before
