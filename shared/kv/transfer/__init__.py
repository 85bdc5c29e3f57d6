"""KV page transfer prefill -> decode: one interface (`base`), page states that drive freeing (`pages`), the
batch byte layout (`page_format`) and wire checks (`wire`), the transport handshake (`handshake`), one file per
transport (`grpc_transport`, `cuda_ipc`) and counters (`stats`). See docs/kv_transfer.md."""

from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.pages import PageState, ReceiverPages, SenderPages, TransferError

__all__ = ["ExportedPages", "KVReceiver", "KVSender", "PageState", "ReceiverPages", "SenderPages", "TransferError"]
