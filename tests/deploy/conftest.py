"""Helpers of the deploy/ checks: compose interpolation, kustomize rendering, the pdserve commands the files run."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from pdserve.cli.main import _service
from pdserve.config import add_dataclass_args, config_from, settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = ("router", "prefill", "decode", "gateway")
# read by code outside the config dataclasses: the health command, the demo-model step, the prompt cache, tracing
OTHER_ENV = {"PDSERVE_HEALTH_TARGET", "PDSERVE_MODEL_DIR", "PDSERVE_CACHE_DIR", "REDIS_URL"}
# the stack-wide security settings (pdserve.server.security) and the certificate step's output folder
OTHER_ENV |= {"PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA", "PDSERVE_TLS_SERVER_NAME"}
OTHER_ENV |= {"PDSERVE_INTERNAL_TOKEN_FILE", "PDSERVE_CERTS_DIR"}
OTHER_ENV |= {"PDSERVE_CACHE_SECRET_FILE"}  # the prompt cache's secret (pdserve.cache.value_auth), stack-wide


@pytest.fixture(scope="session")
def files():
    """This module: the tests reach the helpers through it (test files here are no package to import from)."""
    return sys.modules[__name__]


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR, $$ (a literal $)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        return env.get(name) or (m.group(2) or "")

    return _VAR.sub(sub, value)


def load_compose(env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()), env or {})


def env_file() -> dict[str, str]:
    lines = (DEPLOY / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def enabled(compose: dict, profiles: set[str]) -> dict:
    """The services `docker compose` starts with these profiles active."""
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or profiles & set(s["profiles"])}


def service_config(service: str, argv: list[str], environ: dict[str, str]):
    """Build a service's config with its real parser and environment handling (raises on unknown flags)."""
    cls, prefix = _service(service)
    parser = argparse.ArgumentParser(prog=f"pdserve serve {service}", exit_on_error=False)
    add_dataclass_args(parser, cls)
    return config_from(cls, parser.parse_args(argv), prefix, environ=environ)


def check_env_names(service: str, environ: dict[str, str]) -> None:
    """Every PDSERVE_* variable is a field of this service's config (or read elsewhere, OTHER_ENV)."""
    cls, prefix = _service(service)
    fields = {s.env(prefix) for s in settings(cls)}
    for name in environ:
        if name.startswith("PDSERVE_"):
            assert name in fields or name in OTHER_ENV, f"{service}: {name} is no setting of {cls.__name__}"


def prefill_redis_query(redis_url: str) -> dict[str, str]:
    """Check prefill's REDIS_URL: TLS (`rediss`) to redis:6379 as ACL user `prefill`, no password in the URL (it
    comes from a file); return the URL's query (the TLS file settings), one value a key."""
    url = urlsplit(redis_url)
    assert (url.scheme, url.username, url.password, url.hostname, url.port) == (
        "rediss",
        "prefill",
        None,
        "redis",
        6379,
    )
    return {k: v[0] for k, v in parse_qs(url.query).items()}


def kustomize(directory: Path) -> list[dict]:
    """Render a kustomization (the parts used here: resources, components, labels, images, strategic-merge
    patches)."""
    docs: list[dict] = []
    return _apply(directory, yaml.safe_load((directory / "kustomization.yaml").read_text()), docs)


def _apply(directory: Path, k: dict, docs: list[dict]) -> list[dict]:
    """Add `k`'s resources to `docs`, then apply its components (in order) and its own patches, images, labels."""
    for res in k.get("resources", []):
        path = directory / res
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for comp in k.get("components", []):
        component = yaml.safe_load((directory / comp / "kustomization.yaml").read_text())
        assert component["kind"] == "Component", f"{comp}: not a kustomize Component"
        _apply(directory / comp, component, docs)
    for patch in k.get("patches", []):
        for p in yaml.safe_load_all((directory / patch["path"]).read_text()):
            matches = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"])]
            assert len(matches) == 1, f"patch {patch['path']}: {p['kind']}/{p['metadata']['name']} not in resources"
            merge(matches[0], p)
    for image in k.get("images", []):
        for d in docs:
            for c in containers(d):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for group in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(group["pairs"])
    return docs


def merge(base: dict, patch: dict) -> None:
    """Strategic merge as kustomize does it for these files: maps merge, lists of named maps merge by name (an
    item `{name: X, $patch: delete}` removes X), null deletes a field."""
    for key, value in patch.items():
        old = base.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            merge(old, value)
        elif isinstance(old, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            by_name = {o["name"]: o for o in old}
            for v in value:
                if v.get("$patch") == "delete":
                    old.remove(by_name[v["name"]])
                elif v["name"] in by_name:
                    merge(by_name[v["name"]], v)
                else:
                    old.append(v)
        elif value is None:  # `field: null` deletes it
            base.pop(key, None)
        else:
            base[key] = value


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])
