"""An exception no handler maps (a gateway bug) is a logged 500 in the OpenAI error shape whose id finds the
traceback in the log; the client never sees the traceback. Driven as ASGI calls, in-process."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdserve.router.gateway.app import CatchUnexpected


def _buggy_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(CatchUnexpected)

    @app.post("/v1/completions")
    async def completions() -> dict:
        raise RuntimeError("secret detail of a gateway bug")

    @app.post("/v1/chat/completions")
    async def chat():
        async def events():
            yield b"data: {}\n\n"
            raise RuntimeError("secret detail after the stream started")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _post(path: str) -> list[dict]:
    """The ASGI messages the app sends for a POST to `path`."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # the client stays connected: only a cancel ends this
        raise AssertionError("not reached")

    async def send(message: dict) -> None:
        sent.append(message)

    async def call() -> None:
        try:
            await _buggy_app()(scope, receive, send)
        except Exception:
            pass  # Starlette re-raises for the server's log; the client got what `sent` holds

    asyncio.run(call())
    return sent


def test_unexpected_exception_is_a_logged_500(caplog):
    with caplog.at_level(logging.ERROR, logger="pdserve.gateway"):
        sent = _post("/v1/completions")
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    body = b"".join(m.get("body", b"") for m in sent[1:])
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["param"] is None
    assert b"secret detail" not in body and b"Traceback" not in body
    eid = error["message"].split("(id ")[1].split(")")[0]
    record = next(rec for rec in caplog.records if eid in rec.getMessage())
    assert record.exc_info is not None and "secret detail" in str(record.exc_info[1])


def test_failure_after_the_stream_started_is_logged_not_sent(caplog):
    with caplog.at_level(logging.ERROR, logger="pdserve.gateway"):
        sent = _post("/v1/chat/completions")
    assert sent[0]["status"] == 200
    assert b"secret detail" not in b"".join(m.get("body", b"") for m in sent[1:])
    assert any("internal error" in rec.getMessage() and rec.exc_info for rec in caplog.records)
