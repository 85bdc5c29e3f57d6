"""The layer-group page protocol (`--kv-layer-group`): a chunk's pages ship as layer ranges, in order, and land on
decode as parts of pages that are complete only when every layer arrived. Ordering (gaps, repeats, a group before
its predecessor), partial pages (PrefillDone with a page half in is DATA_LOSS), a prefill that dies after some
layers (decode's reserved pages freed once, no leak), the connectors over grpc and cuda-ipc (CPU shared memory),
the checksum covering the layer range, and int8 group rows bit-identical to the whole rows' bytes."""

from __future__ import annotations

from concurrent.futures import Future

import grpc
import pytest
import torch
from connector_testutil import Settings, wire

from pdserve.engine.kv_cache import KVCache, QuantizedKVCache
from pdserve.errors import CorruptPage, TransferError
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages, PageState, ReceiverPages, SenderPages, for_decode, for_prefill
from pdserve.kv.transfer.layers import LayerRange, effective_group, layer_groups
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import BatchExpectation, make_header, verify_header
from pdserve.server.status import engine_error_code
from pdserve.v1 import internal_pb2

L, PS, H, D = 4, 4, 2, 16
F32 = KVLayoutSpec("float32", page_size=PS, num_layers=L, num_kv_heads=H, head_dim=D)
INT8 = KVLayoutSpec("int8", page_size=PS, num_layers=L, num_kv_heads=H, head_dim=D, group_size=8)
CPU = torch.device("cpu")
N = 3  # pages of the request


def test_groups_split_the_layers_and_fall_back_to_whole_chunks():
    assert layer_groups(4, 1) == [LayerRange(i, i + 1) for i in range(4)]
    assert layer_groups(5, 2) == [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
    assert layer_groups(4, 0) == layer_groups(4, 4) == layer_groups(4, 9) == [LayerRange(0, 4)]
    assert effective_group(2, 4, peer_accepts=True) == 2
    assert effective_group(2, 4, peer_accepts=False) == 0  # an older decode: whole chunks
    assert effective_group(4, 4, True) == effective_group(0, 4, True) == 0


def test_sender_page_is_shipped_with_its_last_layer_and_acked_with_its_last_shipment():
    freed = []
    s = SenderPages("r", 2, free=lambda: freed.append(1), num_layers=L)
    assert s.ship([0, 1], 10, LayerRange(0, 2)) == 0  # seq 0, 1
    assert s.states == [PageState.FILLING] * 2 and s.num_pages_shipped == 0
    with pytest.raises(TransferError, match="after layers"):
        s.ship([0], 5, LayerRange(3, 4))  # a gap
    with pytest.raises(TransferError, match="after layers"):
        s.ship([0], 5, LayerRange(0, 2))  # a repeat
    assert s.ship([0, 1], 10, LayerRange(2, 4)) == 2  # seq 2, 3
    assert s.states == [PageState.SHIPPED] * 2 and s.num_shipped == 4 and s.num_pages_shipped == 2
    with pytest.raises(TransferError, match="shipped twice"):
        s.ship([1], 5, LayerRange(0, 2))
    assert s.ack(2) is False  # page 0's both shipments (0, 2) acked; page 1's second (3) not yet
    assert s.states == [PageState.ACKED, PageState.SHIPPED] and not freed
    assert s.ack(3) is True and freed == [1] and s.all_acked()


def test_receiver_takes_groups_in_order_and_completes_a_page_with_its_last_layer():
    freed = []
    r = ReceiverPages("r", 2, free=lambda: freed.append(1), num_layers=L)
    r.check(0, [0, 1], LayerRange(0, 2))
    for bad_seq, pages, layers, why in [
        (2, [0], LayerRange(0, 2), "received twice"),  # a repeat of a group
        (2, [0], LayerRange(3, 4), "out of order"),  # a gap
        (3, [0], LayerRange(2, 4), "seq_no"),  # a seq gap
        (2, [0], LayerRange(2, 5), "outside"),  # past the model's layers
    ]:
        with pytest.raises(TransferError, match=why):
            r.check(bad_seq, pages, layers)
    assert r.filled([0, 1], 10, LayerRange(0, 2)) == 1
    assert r.states == [PageState.FILLING] * 2 and r.pages_claimed == 0
    with pytest.raises(TransferError, match="incomplete: 2 pages missing"):
        r.complete(2)  # the count of shipments matches, but no page has all its layers
    r.check(2, [1], LayerRange(2, 4))
    assert r.pages_claimed == 1
    assert r.filled([1], 5, LayerRange(2, 4)) == 2
    assert r.states == [PageState.FILLING, PageState.FILLED]
    assert r.fail() is True and freed == [1] and r.fail() is False  # prefill died here: freed once


def test_header_carries_a_checked_layer_range():
    fmt = PageFormat(F32, 2)
    payload = torch.randn(N, fmt.page_bytes // 4).view(torch.uint8).numpy().tobytes()
    want = BatchExpectation(F32, "fp", "r")
    kw = dict(request_id="r", fingerprint="fp", layout=F32, first_seq_no=0, page_indexes=[0, 1, 2], num_tokens=[4] * 3)
    h = make_header(**kw, payload=payload, layers=LayerRange(2, 4))
    assert (h.layer_start, h.layer_count, h.nbytes) == (2, 2, len(payload))
    verify_header(h, want, payload)
    h.layer_start = 0  # another range under the same checksum
    with pytest.raises(CorruptPage, match="checksum"):
        verify_header(h, want, payload)
    h.layer_start = 3  # past the model's layers
    with pytest.raises(CorruptPage, match="outside the model's 4"):
        verify_header(h, want, payload)
    whole = make_header(**kw, layers=LayerRange(0, L))  # every layer: the header of a whole-page batch
    assert whole == make_header(**kw) and whole.layer_count == 0
    with pytest.raises(CorruptPage, match="payload has"):  # a group's bytes under a whole-page header
        verify_header(make_header(**kw, payload=payload), want, payload)


@pytest.mark.parametrize("pool_dtype", ["int8", "float32"])
def test_int8_group_rows_are_the_whole_rows_bytes(pool_dtype):
    """Layer-group rows, laid side by side per page, are the bytes of the whole rows: from an int8 pool (a straight
    copy) and from a float32 pool (quantized when shipping)."""
    g = torch.Generator().manual_seed(1)
    if pool_dtype == "int8":
        pool = QuantizedKVCache(L, 8, PS, H, D, torch.float32, CPU, 8, False)
        pool.data.copy_(torch.randint(-127, 127, pool.data.shape, generator=g, dtype=torch.int8))
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=g).half() + 0.01)
    else:
        pool = KVCache(L, 8, PS, H, D, torch.float32, CPU)
        pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    pages, tokens = [6, 1, 3], [4, 4, 2]
    args = (True, 8, False, torch.int8)
    whole = PageFormat(INT8).unpack(PageFormat(INT8).pack(*pool.gather_pages(pages, tokens, *args)))
    for r in layer_groups(L, 3):
        fmt = PageFormat(INT8, r.count)
        part = fmt.unpack(fmt.pack(*pool.gather_pages(pages, tokens, *args, layers=(r.start, r.stop))))
        for w, p in zip(whole, part):
            if w is not None:
                assert p is not None and torch.equal(w[:, :, r.start : r.stop].view(torch.uint8), p.view(torch.uint8))


class Pair:
    """A prefill and a decode connector with one request between them; decode writes the groups into a pool."""

    def __init__(self, transport: str = "auto", group: int = 2, threads: int = 2):
        self.freed: list[int] = []
        self.released: list[str] = []
        self.cancelled: list[int] = []
        self.pool = KVCache(L, N, PS, H, D, torch.float32, CPU)  # decode's: request page i is pool page i
        self.pc = for_prefill(Settings(kv_layer_group=group), CPU, "fp", release=self.released.append)
        self.dc = for_decode(Settings(kv_transport=transport, kv_copy_threads=threads), CPU, F32, "fp")
        self.rx = self.dc.open("r", N, lambda: self.freed.append(1), self.import_rows, peer="prefill-0")
        client = self.rx.messages(internal_pb2.PrefillRequest(request_id="r", prompt_token_ids=[5] * 11))
        req = next(client).request
        assert req.kv_layer_groups  # decode says it takes layer groups
        self.tx = self.pc.open("r", N, F32, req.kv_transport, req.kv_layer_groups)
        self.rx.attach(lambda: self.cancelled.append(1))
        self.tx.listen(client)
        assert self.rx.receive(wire(self.tx.choice)) is None

    def import_rows(self, indexes: list[int], tokens: list[int], rows: torch.Tensor, layers=None) -> Future:
        fmt = PageFormat(F32, 0 if layers is None else layers.count)
        span = None if layers is None else (layers.start, layers.stop)
        self.pool.scatter_pages(indexes, *fmt.unpack(rows), 0, span)
        f: Future = Future()
        f.set_result(None)
        return f

    def ship(self, src: KVCache, layers: LayerRange) -> None:
        data, _, _ = src.gather_pages(list(range(N)), [4, 4, 3], False, layers=(layers.start, layers.stop))
        rows = PageFormat(F32, layers.count).pack(data, None, None)
        for m in self.tx.send(ExportedPages(list(range(N)), [4, 4, 3], rows, layers=layers)):
            assert self.rx.receive(wire(m)) is None

    def done(self) -> internal_pb2.PrefillDone:
        msg = self.rx.receive(wire(internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(num_pages=0))))
        assert msg is not None
        msg.done.num_pages = self.tx.pages.num_shipped
        return msg.done

    def close(self) -> None:
        self.rx.close()
        self.tx.abort()
        self.pc.close()
        self.dc.close()


def source() -> KVCache:
    src = KVCache(L, N, PS, H, D, torch.float32, CPU)
    src.data.copy_(torch.randn(src.data.shape, generator=torch.Generator().manual_seed(3)))
    src.data[:, :, 2, 3:] = 0  # the last page holds 3 tokens
    return src


@pytest.mark.parametrize("transport", ["auto", "cuda-ipc"], ids=["grpc", "cuda-ipc"])
def test_groups_move_between_the_connectors_and_the_pool_matches(transport):
    pair = Pair(transport)
    try:
        src = source()
        assert pair.tx.layer_group == 2 and pair.tx.transport == ("grpc" if transport == "auto" else "cuda-ipc")
        for r in layer_groups(L, pair.tx.layer_group):
            pair.ship(src, r)
        pair.rx.finish(pair.done())  # every group checked and in the pool (filled on the copy threads)
        assert pair.rx.pages.states == [PageState.ACKED] * N
        pair.tx.finish(5)
        assert torch.equal(pair.pool.data, src.data)  # every layer of every page landed where it belongs
        assert pair.rx.pages.completed and pair.freed == [] and pair.released == ["r"]
        sent, got = pair.pc.stats.get(pair.tx.transport), pair.dc.stats.get(pair.tx.transport)
        assert sent.pages == got.pages == N and sent.batches == got.batches >= 2 and sent.bytes == got.bytes
    finally:
        pair.close()


def test_prefill_dying_after_some_layers_frees_decodes_pages_once():
    pair = Pair(threads=0)  # batches filled on the reader: the break comes after they are in
    try:
        pair.ship(source(), LayerRange(0, 2))  # the first group of every page, then prefill is gone
        assert pair.rx.pages.states == [PageState.FILLING] * N
        pair.rx.close()  # the stream broke: the decode servicer closes the transfer
        assert pair.freed == [1] and pair.cancelled == [1] and pair.rx.pages.states == [PageState.FREED] * N
        pair.rx.close()
        assert pair.freed == [1]  # once
    finally:
        pair.close()
    assert pair.released == ["r"]  # prefill's pages too, when its RPC ends


def test_done_after_part_of_the_layers_or_a_group_out_of_order_is_data_loss():
    pair = Pair()
    try:
        pair.ship(source(), LayerRange(0, 2))
        with pytest.raises(TransferError, match="incomplete") as early:
            pair.rx.finish(pair.done())  # PrefillDone with every page half in
        pair.rx.close()
        assert pair.freed == [1]
    finally:
        pair.close()
    pair = Pair(group=1)
    try:
        src = source()
        pair.ship(src, LayerRange(0, 1))
        data, _, _ = src.gather_pages([0], [4], False, layers=(2, 3))
        rows = PageFormat(F32, 1).pack(data, None, None)
        header = make_header(
            request_id="r", fingerprint="fp", layout=F32, first_seq_no=N, page_indexes=[0], num_tokens=[4]
        )
        header.layer_start, header.layer_count = 2, 1  # layer 2 before layer 1: a forged skip
        from pdserve.kv.transfer.wire import batch_message_bytes, checksum

        payload = rows.numpy().tobytes()
        header.nbytes, header.has_checksum = len(payload), True
        header.checksum = checksum(header, payload)
        with pytest.raises(TransferError, match="out of order") as skip:
            pair.rx.receive(batch_message_bytes(header, payload))
    finally:
        pair.close()
    assert engine_error_code(early.value) == engine_error_code(skip.value) == grpc.StatusCode.DATA_LOSS
