"""A local stand-in for the Hugging Face Hub's download API (what `huggingface_hub.snapshot_download` calls), serving
model directories of this machine on a free loopback port: point `HF_ENDPOINT` at `FakeHub.url`.

    GET  /api/models/{org}/{name}/revision/{rev}   repo info: {"id", "sha", "siblings"}
    GET  /api/models/{org}/{name}/tree/{rev}       the files: [{"type": "file", "path", "size", "oid"}] (one page)
    HEAD /{org}/{name}/resolve/{rev}/{path}        X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{path}        the bytes

`rev` is "main" or the repository's commit sha (a hash of its files). Unknown repositories answer 404 with
`X-Error-Code: RepoNotFound`, unknown files 404 `EntryNotFound`, as the Hub does. Every request is recorded
(method, path, headers) for the tests to check what the client sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: dict[str, Path]):
        """`repos`: hub id (org/name) -> the local directory whose top-level files it serves."""
        self.files = {
            rid: {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()} for rid, d in repos.items()
        }
        self.sha = {rid: _commit(files) for rid, files in self.files.items()}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self) -> list[str]:
        """The file paths fetched with GET (not HEAD), in order."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for m, path, _ in self.requests
                if m == "GET" and "/resolve/" in path]  # fmt: skip

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6:  # api/models/org/name/{revision|tree}/rev
                    rid, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
                    if not self._known(rid, rev):
                        return
                    files = hub.files[rid]
                    if kind == "revision":
                        info = {"id": rid, "sha": hub.sha[rid], "siblings": [{"rfilename": f} for f in files]}
                        return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                    if kind == "tree":
                        tree = [{"type": "file", "path": f, "size": len(b), "oid": _oid(b)} for f, b in files.items()]
                        return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
                if len(parts) >= 5 and parts[2] == "resolve":  # org/name/resolve/rev/file
                    rid, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    if not self._known(rid, rev):
                        return
                    data = hub.files[rid].get(name)
                    if data is None:
                        return self._error(404, "EntryNotFound", f"{name} not in {rid}", hub.sha[rid])
                    headers = {
                        "Content-Type": "application/octet-stream",
                        "ETag": f'"{_oid(data)}"',
                        "X-Repo-Commit": hub.sha[rid],
                    }
                    return self._send(200, data, headers, body)
                self._error(404, "RepoNotFound", "Repository not found")

            def _known(self, rid: str, rev: str) -> bool:
                if rid not in hub.files:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return False
                if rev not in ("main", hub.sha[rid]):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                    return False
                return True

            def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
                headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
                if commit:
                    headers["X-Repo-Commit"] = commit
                self._send(status, json.dumps({"error": message}).encode(), headers, self.command != "HEAD")

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _commit(files: dict[str, bytes]) -> str:
    h = hashlib.sha1()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + _oid(data).encode())
    return h.hexdigest()
