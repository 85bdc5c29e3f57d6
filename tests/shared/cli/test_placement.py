"""`pdserve up` GPU placement as a pure plan, and the placement flags reaching EngineConfig (CPU)."""

import argparse
import subprocess
import sys

import pytest

from pdserve.cli.launch import DECODE, PREFILL, Placement, parse_gpus, plan_placement
from pdserve.config import add_dataclass_args, config_from
from pdserve.decode.config import DecodeConfig


def where(plan):
    return [(p.role, p.index, p.gpu, round(p.memory_fraction or 0, 4)) for p in plan]


def test_no_gpus_leaves_the_device_to_each_engine():
    plan = plan_placement(2, 1, [], 0.85)
    assert [p.args() for p in plan] == [[], [], []]
    assert [(p.role, p.index) for p in plan] == [(PREFILL, 0), (PREFILL, 1), (DECODE, 0)]


def test_one_prefill_one_decode_on_two_gpus_each_its_own():
    plan = plan_placement(1, 1, [0, 1], 0.85)
    assert where(plan) == [(PREFILL, 0, 0, 0.85), (DECODE, 0, 1, 0.85)]
    assert plan[0].args() == ["--device", "cuda:0", "--gpu-memory-utilization", "0.8500"]
    assert plan[1].args()[:2] == ["--device", "cuda:1"]


def test_roles_get_disjoint_gpus_and_round_robin_within():
    # 2 prefill + 2 decode on 2 GPUs: prefill never shares a GPU with decode; two per GPU split its memory
    assert where(plan_placement(2, 2, [0, 1], 0.9)) == [
        (PREFILL, 0, 0, 0.45),
        (PREFILL, 1, 0, 0.45),
        (DECODE, 0, 1, 0.45),
        (DECODE, 1, 1, 0.45),
    ]
    # 1 prefill + 3 decode on 4 GPUs (named, not 0-based): one each
    assert [p.gpu for p in plan_placement(1, 3, [4, 5, 6, 7])] == [4, 5, 6, 7]
    # 1 prefill + 3 decode on 2 GPUs: prefill alone on the first, the decodes share the second
    plan = plan_placement(1, 3, [2, 3], 0.9)
    assert where(plan) == [(PREFILL, 0, 2, 0.9), (DECODE, 0, 3, 0.3), (DECODE, 1, 3, 0.3), (DECODE, 2, 3, 0.3)]


def test_one_gpu_is_shared_and_never_oversubscribed():
    plan = plan_placement(1, 1, [0], 0.9)
    assert where(plan) == [(PREFILL, 0, 0, 0.45), (DECODE, 0, 0, 0.45)]  # not 0.9 each
    for n_pre, n_dec, gpus in ((3, 2, [0, 1]), (1, 4, [0]), (2, 5, [0, 1, 2])):
        plan = plan_placement(n_pre, n_dec, gpus, 0.85)
        for g in gpus:
            assert sum(p.memory_fraction for p in plan if p.gpu == g) == pytest.approx(0.85)
        assert {p.gpu for p in plan if p.role == PREFILL}.isdisjoint({p.gpu for p in plan if p.role == DECODE}) or (
            len(gpus) == 1
        )


def test_bad_plans_and_gpu_lists_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        plan_placement(1, 1, [0, 0])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_placement(1, 1, [0], 1.5)
    assert parse_gpus("", lambda: [0, 1, 2]) == [0, 1, 2]
    assert parse_gpus("none", lambda: [0, 1]) == []
    assert parse_gpus(" 1,3 ", lambda: []) == [1, 3]
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus("gpu0", lambda: [])


def test_placement_flags_reach_engine_config():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DecodeConfig)
    args = ["--model", "m", *Placement(DECODE, 0, 1, 0.425).args()]
    cfg = config_from(DecodeConfig, parser.parse_args(args), "PDSERVE_TEST_UNUSED_")
    ec = cfg.engine
    assert (ec.device, ec.gpu_memory_utilization, ec.cuda_graph_max_context) == ("cuda:1", 0.425, 0)
    ec.validate()


def test_visible_gpus_asks_torch_in_a_child_only_where_a_gpu_driver_is(monkeypatch, tmp_path):
    from pdserve.cli import launch

    asked = []

    def probe(cmd, **kw):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="2\n", stderr="")

    monkeypatch.setattr(launch.subprocess, "run", probe)
    monkeypatch.setattr(launch, "GPU_DEVICE_NODES", (str(tmp_path / "nvidiactl"),))
    assert launch.visible_gpus() == [] and asked == []  # no driver: torch is not even asked
    (tmp_path / "nvidiactl").touch()
    assert launch.visible_gpus() == [0, 1]
    assert asked[0][0] == sys.executable and "torch.cuda.device_count()" in asked[0][-1]
