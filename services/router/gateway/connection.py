"""uvicorn's h11 HTTP/1.1 protocol with the read deadlines uvicorn lacks: a request's line and headers must all
arrive within `header_timeout_s` (counted from the connection's start, or on a kept-alive connection from the
next request's first byte), else the gateway answers 408 and closes; a request body must be complete within
`body_timeout_s` of its headers. The app answers a body it is reading late with 408 itself (`inbound.read_body`);
this deadline, `BODY_GRACE_S` later, closes whatever connection still has not sent its body (a route that does not
read it). Bytes that are not HTTP/1.1 get uvicorn's 400, in the OpenAI error shape. Idle kept-alive connections,
the header size and the connection count are uvicorn's own settings (server.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pdserve.gateway")

BODY_GRACE_S = 1.0  # after the app's own body deadline, which answers 408 first


def _closing_response(status: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, for a connection closed right after it."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class TimedH11Protocol(H11Protocol):
    """H11Protocol plus one read deadline per request phase: "headers" (their state IDLE, once the connection
    opened or the next request's first byte came), "body" (SEND_BODY); none while idle between requests
    ("keep-alive") or while the response is produced."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    @classmethod
    def with_timeouts(cls, header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
        """This class with the given deadlines (uvicorn builds one protocol object per connection from it)."""
        attrs = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s}
        return type(cls.__name__, (cls,), attrs)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch(idle="headers")  # a new connection owes its first request's headers at once

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(idle="headers")  # a byte of a request came: its headers are now owed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(idle="keep-alive")  # idle between requests: uvicorn's keep-alive timeout holds

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1 (h11 refused them), in the OpenAI error shape."""
        self._set_phase(None)
        self.transport.write(_closing_response("400 Bad Request", msg, "invalid_http"))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _watch(self, idle: str) -> None:
        """Arm or drop the deadline for what the peer owes now; `idle`: the phase while their state is IDLE."""
        state = self.conn.their_state
        if self.transport.is_closing():
            phase = None
        elif state is h11.IDLE:
            phase = "headers" if self._phase == "headers" else idle
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase == "headers":
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired, phase)
        elif phase == "body":
            self._deadline = self.loop.call_later(self.body_timeout_s + BODY_GRACE_S, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing() or phase != self._phase:
            return
        log.info("closing a connection from %s: its request %s did not arrive in time", self.client, phase)
        if phase == "headers" and self.conn.their_state is h11.IDLE:
            message = f"request headers not received within {self.header_timeout_s:g} s"
            self.transport.write(_closing_response("408 Request Timeout", message, "header_timeout"))
        self._phase = None
        self.transport.close()
