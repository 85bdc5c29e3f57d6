"""Decode's gRPC channels to prefill instances: one per target, created on first use and reused."""

from __future__ import annotations

import threading

import grpc

from pdserve.server.grpc_util import channel
from pdserve.server.security import ChannelSecurity
from pdserve.v1 import internal_pb2, internal_pb2_grpc


class PrefillChannels:
    """One channel per prefill target; `security`: this decode's internal identity (None: the environment's)."""

    def __init__(self, security: ChannelSecurity | None = None):
        self.security = security
        self._lock = threading.Lock()
        self._stubs: dict[str, internal_pb2_grpc.PrefillStub] = {}
        self._raw: dict[str, grpc.StreamStreamMultiCallable] = {}
        self._channels: list[grpc.Channel] = []

    def stub(self, target: str) -> internal_pb2_grpc.PrefillStub:
        with self._lock:
            if target not in self._stubs:
                ch = channel(target, self.security)
                self._channels.append(ch)
                self._stubs[target] = internal_pb2_grpc.PrefillStub(ch)
                # the Prefill stream with its responses left as bytes (KV batches are parsed without copies)
                self._raw[target] = ch.stream_stream(
                    "/pdserve.v1.Prefill/Prefill",
                    request_serializer=internal_pb2.PrefillClientMessage.SerializeToString,
                    response_deserializer=None,
                )
            return self._stubs[target]

    def prefill_stream(self, target: str) -> grpc.StreamStreamMultiCallable:
        self.stub(target)
        with self._lock:
            return self._raw[target]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
