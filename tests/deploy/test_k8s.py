"""Static checks of deploy/k8s: both overlays render (kustomize's merge, tests/deploy/conftest.py), every object
passes the Kubernetes API schema (kubernetes-validate, strict: unknown fields fail), and the settings, probes,
termination and autoscaling agree with the code they configure."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

K8S_VERSION = "1.32"
ENGINES = ("prefill", "decode")


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request, files):
    docs = files.kustomize(files.DEPLOY / "k8s/overlays" / request.param)
    return request.param, {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_every_object_matches_the_api_schema(rendered):
    _, objs = rendered
    for (kind, name), doc in objs.items():
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name}: {e.message} at {'.'.join(map(str, e.path))}")


def test_schema_check_catches_mistakes(files):
    deployment = yaml.safe_load((files.DEPLOY / "k8s/base/router.yaml").read_text().split("---")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"] = "pdserve health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def env_of(objs: dict, container: dict) -> dict[str, str]:
    env = {}
    for ref in container.get("envFrom", []):
        env.update(objs[("ConfigMap", ref["configMapRef"]["name"])]["data"])
    env.update({e["name"]: e.get("value", "10.0.0.7") for e in container.get("env", [])})  # fieldRef: a pod IP
    return env


def test_commands_settings_and_probes(files, rendered):
    """Each container runs a real `pdserve serve` command; every PDSERVE_* variable it gets is a setting of that
    service; gRPC probes (k8s native) hit the port it serves; the model init container fills the mounted volume."""
    kind, objs = rendered
    router_port = None
    for name in ("router", *ENGINES, "gateway"):
        pod = objs[("Deployment", name)]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["args"][:2] == ["serve", name]
        env = env_of(objs, c)
        files.check_env_names(name, env)
        cfg = files.service_config(name, c["args"][2:], env)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if name == "gateway":
            assert cfg.router == f"router:{router_port}" and ports["http"] == cfg.port
            assert {c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]} == {
                "/ready",
                "/health",
            }
            assert c["readinessProbe"]["httpGet"]["scheme"] == c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
            assert cfg.tls_cert.startswith("/etc/pdserve/tls/")  # HTTPS; the router is verified with the CA below
            assert env["PDSERVE_TLS_CA"] == "/etc/pdserve/tls/ca.crt"
            continue
        want_ports = {"grpc": cfg.port, "metrics": cfg.metrics_port}
        if name == "router":
            want_ports["internal"] = cfg.internal_port
        assert ports == want_ports
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # TLS: `pdserve health`, not the kubelet's
            assert c[probe]["exec"]["command"] == ["pdserve", "health"], (name, probe)
        assert env["PDSERVE_HEALTH_TARGET"].rsplit(":", 1)[1] == str(cfg.port)
        assert pod["securityContext"]["runAsNonRoot"] is True
        (init,) = pod["initContainers"]
        assert init["command"] == ["python", "/opt/pdserve/prepare_model.py"]
        model_dir = env_of(objs, init)["PDSERVE_MODEL_DIR"]
        assert cfg.model == model_dir
        mounts = {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}
        cache = {"/etc/pdserve/cache": True} if name == "prefill" else {}  # the prompt cache's secret, Redis password
        assert mounts == {model_dir: True, "/etc/pdserve/tls": True, "/etc/pdserve/token": True, **cache}
        check_security(objs, pod, c, env, cfg)
        assert init["volumeMounts"][0]["mountPath"] == model_dir
        if name == "router":
            router_port, router_internal = cfg.port, cfg.internal_port
            service = {p["name"]: p["port"] for p in objs[("Service", "router")]["spec"]["ports"]}
            assert service["grpc"] == cfg.port and service["internal"] == cfg.internal_port
        else:  # engines register on the router's internal port
            assert cfg.router == f"router:{router_internal}"
            assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # advertised address


def check_security(objs: dict, pod: dict, c: dict, env: dict, cfg) -> None:
    """TLS with client certificates and the internal token, from the mounted Secrets; the pods dialed by IP are
    verified against one shared SAN; the service would start (no refusal)."""
    from pdserve.server.security import ServiceSecurity, tls_from

    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    cache = {"cache": "pdserve-cache"} if c["name"] == "prefill" else {}
    assert secrets == {"tls": "pdserve-tls", "internal-token": "pdserve-internal-token", **cache}
    tls = tls_from("", "", "", env)
    assert (tls.cert, tls.key, tls.ca) == (
        "/etc/pdserve/tls/tls.crt",
        "/etc/pdserve/tls/tls.key",
        "/etc/pdserve/tls/ca.crt",
    )
    assert tls.server_name == "pdserve-internal" and env["PDSERVE_INTERNAL_TOKEN_FILE"] == "/etc/pdserve/token/token"
    sec = ServiceSecurity(tls, "token-from-the-secret-0123", insecure=cfg.insecure)
    assert sec.client_certs and not cfg.insecure
    assert sec.refusal("svc", "0.0.0.0", internal=True) is None


def test_gpu_overlay_places_engines_on_gpus(rendered):
    kind, objs = rendered
    for name in ENGINES:
        (c,) = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        env = env_of(objs, c)
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        if kind == "gpu":
            assert gpus == "1" and c["image"] == "pdserve:cuda" and env[f"PDSERVE_{name.upper()}_DEVICE"] == "cuda"
        else:
            assert gpus is None and c["image"] == "pdserve:cpu" and env[f"PDSERVE_{name.upper()}_DEVICE"] == "cpu"


def drain_seconds(files) -> float:
    """The longest a service takes from SIGTERM to exit: deregistering (the announcer's join and its RPC timeout),
    the drain grace (--drain-grace-s, its default: no manifest sets another) and the margin for ended streams."""
    from pdserve.server import announce, runner
    from pdserve.server.service_config import ServerOptions

    assert "DRAIN_GRACE_S" not in (files.DEPLOY / "k8s/base/config.yaml").read_text()
    grace = ServerOptions().drain_grace_s + runner.DRAIN_END_MARGIN_S
    return grace + (announce.RPC_TIMEOUT_S + 1) + 1.0  # join(timeout=RPC_TIMEOUT_S + 1), Deregister(timeout=1)


def test_graceful_termination_covers_the_drain(files, rendered):
    """preStop + the services' drain fit in terminationGracePeriodSeconds, with room for the process to exit."""
    _, objs = rendered
    drain = drain_seconds(files)
    for name in ("router", *ENGINES, "gateway"):
        pod = objs[("Deployment", name)]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "sleep"
        assert int(cmd[1]) + drain + 5 <= pod["terminationGracePeriodSeconds"] <= int(cmd[1]) + drain + 30, name
    compose = files.load_compose()
    for name in ("prefill", "decode", "router"):
        assert int(compose["services"][name]["stop_grace_period"].removesuffix("s")) >= drain + 5


def test_disruption_budgets_and_autoscaling(files, rendered):
    """PDBs select pods that exist; the HPAs scale the engines on the External metric that the prometheus-adapter
    rule serves, which is the router's queue-depth gauge."""
    _, objs = rendered
    labels = {n: objs[("Deployment", n)]["spec"]["template"]["metadata"]["labels"] for n in ("gateway", *ENGINES)}
    for name, pod_labels in labels.items():
        pdb = objs[("PodDisruptionBudget", name)]["spec"]
        assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    rules = yaml.safe_load((files.DEPLOY / "k8s/prometheus-adapter/values.yaml").read_text())["rules"]
    (rule,) = rules["external"]
    router_src = (files.ROOT / "services/router/server.py").read_text()
    assert '"queue_depth", "Requests in the router\'s priority queue"' in router_src  # exported as pdserve_queue_depth
    assert rule["name"]["matches"] == "^pdserve_queue_depth$"
    assert 'app_kubernetes_io_component="router"' in rule["metricsQuery"]
    router_labels = objs[("Deployment", "router")]["spec"]["template"]["metadata"]
    assert router_labels["labels"]["app.kubernetes.io/component"] == "router"
    assert router_labels["annotations"]["prometheus.io/scrape"] == "true"
    for name in ENGINES:
        hpa = objs[("HorizontalPodAutoscaler", name)]["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        (metric,) = hpa["metrics"]
        assert metric["type"] == "External" and metric["external"]["metric"]["name"] == rule["name"]["as"]
        assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]


def test_redis_is_tls_acl_only_and_reachable_only_from_its_users(files, rendered, tmp_path):
    """Redis serves TLS only (client certificates from the stack CA) with ACL users from the Secret pdserve-redis;
    the NetworkPolicy admits only prefill and router pods, on Redis' port; prefill's settings name the prompt
    cache's Secret files, and the router's estimator store is Redis as user `router` over TLS."""
    from urllib.parse import urlsplit

    from pdserve.cache.prompt_cache import build_prompt_cache

    _, objs = rendered
    pod = objs[("StatefulSet", "redis")]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    opt = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert (opt("--port"), opt("--tls-port"), opt("--tls-auth-clients")) == ("0", "6379", "yes")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v["secret"] for v in pod["spec"]["volumes"]}
    assert volumes["tls"]["secretName"] == "pdserve-tls" and volumes["acl"]["secretName"] == "pdserve-redis"
    assert (
        opt("--tls-cert-file") == mounts["tls"] + "/tls.crt" and opt("--tls-ca-cert-file") == mounts["tls"] + "/ca.crt"
    )
    assert opt("--aclfile") == f"{mounts['acl']}/{volumes['acl']['items'][0]['path']}"
    assert volumes["acl"]["items"][0]["key"] == "users.acl"
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]  # reads 0440

    policy = objs[("NetworkPolicy", "redis")]["spec"]
    assert policy["podSelector"]["matchLabels"] == pod["metadata"]["labels"] and policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # pods of this namespace only, no ipBlock / namespaceSelector
    admitted = []
    for name in ("router", "prefill", "decode", "gateway"):
        labels = objs[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        sel = peer["podSelector"]
        ok = sel["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in sel["matchExpressions"] if e["operator"] == "In"
        )
        admitted += [name] if ok else []
    assert admitted == ["router", "prefill"]

    (prefill,) = objs[("Deployment", "prefill")]["spec"]["template"]["spec"]["containers"]
    env = env_of(objs, prefill)
    assert set(files.prefill_redis_query(env["REDIS_URL"])) == {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"}
    cache_mount = next(m["mountPath"] for m in prefill["volumeMounts"] if m["name"] == "cache")
    assert env["PDSERVE_CACHE_SECRET_FILE"] == f"{cache_mount}/secret"
    assert env["REDIS_PASSWORD_FILE"] == f"{cache_mount}/redis-password"
    (tmp_path / "secret").write_text("a-cache-secret-as-the-secret-holds-it-0123456789\n")
    (tmp_path / "redis-password").write_text("password\n")
    here = {k: v.replace(f"{cache_mount}/", f"{tmp_path}/") for k, v in env.items()}
    cfg = files.service_config("prefill", [], here)
    cache = build_prompt_cache(cfg, environ=here)  # would start: secret and password read, Redis remote but keyed
    assert cache.store.remote
    cache.close()

    (router,) = objs[("Deployment", "router")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in router["env"]}
    assert env["REDIS_ROUTER_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "pdserve-redis",
        "key": "router-password",
    }
    store = urlsplit(env["PDSERVE_ROUTER_ESTIMATOR_STORE"]["value"])
    assert (store.scheme, store.username, store.password) == ("rediss", "router", "$(REDIS_ROUTER_PASSWORD)")
    assert list(env).index("REDIS_ROUTER_PASSWORD") < list(env).index("PDSERVE_ROUTER_ESTIMATOR_STORE")  # $(...)


def test_images_are_named_by_the_overlay(files, rendered):
    """The manifests name logical images (`pdserve-cpu`, `pdserve-cuda`) that each overlay's `images:` maps to a
    real name and tag, so a registry is set in one place; nothing renders with a logical name left over."""
    kind, objs = rendered
    overlay = yaml.safe_load((files.DEPLOY / "k8s/overlays" / kind / "kustomization.yaml").read_text())
    mapped = {i["name"] for i in overlay["images"]}
    assert mapped == ({"pdserve-cpu", "pdserve-cuda"} if kind == "gpu" else {"pdserve-cpu"})
    images = {c["image"] for d in objs.values() for c in files.containers(d)}
    assert images == {"pdserve:cpu", "redis:7.4.1-alpine"} | ({"pdserve:cuda"} if kind == "gpu" else set())
    for path in (files.DEPLOY / "k8s/base").glob("*.yaml"):  # the base names only logical pdserve images
        for d in yaml.safe_load_all(path.read_text()):
            for c in files.containers(d or {}):
                assert c["image"] == "pdserve-cpu" or not c["image"].startswith("pdserve"), (path.name, c["image"])


def test_model_pvc_component_seeds_the_model_without_a_download(files, tmp_path):
    """components/model-pvc: router, prefill and decode mount the PVC `pdserve-model` read-only where the model
    is read from, run no init container (no download), and the loader pod fills that same claim."""
    comp = files.DEPLOY / "k8s/components/model-pvc"
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [str(files.DEPLOY / "k8s/overlays/cpu")], "components": [str(comp)]})
    )
    objs = {(d["kind"], d["metadata"]["name"]): d for d in files.kustomize(tmp_path)}
    pvc = objs[("PersistentVolumeClaim", "pdserve-model")]
    loader = yaml.safe_load((comp / "loader.yaml").read_text())
    for doc in (pvc, loader, *objs.values()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (loader_volume,) = loader["spec"]["volumes"]
    assert loader_volume["persistentVolumeClaim"]["claimName"] == "pdserve-model"
    for name in ("router", *ENGINES):
        pod = objs[("Deployment", name)]["spec"]["template"]["spec"]
        assert not pod.get("initContainers"), name
        (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert model == {"name": "model", "persistentVolumeClaim": {"claimName": "pdserve-model", "readOnly": True}}
        (c,) = pod["containers"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == env_of(objs, c)[f"PDSERVE_{name.upper()}_MODEL"] == "/models/model"
        assert loader["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == mount["mountPath"]
