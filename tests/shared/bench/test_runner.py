"""pdserve.bench.runner against a gRPC server of known pace (pace_server): what it sends, what it measures, open and
closed loops, errors by status, and the split over worker processes."""

from __future__ import annotations

import asyncio
import statistics

import pytest
from pace_server import PaceServer

from pdserve.bench.report import e2e_ms, tpot_ms, ttft_ms
from pdserve.bench.runner import ClientOptions, Load, run_load, run_workers, split
from pdserve.bench.workload import LengthDist, PromptMaker, RequestSpec, SpecStream, Vocabulary

TTFT_S, INTERVAL_S = 0.05, 0.01
PROMPTS = PromptMaker(Vocabulary.from_size(1000, first_id=5), nonce=1)


def open_specs(n: int, gap_s: float = 0.01, out: int = 5) -> list[RequestSpec]:
    return [RequestSpec(i, 20 + i, out, i * gap_s) for i in range(n)]


def max_in_flight(records) -> int:
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def test_open_loop_times_and_sends_exactly():
    with PaceServer(TTFT_S, INTERVAL_S) as server:
        records = asyncio.run(run_load(Load(open_specs(20)), PROMPTS, ClientOptions(server.target)))
        prompts = server.servicer.prompts
    assert [r.index for r in records] == list(range(20))
    for r in records:
        assert r.status == "OK" and r.tokens == 5 and r.finish_reason == "length"
        assert r.send_s >= r.scheduled_s  # never early
        assert ttft_ms(r) >= TTFT_S * 1e3  # the server cannot answer sooner
        assert e2e_ms(r) >= (TTFT_S + 4 * INTERVAL_S) * 1e3  # the last token cannot come sooner
    # one request's TPOT can undershoot the pace (a late first token shortens its span): the median tells the pace,
    # within bounds loose enough for a busy machine (the precise figure: docs/benchmarks.md, client capacity)
    assert 0.3 * INTERVAL_S * 1e3 < statistics.median(tpot_ms(r) for r in records) < 20 * INTERVAL_S * 1e3
    assert sorted(len(p) for p in prompts) == [20 + i for i in range(20)]  # exact prompt lengths
    assert len({tuple(p[:16]) for p in prompts}) == 20  # fresh: no shared first page


def test_errors_are_recorded_by_status():
    specs = [RequestSpec(0, 7, 3, 0.0), RequestSpec(1, 8, 3, 0.0), RequestSpec(2, 9, 3, 0.0)]
    with PaceServer(0.0, 0.001, reject_len=7, busy_len=8) as server:
        records = asyncio.run(run_load(Load(specs), PROMPTS, ClientOptions(server.target)))
    assert [r.status for r in records] == ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "OK"]
    assert records[0].error == "rejected length" and records[0].tokens == 0
    down = asyncio.run(run_load(Load(specs[:1]), PROMPTS, ClientOptions("127.0.0.1:1", timeout_s=5)))
    assert down[0].status in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_token_and_tls_pass_through(tmp_path):
    from pdserve.testing.certs import CertAuthority

    pki = CertAuthority.create(tmp_path / "pki")
    specs = open_specs(2)
    with PaceServer(0.0, 0.001, tls=pki.issue("router")) as server:
        opts = ClientOptions(server.target, token="s3cret", tls_ca=str(pki.ca_path))
        records = asyncio.run(run_load(Load(specs), PROMPTS, opts))
        plain = asyncio.run(run_load(Load(specs), PROMPTS, ClientOptions(server.target, timeout_s=5)))
        assert server.servicer.authorization == ["Bearer s3cret"] * 2
    assert [r.status for r in records] == ["OK", "OK"]
    assert all(r.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") for r in plain)  # plaintext to a TLS server


def test_closed_loop_holds_the_concurrency():
    stream = SpecStream(LengthDist.parse("uniform:5,30"), LengthDist.parse("fixed:4"), 0, 12)
    with PaceServer(0.02, INTERVAL_S) as server:
        records = asyncio.run(run_load(Load(stream, concurrency=3), PROMPTS, ClientOptions(server.target)))
    assert [r.index for r in records] == list(range(12)) and all(r.scheduled_s is None for r in records)
    assert max_in_flight(records) == 3


def test_closed_loop_by_duration_stops_sending():
    stream = SpecStream(LengthDist.parse("fixed:10"), LengthDist.parse("fixed:5"), 0)  # endless
    with PaceServer(TTFT_S, INTERVAL_S) as server:
        records = asyncio.run(
            run_load(Load(stream, concurrency=2, duration_s=0.3), PROMPTS, ClientOptions(server.target))
        )
    # each request lasts >= 90 ms: at most 4 rounds of 2 streams start within 0.3 s, none after (the check comes just
    # before the send's timestamp: 0.1 s of slack for a busy machine)
    assert 2 <= len(records) <= 8 and max(r.send_s for r in records) < 0.4
    assert all(r.status == "OK" for r in records)


def test_split_shares():
    specs = open_specs(10)
    shares = split(Load(specs), 3)
    assert [[s.index for s in sh.specs] for sh in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    stream = SpecStream(LengthDist.parse("fixed:3"), LengthDist.parse("fixed:3"), 0, 10)
    shares = split(Load(stream, concurrency=5), 2)
    assert [sh.concurrency for sh in shares] == [2, 3]
    assert [[s.index for s in sh.specs] for sh in shares] == [[0, 1, 5, 6], [2, 3, 4, 7, 8, 9]]
    assert len(split(Load(stream, concurrency=2), 8)) == 2  # no idle workers


@pytest.mark.parametrize("closed", [False, True])
def test_worker_processes(closed):
    done = []
    if closed:
        load = Load(SpecStream(LengthDist.parse("fixed:12"), LengthDist.parse("fixed:4"), 0, 9), concurrency=3)
    else:
        load = Load(open_specs(9, gap_s=0.02, out=4))
    with PaceServer(0.02, INTERVAL_S) as server:
        records = run_workers(load, PROMPTS, ClientOptions(server.target), workers=2, on_done=done.append)
        assert len({tuple(p[:16]) for p in server.servicer.prompts}) == 9
    assert [r.index for r in records] == list(range(9)) and sum(done) == 9
    assert [(r.status, r.tokens) for r in records] == [("OK", 4)] * 9
    assert min(ttft_ms(r) for r in records) >= 20
    if not closed:  # one clock for all workers: never early, and late only by the (shared, busy) machine's delays
        lags = [r.send_s - r.scheduled_s for r in records]
        assert 0 <= min(lags) and max(lags) < 5.0, lags
    else:
        assert max_in_flight(records) <= 3
