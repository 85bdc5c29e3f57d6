"""The fault suite's harness: its counters on hand-made outcomes (lost, duplicated, wrong tokens; unexpected
statuses), and `bench/reliability.py` itself run as its one command on a small stack with tiny counts: anonymous
internal calls, malformed requests, duplicate request ids, a long prompt beside short requests and greedy streams
under load (alone vs together, per KV mode), each with its record in the JSON and at its targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.testing.stream_audit import TARGETS, Outcome, Result, Tally, align

ROOT = Path(__file__).resolve().parents[3]
COUNTERS = ("requests", "completed", *TARGETS)


def ok(tokens, usage=None) -> Outcome:
    return Outcome(tokens=list(tokens), finish=2, usage_completion=len(tokens) if usage is None else usage)


def test_align_counts_missing_extra_and_replaced_tokens():
    ref = [1, 2, 3, 4, 5, 6]
    assert align(ref, ref) == (0, 0, 0)
    assert align([1, 2, 5, 6], ref) == (2, 0, 0)  # 3, 4 lost
    assert align([1, 2, 3, 4, 3, 4, 5, 6], ref) == (0, 2, 0)  # 3, 4 sent twice
    assert align([1, 2, 9, 4, 5, 6], ref) == (0, 0, 1)


def test_tally_judges_outputs_statuses_and_usage():
    ref = [10, 11, 12, 13]
    t = Tally()
    t.add(ok(ref), ["OK"], ref, must_complete=True)  # exact
    t.add(ok([10, 11, 13]), ["OK"], ref, must_complete=True)  # one lost
    t.add(ok([10, 11, 11, 12, 13]), ["OK"], ref, must_complete=True)  # one duplicated
    t.add(ok(ref, usage=5), ["OK"], ref, must_complete=True)  # the server counted a token nobody got
    t.add(Outcome(tokens=[10, 11], code="UNAVAILABLE"), ["OK"], ref, must_complete=True)  # cut: tail lost
    t.add(Outcome(tokens=[10, 11], code="CANCELLED"), ["CANCELLED"], ref, must_complete=False)  # by design
    t.add(Outcome(tokens=[10, 99], code="CANCELLED"), ["CANCELLED"], ref, must_complete=False)  # wrong token
    garbage = Outcome(tokens=[7], code="DATA_LOSS")  # a refused request that still generated
    t.add(garbage, ["DATA_LOSS"], None, must_complete=False)
    t.no_tokens(garbage)
    t.refusal("OK", ["UNAUTHENTICATED"])  # an internal call that was served
    assert t.counters() == dict(
        requests=9, completed=5, lost_tokens=1 + 1 + 2, duplicated_tokens=1, wrong_outputs=5, wrong_status=2,
        leaked_pages=0,
    )  # fmt: skip
    assert t.statuses == {"OK": 5, "UNAVAILABLE": 1, "CANCELLED": 2, "DATA_LOSS": 1}


def test_a_scenario_passes_only_at_its_targets_and_when_exercised():
    t = Tally()
    t.add(ok([1, 2]), ["OK"], [1, 2], must_complete=True)
    assert Result(t, {"s": ["OK"]}).record(1.0)["passed"]
    assert not Result(t, {"s": ["OK"]}, exercised=False).record(1.0)["passed"]
    assert not Result(t, {"s": ["OK"]}, {"leaked_requests": 1}).record(1.0)["passed"]
    t.leaked_pages = 3
    assert not Result(t, {"s": ["OK"]}).record(1.0)["passed"]


@pytest.mark.timeout(420)
def test_the_suite_command_on_a_small_stack(tmp_path):
    """The one command, end to end: a router, one prefill and one decode as processes, a private Redis."""
    out = tmp_path / "reliability.json"
    scenarios = ["anonymous_internal", "malformed_inputs", "duplicate_ids", "long_prompt_fairness", "greedy_under_load"]
    cmd = [sys.executable, str(ROOT / "bench" / "reliability.py"), "--json", str(out), "--instances", "1,1"]
    cmd += ["--scenarios", ",".join(scenarios), "--scale", "0.02", "--work", str(tmp_path / "work")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.reliability/1" and set(doc["scenarios"]) == set(scenarios)
    for name, rec in doc["scenarios"].items():
        assert "error" not in rec, (name, rec.get("traceback"))
        assert all(isinstance(rec[k], int) for k in COUNTERS), (name, rec)
        assert sum(rec["statuses"].values()) == rec["requests"] > 0, (name, rec)
        assert rec["passed"], (name, {k: v for k, v in rec.items() if k not in ("expected_statuses", "commit")})
    anon = doc["scenarios"]["anonymous_internal"]
    assert anon["completed"] == 0 and anon["impostor_prefill_calls"] == 0  # every anonymous call refused
    dup = doc["scenarios"]["duplicate_ids"]
    assert dup["completed"] >= dup["requests"] // 2  # every first request of a pair, exact
    fair = doc["scenarios"]["long_prompt_fairness"]
    assert fair["exercised"] and fair["chunk_ms"] > 0 and len(fair["short_ttft_ms_beside"]) >= 6
    greedy = doc["scenarios"]["greedy_under_load"]
    assert greedy["differing_auto"] == 0 and "differing_int8" in greedy
