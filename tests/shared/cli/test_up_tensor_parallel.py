"""`pdserve up --colocated 2 --tensor-parallel-size 2` on CPU (gloo), the real command (issue 31): each instance runs
as two processes (the service is rank 0, its child rank 1), answers with HF's greedy tokens, reports its TP size in
Stats and /metrics and traces one span per step from rank 0 only. Killing rank 1 of the instance serving a stream
takes that instance down (no process of it left) while the stream completes through the router's failover and the
stack keeps serving; Ctrl-C then ends every process."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.auth import new_token
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy, load_hf_model
from pdserve.testing.otlp_sink import OTLPSink
from pdserve.testing.up_process import read_banner, stop
from pdserve.v1 import internal_pb2, internal_pb2_grpc

sys.path.insert(0, str(Path(__file__).parents[2] / "services" / "router"))
from router_testutil import collect, instances, listing, wait_states

FLAGS = ["--page-size", "4", "--chunk-size", "8", "--num-pages", "256", "--kv-dtype", "auto", "--torch-threads", "1"]
PROMPT = [5 + (7 * i) % 200 for i in range(13)]  # two chunks


def listening_on(procs: list[psutil.Process], address: str) -> psutil.Process:
    """The process of `procs` listening on `address`'s port."""
    port = int(address.rsplit(":", 1)[1])
    for p in procs:
        if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp")):
            return p
    raise AssertionError(f"no process listens on {address}")


@pytest.mark.timeout(360)
def test_up_tp2_instances_on_cpu_fail_over_and_stop_every_rank(tmp_path, monkeypatch):
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    model = build_checkpoint(tmp_path / "ckpt", arch="llama", seed=4, **shape)
    monkeypatch.setenv(
        "PDSERVE_INTERNAL_TOKEN", new_token()
    )  # this test's Stats / Registry calls: the stack's identity
    tid = secrets.token_hex(16)
    with OTLPSink() as sink:
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        env["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # exported while the instance lives (one is killed below)
        for k in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER"):
            env.pop(k, None)
        up = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--colocated", "2", "--gpus", "none"]
        proc = subprocess.Popen(
            [*up, "--tensor-parallel-size", "2", "--port", "0", "--gateway-port", "-1", *FLAGS],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        try:
            banner = read_banner(proc, timeout_s=300, gateway=False)
            out = "".join(banner.lines)
            assert "colocated 0: tensor parallel 2" in out and "colocated 1: tensor parallel 2" in out, out
            up_line = re.search(r"pdserve is up: [^\n]*?; colocated ([^;\n]+?), kv", out)
            assert up_line, out
            addrs = up_line.group(1).split(", ")
            ready = dict(re.findall(r"PDSERVE_READY colocated (\S+) metrics=(\S+)", out))
            metrics = [ready.get(a) for a in addrs]
            assert len(addrs) == 2 and all(metrics), out
            services = psutil.Process(proc.pid).children()
            engines = {a: listening_on(services, a) for a in addrs}
            ranks = {a: p.children() for a, p in engines.items()}
            assert all(len(r) == 1 and "pdserve.engine.tp.follower" in r[0].cmdline() for r in ranks.values())
            wait_states(banner.internal, {a: "up" for a in addrs})

            traced = [("traceparent", f"00-{tid}-{secrets.token_hex(8)}-01")]
            with pdserve.Client(banner.router, timeout=120) as c:
                got = c.generate(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, metadata=traced)
            assert got.token_ids == hf_greedy(load_hf_model(model), PROMPT, 8)
            for a, m in zip(addrs, metrics):
                with channel(a) as ch:
                    stats = internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=10)
                assert stats.tensor_parallel_size == 2
                text = urllib.request.urlopen(f"http://{m}/metrics", timeout=10).read().decode()
                assert "pdserve_tensor_parallel_size 2.0" in text
            want = {"router.generate", "colocated.request", "colocated.prefill"}
            sink.wait_for(lambda s: want <= {x.name for x in s if x.trace_id == tid}, 30)

            # rank 1 of the instance serving a stream dies: the instance ends, the stream fails over
            kw = dict(token_ids=PROMPT, max_tokens=120, ignore_eos=True, temperature=0.0)
            with pdserve.Client(banner.router, timeout=120) as c:
                ref = collect(c.stream(**kw))
                retries = listing(banner.internal).retries
                stream = c.stream(**kw)
                head = []
                for chunk in stream:
                    head.append(chunk)
                    if sum(len(x.token_ids) for x in head) >= 8:
                        break
                (serving,) = [a for a, i in instances(banner.internal).items() if a in addrs and i.in_flight]
                ranks[serving][0].send_signal(signal.SIGKILL)
                rest = list(stream)
            assert sum(len(x.token_ids) for x in head) < kw["max_tokens"]  # the kill happened mid-stream
            assert collect(head + rest)["tokens"] == ref["tokens"]
            assert listing(banner.internal).retries == retries + 1
            _, left = psutil.wait_procs([engines[serving], *ranks[serving]], timeout=30)
            assert not left, f"processes {[p.pid for p in left]} of the dead instance survived"
            (other,) = [a for a in addrs if a != serving]
            wait_states(banner.internal, {serving: "down", other: "up"})
            with pdserve.Client(banner.router, timeout=120) as c:  # the stack keeps serving with the other one
                assert c.generate(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids == (
                    got.token_ids
                )
            assert proc.poll() is None, "pdserve up stopped when one of two instances died"
            stop(proc, timeout_s=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
    survivors = [engines[other], *ranks[other], *[p for p in services if p not in engines.values()]]
    _, left = psutil.wait_procs(survivors, timeout=15)
    assert not left, f"processes {[p.pid for p in left]} outlived the stack"
    assert re.search(r"colocated instance \(pid \d+\) exited with code 17", "".join(banner.lines))
    # one trace: the router's span, and from one instance one request span and one prefill span (rank 0's)
    trace = sorted((s.service, s.name) for s in sink.spans() if s.trace_id == tid)
    assert trace == [
        ("pdserve-colocated", "colocated.prefill"),
        ("pdserve-colocated", "colocated.request"),
        ("pdserve-router", "router.generate"),
    ], trace
