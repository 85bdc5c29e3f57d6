"""Decode CUDA graphs at tensor parallel (issue 31), the parts a CPU can run: which comm a captured graph may hold
and how it is captured (path selection), the gather the graph holds, the replay messages (round trip, deltas,
malformed ones refused), and rank 0's replays reaching every follower in lockstep over a real gloo group (the CUDA
graph runner itself is the one GPU stand-in). The replay with NCCL inside is measured on two GPUs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cuda_graphs import graph_capture_mode
from pdserve.engine.tp.comm import TPGroup
from pdserve.engine.tp.graph_step import (
    GRAPH_MASK,
    GRAPH_RUN,
    FollowerTables,
    TableDeltas,
    decode_mask,
    decode_run,
    mask_message,
    run_message,
)
from pdserve.engine.tp.page_export import GATHER
from pdserve.engine.tp.page_import import SCATTER
from pdserve.engine.tp.worker import COPY, IDLE, LOGITS, SHUTDOWN, STEP
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.tp_graph_ranks import MAX_BATCH, graph_lockstep_rank, script
from pdserve.testing.tp_ranks import spawn_ranks

CUDA = torch.device("cuda", 0)


def test_only_an_nccl_group_is_captured_and_in_thread_local_mode():
    nccl = TPGroup(0, 2, CUDA, None, backend="nccl")  # built, not joined: a GPU group's description
    gloo = TPGroup(0, 2, torch.device("cpu"), None)
    assert gloo.backend == "gloo" and "gloo" in gloo.capture_blocker()
    assert nccl.capture_blocker() == "" and nccl.capture_error_mode == "thread_local"
    assert "gloo" in TPGroup(0, 2, CUDA, None, backend="gloo").capture_blocker()  # gloo on CUDA tensors: host work
    assert graph_capture_mode(True, CUDA, True, "fa3", nccl) == ("thread_local", "")
    assert graph_capture_mode(True, CUDA, True, "fa3", None) == ("thread_local", "")  # TP=1: other threads too
    mode, why = graph_capture_mode(True, CUDA, True, "fa3", gloo)
    assert mode == "" and "cannot hold them" in why
    assert graph_capture_mode(False, CUDA, True, "fa3", nccl) == ("", "disabled")
    assert graph_capture_mode(True, torch.device("cpu"), True, "fa3", nccl)[0] == ""
    assert graph_capture_mode(True, CUDA, True, "sdpa", nccl)[0] == ""


def test_a_capture_region_refuses_a_group_that_cannot_be_captured():
    """The graph runner records the forward inside `TPGroup.capturing` (cuda_graphs.DecodeGraphRunner._collectives):
    a gloo group is refused there too, not run on the host while the graph records nothing of it."""
    with pytest.raises(RuntimeError, match="cannot capture this tensor-parallel forward: .*gloo"):
        with TPGroup(0, 2, torch.device("cpu"), None).capturing():
            pass
    nccl = TPGroup(0, 2, CUDA, None, backend="nccl")
    nccl.captured_collectives = 5  # a previous region's count
    with nccl.capturing():
        assert nccl.captured_collectives == 0
    assert nccl.captured_collectives == 0  # nothing recorded: the graph runner raises on that


def test_graph_kinds_do_not_collide_with_the_rank_runtimes():
    assert {GRAPH_RUN, GRAPH_MASK}.isdisjoint({STEP, IDLE, SHUTDOWN, LOGITS, COPY, SCATTER, GATHER})


def test_run_messages_carry_table_deltas_and_round_trip():
    sent, got = TableDeltas(MAX_BATCH), FollowerTables(MAX_BATCH)
    a, b = [0, 1], [2]
    first = run_message(sent, [7, 8], [5, 2], [a, b])
    assert decode_run(first, got, MAX_BATCH, 16, 10) == ([7, 8], [5, 2], [[0, 1], [2]])
    b.append(3)
    chained = run_message(sent, None, [6, 3], [a, b])
    # header 3 + positions 2, then rows: a unchanged (reset 0, 0 entries), b one new page (reset 0, 1, page 3)
    assert chained.tolist()[5:] == [0, 0, 0, 1, 3]
    assert decode_run(chained, got, MAX_BATCH, 16, 10) == (None, [6, 3], [[0, 1], [2, 3]])
    swapped = run_message(sent, [1, 2], [4, 4], [b, a])  # other sequences in the rows: whole tables again
    assert decode_run(swapped, got, MAX_BATCH, 16, 10) == ([1, 2], [4, 4], [[2, 3], [0, 1]])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda v: v[:-1], "does not add up|ends inside"),
        (lambda v: v + [0], "past its tables"),
        (lambda v: [v[0], MAX_BATCH + 1, *v[2:]], "bad GRAPH_RUN header"),
        (lambda v: v[:3] + [-1] + v[4:], "out of range"),  # a position
        (lambda v: v[:5] + [99] + v[6:], "out of range"),  # a token id
        (lambda v: v[:-1] + [10], "page outside the pool"),
    ],
)
def test_malformed_run_messages_are_refused(edit, match):
    msg = run_message(TableDeltas(MAX_BATCH), [7, 8], [5, 2], [[0, 1], [2]]).tolist()
    with pytest.raises(ValueError, match=match):
        decode_run(torch.tensor(edit(msg), dtype=torch.int64), FollowerTables(MAX_BATCH), MAX_BATCH, 16, 10)


def test_mask_messages_keep_every_int32_bit():
    mask = torch.tensor([[-1, -(2**31)], [5, 2**31 - 1]], dtype=torch.int32)
    assert torch.equal(decode_mask(mask_message(mask), MAX_BATCH, 2), mask)
    with pytest.raises(ValueError, match="does not match"):
        decode_mask(mask_message(mask), MAX_BATCH, 3)


def test_the_replays_reach_every_rank_in_lockstep(tmp_path):
    """Three ranks: rank 0's scripted replays (appended tables, chained runs, a masked draw, batch changes) are
    replayed by each follower with exactly its inputs."""
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    model = build_checkpoint(tmp_path / "model", arch="llama", **shape)
    spawn_ranks(graph_lockstep_rank, 3, (str(tmp_path / "rendezvous"), model, tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    assert len(ranks[0]["calls"]) == len(script(1000)) == ranks[1]["steps"] == ranks[2]["steps"]
    assert ranks[1]["calls"] == ranks[0]["calls"] and ranks[2]["calls"] == ranks[0]["calls"]
