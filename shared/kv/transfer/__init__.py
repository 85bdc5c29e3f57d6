"""KV page transfer prefill -> decode. The services use the per-role connectors: `for_prefill` (`prefill_side`) and
`for_decode` (`decode_side`), which own the transport choice (`handshake`), the cuda-ipc -> grpc fallback, staging,
the ack and page bounds (`timeouts`) and their errors. Beneath them: one interface (`base`), page states that drive
freeing (`pages`), the batch byte layout (`page_format`) and wire checks (`wire`), one file per transport
(`grpc_transport`, `cuda_ipc`) and counters (`stats`). See docs/kv_transfer.md."""

from pdserve.errors import TransferError
from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.decode_side import DecodeConnector, IncomingTransfer, for_decode
from pdserve.kv.transfer.pages import PageState, ReceiverPages, SenderPages
from pdserve.kv.transfer.prefill_side import OutgoingTransfer, PrefillConnector, for_prefill

__all__ = [
    "DecodeConnector",
    "ExportedPages",
    "IncomingTransfer",
    "KVReceiver",
    "KVSender",
    "OutgoingTransfer",
    "PageState",
    "PrefillConnector",
    "ReceiverPages",
    "SenderPages",
    "TransferError",
    "for_decode",
    "for_prefill",
]
