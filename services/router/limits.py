"""Bounds on the work one public request may ask for, and the prompt cache's sharing between tenants. Mixed into
`RouterConfig` (flags `--max-prompt-bytes` etc., `PDSERVE_ROUTER_*`, or a `[limits]` table in the TOML file).

Every limit is checked where the request enters, before any tokenizing or template rendering, and a request over
one fails INVALID_ARGUMENT at once with the limit named. The engines hold hard ceilings of their own
(`pdserve.engine.sampling.MAX_STOP_*`); the router's limits may not exceed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.errors import InvalidRequest
from pdserve.server.auth import DEFAULT_TENANT  # every caller's tenant when the router has no authenticator
from pdserve.server.service_config import opt
from pdserve.v1 import generate_pb2

__all__ = ["DEFAULT_TENANT", "RouterLimits"]


@dataclass
class RouterLimits:
    # limits
    max_prompt_bytes: int = opt(
        1 << 20, "largest prompt (or all chat message contents together), UTF-8 bytes; checked before tokenizing"
    )
    max_messages: int = opt(256, "most chat messages in one request")
    max_stop: int = opt(16, f"most stop strings in one request (at most {MAX_STOP_STRINGS})")
    max_stop_chars: int = opt(256, f"longest stop string, characters (at most {MAX_STOP_CHARS})")
    max_stop_token_ids: int = opt(256, f"most stop_token_ids in one request (at most {MAX_STOP_TOKEN_IDS})")
    max_request_id_bytes: int = opt(256, "longest request_id a caller may send (a label echoed back), bytes")
    # isolation: each tenant's prompts are cached in its own namespace unless named here
    cache_share: list[str] = field(
        default_factory=list,
        metadata={
            "help": "TENANT=NAMESPACE: TENANT's prompt-cache pages live in the shared NAMESPACE (repeat; tenants "
            "naming the same NAMESPACE see each other's cached prefixes and cached_tokens)"
        },
    )

    def limit_problems(self) -> list[str]:
        """What is wrong with these settings (RouterConfig.validate reports it)."""
        problems = []
        for name in ("max_prompt_bytes", "max_messages", "max_stop_chars", "max_request_id_bytes"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name, ceiling in (
            ("max_stop", MAX_STOP_STRINGS),
            ("max_stop_chars", MAX_STOP_CHARS),
            ("max_stop_token_ids", MAX_STOP_TOKEN_IDS),
        ):
            if not 0 <= getattr(self, name) <= ceiling:
                problems.append(f"{name} must be in [0, {ceiling}] (the engine's ceiling)")
        for entry in self.cache_share:
            tenant, sep, ns = entry.partition("=")
            if not (sep and tenant.strip() and ns.strip()):
                problems.append(f"cache_share entries are TENANT=NAMESPACE, got {entry!r}")
        return problems

    def cache_scope(self, tenant: str) -> str:
        """The prompt-cache scope of `tenant`'s requests: its own, or the shared namespace `cache_share` names."""
        for entry in self.cache_share:
            t, _, ns = entry.partition("=")
            if t.strip() == tenant:
                return "shared:" + ns.strip()
        return "tenant:" + tenant

    def check_request(self, request: generate_pb2.GenerateRequest) -> None:
        """Raise InvalidRequest for a request over a limit. Cheap: sizes only, nothing tokenized or decoded."""
        rid = request.request_id
        if len(rid) > self.max_request_id_bytes or len(rid.encode()) > self.max_request_id_bytes:
            raise InvalidRequest(f"request_id is longer than max_request_id_bytes={self.max_request_id_bytes}")
        if request.WhichOneof("input") == "prompt":
            _check_bytes("prompt", request.prompt, self.max_prompt_bytes)
        if request.messages:
            if len(request.messages) > self.max_messages:
                raise InvalidRequest(f"{len(request.messages)} messages; at most max_messages={self.max_messages}")
            _check_bytes("messages", "".join(m.role + m.content for m in request.messages), self.max_prompt_bytes)
        s = request.sampling
        if len(s.stop) > self.max_stop:
            raise InvalidRequest(f"{len(s.stop)} stop strings; at most max_stop={self.max_stop}")
        for i, stop in enumerate(s.stop):
            if len(stop) > self.max_stop_chars:
                raise InvalidRequest(
                    f"stop[{i}] has {len(stop)} characters; at most max_stop_chars={self.max_stop_chars}"
                )
        if len(s.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequest(
                f"{len(s.stop_token_ids)} stop_token_ids; at most max_stop_token_ids={self.max_stop_token_ids}"
            )


def _check_bytes(what: str, text: str, limit: int) -> None:
    """UTF-8 size of `text` within `limit`: the character count decides without encoding when it alone is over."""
    if len(text) > limit or (len(text) * 4 > limit and len(text.encode()) > limit):
        raise InvalidRequest(f"{what} is longer than max_prompt_bytes={limit} bytes (UTF-8)")
