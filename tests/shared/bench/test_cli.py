"""`pdserve bench` flags, run in-process against the paced server: trace replay, concurrency and duration runs,
token pass-through, errors in the report, a dead target, usage errors."""

from __future__ import annotations

import json

import pytest
from pace_server import PaceServer

from pdserve.bench.cli import cmd_bench

FAST = ["--vocab-size", "1000", "--workers", "1", "--no-progress"]


def test_trace_replay_with_token_and_errors(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    lens = [(0.00, 30, 4), (0.02, 7, 4), (0.03, 50, 6), (0.05, 31, 1)]
    trace.write_text(
        "".join(json.dumps({"arrival_s": t, "input_tokens": i, "output_tokens": o}) + "\n" for t, i, o in lens)
    )
    out = tmp_path / "r.json"
    with PaceServer(0.01, 0.002, reject_len=7) as server:
        rc = cmd_bench(["--target", server.target, "--trace", str(trace), "--warmup", "0", "--token", "tok",
                        "--json", str(out), *FAST])  # fmt: skip
        assert server.servicer.authorization == ["Bearer tok"] * 4
        assert sorted(len(p) for p in server.servicer.prompts) == [7, 30, 31, 50]
    assert rc == 0
    doc = json.loads(out.read_text())
    assert "--token '***'" in doc["command"] and "tok " not in doc["command"]
    (run,) = doc["runs"]
    assert run["trace"] == str(trace) and run["rate"] is None
    s = run["summary"]
    assert s["num_requests"] == 4 and s["errors"] == {"INVALID_ARGUMENT": 1} and s["completed"] == 3
    assert s["slo_attainment"] == pytest.approx(0.75) and doc["sweep"]["max_rate_meeting_slo"] is None
    cols = run["requests"]["columns"]
    scheduled = [r[cols.index("scheduled_s")] for r in run["requests"]["rows"]]
    assert scheduled == [0.0, 0.02, 0.03, 0.05]
    printed = capsys.readouterr().out
    assert "trace" in printed and "INVALID_ARGUMENT" in printed
    with PaceServer(0.0, 0.001) as server:  # --num-requests takes the trace's first N; warm-up: the trace's lengths
        assert cmd_bench(["--target", server.target, "--trace", str(trace), "--num-requests", "2", "--warmup", "3",
                          "--json", str(out), *FAST]) == 0  # fmt: skip
        assert sorted(len(p) for p in server.servicer.prompts) == [7, 7, 30, 30, 30]  # warm-up 30, 7, 30
    with pytest.raises(SystemExit):  # --append checks the file first: another SLO
        cmd_bench(["--target", "127.0.0.1:1", "--rate", "1", "--slo-ttft-ms", "100", "--json", str(out), "--append",
                   *FAST])  # fmt: skip


def test_concurrency_sweep_by_duration_and_rate_by_duration(tmp_path):
    out = tmp_path / "c.json"
    common = ["--input-dist", "fixed:10", "--output-dist", "fixed:5", "--warmup", "2", "--json", str(out), *FAST]
    with PaceServer(0.02, 0.005) as server:
        assert cmd_bench(["--target", server.target, "--concurrency", "1,3", "--duration", "0.3", *common]) == 0
        doc = json.loads(out.read_text())
        assert [r["concurrency"] for r in doc["runs"]] == [1, 3] and doc["warmup"]["requests"] == 2
        n1, n3 = (r["summary"]["num_requests"] for r in doc["runs"])
        assert 1 <= n1 < n3  # three streams send more in the same time
        assert all(r["summary"]["completed"] == r["summary"]["num_requests"] for r in doc["runs"])
        assert cmd_bench(["--target", server.target, "--rate", "40", "--duration", "0.5", *common]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    cols = run["requests"]["columns"]
    scheduled = [r[cols.index("scheduled_s")] for r in run["requests"]["rows"]]
    assert 5 <= len(scheduled) <= 45 and max(scheduled) < 0.5


def test_dead_target_fails_in_warmup(capsys):
    rc = cmd_bench(["--target", "127.0.0.1:1", "--rate", "1", "--timeout", "5", "--warmup", "1", *FAST])
    assert rc == 1 and "every warm-up request failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "1", "--append"],  # --append without --json
        ["--rate", "0"],
        ["--rate", "1", "--input-dist", "lognormal:1,2"],
        ["--rate", "1", "--concurrency", "2"],  # one load only
        ["--rate", "1", "--trace", "/nonexistent.jsonl"],
        ["--trace", "/nonexistent.jsonl"],
        ["--concurrency", "0"],
    ],
)
def test_usage_errors(args):
    with pytest.raises(SystemExit) as e:
        cmd_bench(["--target", "127.0.0.1:1", *args, *FAST])
    assert e.value.code == 2


def _parse(*flags: str):
    from pdserve.bench.cli import parser

    return parser().parse_args(["--target", "h:1", "--rate", "1", "--vocab-size", "10", *flags])


def test_slo_presets_and_overrides():
    from pdserve.bench.cli import parser, slo_of

    assert (slo_of(_parse()).ttft_ms, slo_of(_parse()).tpot_ms) == (350.0, 15.0)  # GPU figures by default
    cpu = slo_of(_parse("--slo-preset", "cpu"))
    assert cpu.ttft_ms > 350.0 and cpu.tpot_ms > 15.0
    mixed = slo_of(_parse("--slo-preset", "cpu", "--slo-tpot-ms", "40", "--slo-attainment", "0.5"))
    assert (mixed.ttft_ms, mixed.tpot_ms, mixed.attainment) == (cpu.ttft_ms, 40.0, 0.5)
    helptext = parser().format_help()
    assert "GPU figures" in helptext and "--slo-preset" in helptext and "cpu" in helptext
    with pytest.raises(SystemExit):
        _parse("--slo-preset", "tpu")


def test_no_run_meeting_the_slo_says_so(capsys):
    with PaceServer(0.03, 0.002) as server:  # TTFT 30 ms: above a 5 ms SLO, below a 5 s one
        common = ["--target", server.target, "--rates", "20,40", "--num-requests", "4", "--warmup", "0",
                  "--input-dist", "fixed:5", "--output-dist", "fixed:3", *FAST]  # fmt: skip
        assert cmd_bench([*common, "--slo-ttft-ms", "5"]) == 0
        out = capsys.readouterr().out
        assert "no rate met the SLO (TTFT <= 5 ms and TPOT <= 15 ms" in out and "--slo-preset cpu" in out
        assert cmd_bench([*common, "--slo-preset", "cpu"]) == 0
        out = capsys.readouterr().out
        assert "no rate met" not in out and "highest rate with >= 90% of requests meeting TTFT <= 5000 ms" in out
        assert cmd_bench([*common[:2], "--concurrency", "1", *common[4:], "--slo-preset", "cpu",
                          "--slo-tpot-ms", "0.001"]) == 0  # fmt: skip
        out = capsys.readouterr().out
        assert "no run met the SLO" in out and "raise --slo-ttft-ms / --slo-tpot-ms" in out


def _run(lag_p99: float | None, tokens_per_s: float) -> dict:
    return {"rate": 1.0, "summary": {"client_lag_ms": {"p99": lag_p99}, "output_tokens_per_s": tokens_per_s}}


def test_lag_warning_names_the_cause():
    from pdserve.bench.cli import LAG_WARN_MS, WORKER_TOKENS_PER_S, lag_warning

    assert lag_warning(_run(None, 0.0), 1) is None and lag_warning(_run(LAG_WARN_MS, 1e6), 1) is None
    starved = lag_warning(_run(80.0, 30.0), 1)  # 1 req/s of a slow CPU server: the client had nothing to read
    assert starved is not None and "80 ms late" in starved and "raise --workers" not in starved
    assert "short of CPU" in starved
    busy = lag_warning(_run(80.0, 3 * WORKER_TOKENS_PER_S), 2)  # each process reads 1.5x what it can
    assert busy is not None and busy.endswith("raise --workers") and "1 req/s" in busy
    assert "raise --workers" not in (lag_warning(_run(80.0, 3 * WORKER_TOKENS_PER_S), 4) or "")
