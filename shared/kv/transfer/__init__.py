"""KV page transfer prefill -> decode. The services use the per-role connectors: `for_prefill` (`prefill_side`) and
`for_decode` (`decode_side`), which own the transport choice (`handshake`), the cuda-ipc -> grpc fallback, staging,
the ack and page bounds (`timeouts`) and their errors. Beneath them: one interface (`base`), page states that drive
freeing (`pages`), the batch byte layout (`page_format`) and wire checks (`wire`), one file per transport
(`grpc_transport`, `cuda_ipc`), the transport names (`modes`) and counters (`stats`). See docs/kv_transfer.md.

The names below load on first use (PEP 562), so importing a torch-free submodule such as `modes` (config
validation, the `pdserve up` launcher) does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.errors import TransferError
    from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
    from pdserve.kv.transfer.decode_side import DecodeConnector, IncomingTransfer, for_decode
    from pdserve.kv.transfer.pages import PageState, ReceiverPages, SenderPages
    from pdserve.kv.transfer.prefill_side import OutgoingTransfer, PrefillConnector, for_prefill

# exported name -> the module that defines it
_HOME = {
    "TransferError": "pdserve.errors",
    "ExportedPages": "pdserve.kv.transfer.base",
    "KVReceiver": "pdserve.kv.transfer.base",
    "KVSender": "pdserve.kv.transfer.base",
    "DecodeConnector": "pdserve.kv.transfer.decode_side",
    "IncomingTransfer": "pdserve.kv.transfer.decode_side",
    "for_decode": "pdserve.kv.transfer.decode_side",
    "PageState": "pdserve.kv.transfer.pages",
    "ReceiverPages": "pdserve.kv.transfer.pages",
    "SenderPages": "pdserve.kv.transfer.pages",
    "OutgoingTransfer": "pdserve.kv.transfer.prefill_side",
    "PrefillConnector": "pdserve.kv.transfer.prefill_side",
    "for_prefill": "pdserve.kv.transfer.prefill_side",
}

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


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
