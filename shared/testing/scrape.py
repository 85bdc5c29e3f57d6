"""A service's Prometheus /metrics read back as numbers (tests and diagnostics)."""

from __future__ import annotations

import urllib.request


def metric_samples(metrics_address: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Every sample of `http://<metrics_address>/metrics`, summed over labels: {sample name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out
