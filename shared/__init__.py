"""pdserve: disaggregated LLM serving over gRPC (router → chunked prefill → int8 KV pages → decode).

SDK: `pdserve.Client(target)` and `pdserve.AsyncClient(target)`; see `pdserve.client`.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = [
    "Client",
    "AsyncClient",
    "Completion",
    "CompletionChunk",
    "Usage",
    "TokenLogprob",
    "PromptLogprobs",
    "ToolCall",
    "ToolCallDelta",
]


def __getattr__(name: str):  # lazy: importing pdserve.engine must not pull in gRPC and vice versa
    if name in __all__:
        from pdserve import client

        return getattr(client, name)
    raise AttributeError(name)
