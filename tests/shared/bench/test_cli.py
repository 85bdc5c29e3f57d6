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
