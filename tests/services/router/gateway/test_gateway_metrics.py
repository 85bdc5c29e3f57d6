"""The gateway's `GET /metrics` (Prometheus text): a completion moves the request counter of its route and status
and the latency histogram; an unknown URL counts under "unmatched"; OpenMetrics when the scraper asks for it."""

from __future__ import annotations

import http.client
import json

import pytest
from gateway_testutil import post, running_gateway, scripted_router
from prometheus_client.parser import text_string_to_metric_families

COMPLETIONS = 'pdserve_gateway_requests_total{method="POST",route="/v1/completions",status="200"}'


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with scripted_router() as (_, router), running_gateway(router, tmp_path_factory.mktemp("gw-metrics")) as gw:
        yield gw


def scrape(gateway: tuple[str, int], accept: str = "") -> tuple[str, str]:
    """(content type, body) of GET /metrics."""
    conn = http.client.HTTPConnection(*gateway, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"accept": accept} if accept else {})
        r = conn.getresponse()
        assert r.status == 200
        return r.getheader("content-type", ""), r.read().decode()
    finally:
        conn.close()


def samples(text: str) -> dict[str, float]:
    """`name{label="v",...}` (labels sorted) -> value, for every sample in Prometheus text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_completion_moves_counter_and_histogram(gateway):
    content_type, before_text = scrape(gateway)
    assert content_type.startswith("text/plain")
    before = samples(before_text)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    status, answer = post(gateway, "/v1/completions", body)
    assert status == 200 and answer["choices"][0]["text"] == "hello"
    after = samples(scrape(gateway)[1])
    assert after[COMPLETIONS] == before.get(COMPLETIONS, 0.0) + 1
    hist = 'pdserve_gateway_request_duration_seconds_count{route="/v1/completions"}'
    assert after[hist] == before.get(hist, 0.0) + 1


def test_errors_and_unknown_urls_are_counted(gateway):
    bad = json.dumps({"model": "m", "prompt": "invalid:temperature must be >= 0"}).encode()
    assert post(gateway, "/v1/completions", bad)[0] == 400
    for _ in range(2):
        assert post(gateway, "/no/such/url", b"{}")[0] == 404
    after = samples(scrape(gateway)[1])
    assert after['pdserve_gateway_requests_total{method="POST",route="/v1/completions",status="400"}'] >= 1
    assert after['pdserve_gateway_requests_total{method="POST",route="unmatched",status="404"}'] == 2
    assert not any("/no/such/url" in name for name in after)


def test_openmetrics_on_request(gateway):
    content_type, text = scrape(gateway, accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF") and "pdserve_gateway_requests_total" in text
