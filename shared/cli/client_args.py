"""The public-API client flags of `pdserve generate` / `pdserve chat` / `pdserve bench`: the router to talk to
(`--target`), bearer token and TLS (docs/security.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_TARGET = "localhost:50051"


def add_target_arg(p: argparse.ArgumentParser) -> None:
    """`--target`: the router every client command talks to ($PDSERVE_TARGET)."""
    p.add_argument(
        "--target",
        default=os.environ.get("PDSERVE_TARGET", DEFAULT_TARGET),
        help=f"router HOST:PORT (default: $PDSERVE_TARGET, else {DEFAULT_TARGET})",
    )


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token",
        default=os.environ.get("PDSERVE_TOKEN"),
        help="bearer token of the router's public API (default: $PDSERVE_TOKEN)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("PDSERVE_TLS_CA"),
        help="PEM CA that signed the router's certificate: TLS to the router (default: $PDSERVE_TLS_CA)",
    )
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="TLS to the router, verified against the system roots (default: off)",
    )


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`pdserve.Client` keywords of the parsed flags."""
    return {"token": args.token or None, "tls": args.tls, "tls_ca": args.tls_ca or None}
