"""Each side's tensor-parallel split of the KV heads in the KV handshake (`handshake.ShardLayout`): decode's offer
and prefill's choice carry them, a peer that predates them reads as one rank of every head, and decode refuses a
prefill whose split cannot hold the model's heads (DATA_LOSS, before any page)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from pdserve.errors import TransferError
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import for_decode, for_prefill
from pdserve.kv.transfer.handshake import ShardLayout, make_offer
from pdserve.v1 import internal_pb2, kv_pb2

LAYOUT = KVLayoutSpec("float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
CPU = torch.device("cpu")


class Settings:
    kv_transport, kv_batch_mb, kv_ipc_staging_mb, kv_copy_threads, kv_layer_group = "auto", 1.0, 1.0, 0, 0
    ack_timeout_s = page_timeout_s = page_timeout_max_s = 5.0
    page_timeout_slack, first_token_early = 3.0, False


@pytest.mark.parametrize(
    ("tp", "per", "problem"),
    [
        (1, 2, ""),
        (2, 1, ""),  # a plain split
        (3, 1, ""),  # 2 heads over 3 ranks: replicated
        (4, 0, "4 ranks of 0 KV heads cannot hold"),
        (2, 3, "2 ranks of 3 KV heads cannot hold"),
        (0, 2, "outside 1..64"),
        (65, 1, "outside 1..64"),
    ],
)
def test_shard_layout_problems(tp, per, problem):
    why = ShardLayout(tp, per).problem(2)
    assert (problem in why) if problem else why == ""


def test_a_peer_without_shards_is_one_rank_of_every_head():
    assert ShardLayout.from_proto(kv_pb2.KVShardLayout(), 2) == ShardLayout(1, 2)
    assert not make_offer("auto", CPU).HasField("shards")
    offer = make_offer("auto", CPU, ShardLayout(2, 1))
    assert ShardLayout.from_proto(offer.shards, 2) == ShardLayout(2, 1)


def test_offer_and_choice_carry_both_splits_and_decode_refuses_a_broken_one():
    decode = for_decode(Settings(), CPU, LAYOUT, "fp", ShardLayout(2, 1))
    prefill = for_prefill(Settings(), CPU, "fp", release=lambda rid: None, shards=ShardLayout(3, 1))
    imported: Future = Future()
    try:
        rx = decode.open("r", 2, lambda: None, lambda *a: imported, peer="p")
        offer = next(rx.messages(internal_pb2.PrefillRequest(request_id="r"))).request.kv_transport
        assert ShardLayout.from_proto(offer.shards, 2) == ShardLayout(2, 1)
        tx = prefill.open("r", 2, LAYOUT, offer)
        assert ShardLayout.from_proto(tx.choice.transport.shards, 2) == ShardLayout(3, 1)
        assert rx.receive(tx.choice.SerializeToString()) is None and rx.peer_shards == ShardLayout(3, 1)
        tx.abort()
        rx.close()
        broken = internal_pb2.PrefillServerMessage(transport=kv_pb2.KVTransportChoice(transport="grpc"))
        broken.transport.shards.CopyFrom(ShardLayout(2, 0).to_proto())
        rx = decode.open("r2", 2, lambda: None, lambda *a: imported, peer="p")
        with pytest.raises(TransferError, match="prefill's tensor-parallel layout: 2 ranks of 0 KV heads"):
            rx.receive(broken.SerializeToString())
        rx.close()
    finally:
        prefill.close()
        decode.close()
