"""`pdserve up` placement of tensor-parallel instances (issue 31): each instance takes TP-size consecutive GPUs of
its role's list (rank r on the r-th), a GPU count that is not a multiple of the TP size is refused, and the flags and
environment of each instance put its ranks there (CPU: the plan and `pdserve up --print-plan`)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.placement import DECODE, PREFILL, Placement, plan_placement
from pdserve.cli.up import cmd_up
from pdserve.config import add_dataclass_args, config_from
from pdserve.decode.config import DecodeConfig


def runs(plan: list[Placement]) -> list[tuple[str, int, tuple[int, ...], float]]:
    return [(p.role, p.index, p.gpus, round(p.memory_fraction or 0, 4)) for p in plan]


def test_one_instance_takes_consecutive_gpus_one_per_rank():
    (pl,) = plan_placement(0, 1, [0, 1], 0.85, decode_tp=2)
    assert (pl.gpus, pl.gpu, pl.tp) == ((0, 1), 0, 2)
    # rank 0 on cuda:0, rank r on cuda:<0 + r> (tp.supervisor.rank_device): no remapping needed
    assert pl.args() == ["--device", "cuda:0", "--gpu-memory-utilization", "0.8500", "--tensor-parallel-size", "2"]
    assert pl.env({}) == {}


def test_several_instances_each_get_their_own_run_of_gpus():
    assert runs(plan_placement(0, 2, [0, 1, 2, 3], 0.9, decode_tp=2)) == [
        (DECODE, 0, (0, 1), 0.9),
        (DECODE, 1, (2, 3), 0.9),
    ]
    # prefill + decode at TP 2 on 4 GPUs: a group each; on 8 GPUs with 1 prefill + 3 decode: one run each
    assert runs(plan_placement(1, 1, [0, 1, 2, 3], 0.9, 2, 2)) == [(PREFILL, 0, (0, 1), 0.9), (DECODE, 0, (2, 3), 0.9)]
    assert [p.gpus for p in plan_placement(1, 3, list(range(8)), 0.9, 2, 2)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # more instances than runs: round-robin, each GPU's memory split among the instances on it
    assert runs(plan_placement(0, 3, [0, 1, 2, 3], 0.9, decode_tp=2)) == [
        (DECODE, 0, (0, 1), 0.45),
        (DECODE, 1, (2, 3), 0.9),
        (DECODE, 2, (0, 1), 0.45),
    ]


def test_roles_of_different_sizes_and_too_few_gpus_for_a_group_each():
    # prefill TP 1 + decode TP 2 on 3 GPUs: 1 + 2
    assert runs(plan_placement(1, 1, [0, 1, 2], 0.8, 1, 2)) == [(PREFILL, 0, (0,), 0.8), (DECODE, 0, (1, 2), 0.8)]
    # prefill + decode at TP 2 on 2 GPUs: they share the pair, half the memory each
    assert runs(plan_placement(1, 1, [0, 1], 0.9, 2, 2)) == [(PREFILL, 0, (0, 1), 0.45), (DECODE, 0, (0, 1), 0.45)]


def test_a_gpu_count_that_does_not_divide_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"3 GPUs \[0, 1, 2\] are not a multiple of the tensor parallel size 2"):
        plan_placement(0, 1, [0, 1, 2], decode_tp=2)
    with pytest.raises(ValueError, match="not a multiple of the tensor parallel size 4"):
        plan_placement(0, 2, [0, 1], decode_tp=4)
    with pytest.raises(ValueError, match="for decode instances .shared by both roles"):
        plan_placement(1, 1, [0, 1, 2], 0.9, 1, 4)
    with pytest.raises(ValueError, match="tensor parallel sizes must be >= 1"):
        plan_placement(0, 1, [0], decode_tp=0)


def test_non_consecutive_ids_are_made_consecutive_for_the_instance():
    (pl,) = plan_placement(0, 1, [1, 3], 0.85, decode_tp=2)
    assert pl.gpus == (1, 3) and pl.args()[:2] == ["--device", "cuda:0"]
    assert pl.env({}) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    # --gpus ids index what the launcher sees: mapped through its own CUDA_VISIBLE_DEVICES
    assert pl.env({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "5,7"}
    with pytest.raises(ValueError, match="not among CUDA_VISIBLE_DEVICES"):
        pl.env({"CUDA_VISIBLE_DEVICES": "4,5"})


def test_cpu_instances_get_the_tp_size_only():
    plan = plan_placement(1, 2, [], prefill_tp=1, decode_tp=2)
    assert [p.args() for p in plan] == [
        ["--tensor-parallel-size", "1"],
        ["--tensor-parallel-size", "2"],
        ["--tensor-parallel-size", "2"],
    ]
    assert [p.args() for p in plan_placement(1, 1, [])] == [[], []]  # no size decided: each engine's own


def test_placement_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DecodeConfig)
    (pl,) = plan_placement(0, 1, [2, 3], 0.85, decode_tp=2)
    # `up` hands the engine flags first, the placement's after them: the placement's size wins
    argv = ["--model", "m", "--tensor-parallel-size", "1", *pl.args()]
    ec = config_from(DecodeConfig, parser.parse_args(argv), "PDSERVE_TEST_UNUSED_").engine
    assert (ec.device, ec.tensor_parallel_size, ec.gpu_memory_utilization) == ("cuda:2", 2, 0.85)
    ec.validate()


def test_up_print_plan_shows_each_instances_gpus(capsys):
    base = ["--model", "m", "--print-plan", "--tensor-parallel-size", "2"]
    assert cmd_up([*base, "--gpus", "0,1,2,3", "--colocated", "2", "--gpu-memory-utilization", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "colocated 0: cuda:0,1 (tensor parallel 2), 80% of each one's memory" in out
    assert "colocated 1: cuda:2,3 (tensor parallel 2)" in out
    assert cmd_up([*base, "--gpus", "0,1,2", "--prefill-tensor-parallel-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill and decode on separate GPUs (1 + 2 per pair" in out
    assert "prefill 0: cuda:0, " in out and "decode 0: cuda:1,2 (tensor parallel 2)" in out
    with pytest.raises(SystemExit):
        cmd_up([*base, "--gpus", "0,1,2", "--colocated"])
    assert "3 GPUs [0, 1, 2] are not a multiple of the tensor parallel size 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cmd_up([*base, "--gpus", "0,1", "--colocated", "--prefill-tensor-parallel-size", "1"])
    assert "colocated ones take --tensor-parallel-size" in capsys.readouterr().err
