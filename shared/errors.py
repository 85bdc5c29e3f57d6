"""Typed errors with a defined meaning for callers; `pdserve.server.status` maps each to one gRPC status code.

Engine, KV codec and services raise these (never bare ValueError/RuntimeError for a caller's mistake), so the
status a caller sees never depends on the wording of a message.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of errors a caller can act on."""


class InvalidRequest(PdserveError, ValueError):
    """The request (or a peer's message) is malformed or outside limits → INVALID_ARGUMENT."""


class DuplicateRequest(PdserveError):
    """A request id already in flight on this instance → ALREADY_EXISTS."""


class UnknownRequest(PdserveError, KeyError):
    """A request id this instance does not hold → NOT_FOUND."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the reason readable
        return str(self.args[0]) if self.args else ""


class OutOfPages(PdserveError, RuntimeError):
    """The KV page pool cannot satisfy an allocation; nothing was allocated → RESOURCE_EXHAUSTED."""


class CorruptPage(InvalidRequest):
    """A KV page failed its checksum or layout checks (bytes damaged or sender disagrees) → DATA_LOSS."""


class TransferError(PdserveError):
    """A KV transfer broke its protocol (gap, repeat, unknown or missing page, a peer's bad message), on either end
    → DATA_LOSS."""


class DeadlineExceeded(PdserveError, TimeoutError):
    """A bound on a request or its KV transfer passed (ack_timeout_s, page_timeout_s, request_timeout_s)
    → DEADLINE_EXCEEDED."""


class TransportUnusable(PdserveError):
    """A KV transport forced on either end cannot work between the two instances → FAILED_PRECONDITION."""


class PeerUnavailable(PdserveError):
    """The other end of a KV transfer went away or never answered → UNAVAILABLE."""
