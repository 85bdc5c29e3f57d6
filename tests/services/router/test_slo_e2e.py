"""SLO-aware admission on the CPU stack (real processes): two routers over the same colocated instance, one with
targets nothing can meet, one with targets everything meets. The strict router's budget factor falls (metrics),
its admission then rejects a burst with RESOURCE_EXHAUSTED that the lenient router admits whole, and once the
traffic stops the factor relaxes back to 1."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from services_testutil import tiny_stack

import pdserve
from pdserve.cli.launch import start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.wait import wait_until

pytestmark = pytest.mark.timeout(600)
STRICT = [
    "--slo-ttft-ms",
    "0.001",
    "--slo-tpot-ms",
    "0.001",
    "--slo-min-samples",
    "3",
    "--slo-interval-s",
    "0.1",
    # the relax-back at the end waits for a window without samples: short, yet far longer than the gaps between
    # the samples that take the factor down (sub-second) and the burst that finds it at its floor
    "--slo-window-s",
    "4",
    "--slo-decrease",
    "0.3",
    "--slo-min-factor",
    "0.1",
    "--slo-increase",
    "0.3",
    "--stats-interval-s",
    "0.1",
]
LENIENT = ["--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000"]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scrape(metrics_addr: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("pdserve_slo")
    }


def factor(metrics_addr: str, instance: str, metric: str) -> float | None:
    return scrape(metrics_addr).get(("pdserve_slo_budget_factor", (("address", instance), ("metric", metric))))


def burst(router: str, n: int = 8, prompt_len: int = 300, seed: int = 100, max_tokens: int = 200) -> list[str]:
    """n concurrent requests; the status of each (OK or the gRPC code). Each holds (300 + 200) / 4 = 125 KV pages
    while it runs: the strict router's pool share at factor 0.1 (410 of 4096 pages) holds three at once."""

    def one(i: int) -> str:
        with pdserve.Client(router, timeout=120, retry=False) as c:  # see the rejections, not the SDK's retries
            try:
                c.generate(
                    token_ids=prompt(prompt_len, seed=seed + i), max_tokens=max_tokens, temperature=0, ignore_eos=True
                )
                return "OK"
            except grpc.RpcError as e:
                return e.code().name

    with cf.ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


@contextmanager
def strict_router(model, inst: str, work, token: str) -> Iterator[str]:
    """A second router over the stack's colocated instance, with the STRICT targets (and the stack's internal
    token: it calls the instance's Stats)."""
    args = ["--model", str(model), "--colocated", inst, "--metrics-port", "0", *STRICT]
    proc, ready, log = start_service("router", args, work, env={"PDSERVE_INTERNAL_TOKEN": token})
    try:
        yield wait_ready(proc, ready, log)
    finally:
        proc.terminate()
        proc.wait(20)


def test_budget_tightens_under_a_violated_slo_and_relaxes_back(tmp_path):
    model = build_checkpoint(tmp_path / "model", arch="llama", seed=6)
    with tiny_stack(
        model,
        tmp_path / "stack",
        kv_dtype="auto",
        page_size=4,
        chunk_size=64,
        num_pages=4096,
        num_colocated=1,
        router_extra=LENIENT,
    ) as stack:
        (inst,) = stack.colocated
        with strict_router(model, inst, tmp_path, stack.internal_token) as strict:
            strict_metrics = json.loads((tmp_path / "router0.json").read_text())["metrics"]
            wait_until(lambda: factor(strict_metrics, inst, "ttft") == 1.0, timeout=10)  # the configured budget
            # every request misses a 1 µs TTFT: two rounds of 3 fresh samples take the factor to its floor
            for r in range(3):
                assert burst(strict, n=3, prompt_len=8, seed=10 * r, max_tokens=3) == ["OK"] * 3
                if r < 2:
                    want = (0.3, 0.1)[r]
                    wait_until(lambda w=want: factor(strict_metrics, inst, "ttft") == pytest.approx(w), timeout=10)
            for metric in ("ttft", "tpot"):  # TPOT samples come at the end of requests: maybe an update later
                wait_until(
                    lambda m=metric: factor(strict_metrics, inst, m) == pytest.approx(0.1), timeout=10, what=metric
                )

            strict_statuses = burst(strict)  # while its samples say the SLO is missed
            lenient = burst(stack.router)
            print(f"burst: strict {strict_statuses}, lenient {lenient}")
            assert "RESOURCE_EXHAUSTED" in strict_statuses and "OK" in strict_statuses
            assert set(strict_statuses) <= {"OK", "RESOURCE_EXHAUSTED"}
            assert lenient == ["OK"] * len(lenient)
            m = scrape(strict_metrics)
            assert m[("pdserve_slo_requests_total", (("result", "missed"),))] == 9 + strict_statuses.count("OK")
            observed = m[("pdserve_slo_observed_seconds", (("address", inst), ("metric", "ttft")))]
            assert 0 < observed < 60
            assert m[("pdserve_slo_target_seconds", (("metric", "ttft"),))] == pytest.approx(1e-6)

            # no traffic for a window: the controller probes back up to the configured budget
            for metric in ("ttft", "tpot"):
                wait_until(
                    lambda m=metric: factor(strict_metrics, inst, m) == 1.0, timeout=60, interval=0.1, what=metric
                )
