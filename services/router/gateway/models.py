"""Which models the gateway offers: the router's served models (Generation.ListModels), asked on each call with the
caller's credentials, and the gateway's `--model-name`, an alias of the router's model while it serves only one
(how a single-model stack has always been named). A router without ListModels (older) serves the alias only."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.client import AsyncClient
from pdserve.router.gateway.errors import APIError
from pdserve.router.gateway.fields import short

LIST_TIMEOUT_S = 5.0


async def router_models(client: AsyncClient, metadata: Sequence[tuple[str, str]]) -> list[str] | None:
    """The router's served model names; None when it has no ListModels (UNIMPLEMENTED). Other errors raise."""
    try:
        return await client.list_models(timeout=LIST_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


def listed(names: list[str] | None, alias: str) -> list[str]:
    """What /v1/models shows: the alias for a router serving one model (or without ListModels), else every name."""
    if names is None or (len(names) == 1 and alias):
        return [alias]
    return names


def forward_name(requested: str, names: list[str] | None, alias: str) -> str:
    """The `model` to send the router for a request naming `requested` ("" = the router's only model); APIError
    404 naming the served models when it is none of them."""
    if names is not None and requested in names:
        return requested
    if requested == alias and (names is None or len(names) == 1):
        return ""
    served = listed(names, alias)
    raise APIError(
        404,
        f"the model {short(requested)} does not exist; this server serves {', '.join(map(repr, served))}",
        param="model",
        code="model_not_found",
    )
