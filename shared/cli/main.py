"""The `pdserve` command: `up` (whole stack on loopback, `pdserve.cli.up`), `serve <service>` (router, prefill,
decode, colocated, gateway), `generate`, `health`, `chat` (`pdserve.cli.chat`), `bench` (`pdserve.bench.cli`)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

from pdserve.cli.client_args import DEFAULT_TARGET, add_client_args, add_target_arg, client_options
from pdserve.config import add_dataclass_args, config_from


# ---- serve --------------------------------------------------------------------------------------------------
def _service(name: str) -> tuple[type, str]:
    """The config dataclass of service `name` and its env prefix."""
    if name == "router":
        from pdserve.router import config as router_cfg

        return router_cfg.RouterConfig, router_cfg.ENV_PREFIX
    if name == "prefill":
        from pdserve.prefill import config as prefill_cfg

        return prefill_cfg.PrefillConfig, prefill_cfg.ENV_PREFIX
    if name == "gateway":
        from pdserve.router.gateway import config as gateway_cfg

        return gateway_cfg.GatewayConfig, gateway_cfg.ENV_PREFIX
    if name == "colocated":
        from pdserve.decode import colocated_config

        return colocated_config.ColocatedConfig, colocated_config.ENV_PREFIX
    from pdserve.decode import config as decode_cfg

    return decode_cfg.DecodeConfig, decode_cfg.ENV_PREFIX


def _server_main(name: str) -> Callable[[Any], None]:
    """The `serve(cfg)` entry of service `name` (imported late: each pulls in its own dependencies)."""
    if name == "router":
        from pdserve.router.server import serve as serve_router

        return serve_router
    if name == "prefill":
        from pdserve.prefill.server import serve as serve_prefill

        return serve_prefill
    if name == "gateway":
        from pdserve.router.gateway.server import serve as serve_gateway

        return serve_gateway
    if name == "colocated":
        from pdserve.decode.colocated import serve as serve_colocated

        return serve_colocated
    from pdserve.decode.server import serve as serve_decode

    return serve_decode


def _preflight(name: str, cfg: Any) -> None:
    """Refuse an unsafe configuration before any slow startup (pdserve.server.security)."""
    if name == "gateway":
        return
    from pdserve.server.security import ServiceSecurity

    security = ServiceSecurity.of(cfg)
    ports = [("router", False), ("router internal port", True)] if name == "router" else [(name, True)]
    for what, internal in ports:
        why = security.refusal(what, cfg.host, internal)
        if why:
            raise SystemExit(why)


def cmd_serve(name: str, argv: list[str]) -> int:
    if name != "gateway":  # first thing: a SIGTERM during a slow startup ends the process (pdserve.server.shutdown)
        from pdserve.server.shutdown import Shutdown

        Shutdown.install(name)
    from pdserve.server.launcher_watch import watch_launcher

    watch_launcher(os.environ)  # started by `pdserve up`: SIGTERM to itself once that launcher is gone
    cls, prefix = _service(name)
    parser = argparse.ArgumentParser(
        prog=f"pdserve serve {name}", description=f"Run one {name} instance (flags override {prefix}* env vars)."
    )
    add_dataclass_args(parser, cls, env_prefix=prefix)
    cfg: Any = config_from(cls, parser.parse_args(argv), prefix)
    from pdserve.server.runner import setup_logging

    setup_logging(cfg.log_level)
    _preflight(name, cfg)
    if getattr(cfg, "model", ""):  # a hub id (org/name) is fetched into the HF cache first (pdserve.models.hub)
        from pdserve.models.hub import model_dir_or_exit, served_name

        if hasattr(cfg, "served_model_name") and not cfg.served_model_name:  # as vLLM: the name --model gives
            cfg.served_model_name = served_name(cfg.model)
        cfg.model = model_dir_or_exit(cfg.model)
    _server_main(name)(cfg)
    return 0


# ---- health ---------------------------------------------------------------------------------------------------
def cmd_health(argv: list[str]) -> int:
    """Exit 0 when the grpc.health.v1 service at TARGET answers SERVING, else 1 (container health checks)."""
    p = argparse.ArgumentParser(prog="pdserve health", description="Check a service through grpc.health.v1.")
    p.add_argument(
        "target",
        nargs="?",
        default=os.environ.get("PDSERVE_HEALTH_TARGET", DEFAULT_TARGET),
        help="HOST:PORT (default: $PDSERVE_HEALTH_TARGET, else %(default)s)",
    )
    p.add_argument("--service", default="", help="health service name (default: '', the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    p.add_argument("--tls-ca", default="", help="PEM CA to verify the service with (default: $PDSERVE_TLS_CA)")
    p.add_argument("--tls-cert", default="", help="client certificate (mTLS ports; default: $PDSERVE_TLS_CERT)")
    p.add_argument("--tls-key", default="", help="key of --tls-cert (default: $PDSERVE_TLS_KEY)")
    args = p.parse_args(argv)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.server.grpc_util import channel
    from pdserve.server.security import ChannelSecurity, tls_from

    security = ChannelSecurity(tls_from(args.tls_cert, args.tls_key, args.tls_ca, os.environ))  # health needs no token
    with channel(args.target, security) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# ---- generate -------------------------------------------------------------------------------------------------
GENERATE_CHAT_MAX_TOKENS = 512  # the reply's cap under the chat template when --max-tokens is not given
NO_CHAT_TEMPLATE = "has no chat template"  # in the router's INVALID_ARGUMENT for messages (router/chat.py)


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve generate",
        description="Stream the model's answer to PROMPT to the terminal. The prompt goes in as one user turn "
        "under the model's chat template (as `ollama generate` does), or as plain text to continue with --raw "
        "(also used, with a note, when the model has no chat template).",
    )
    p.add_argument("prompt", help="the prompt text (a user turn; with --raw, text to continue)")
    add_target_arg(p)
    p.add_argument(
        "--raw",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a plain completion of the prompt text, no chat template (default: off)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens to generate (default: {GENERATE_CHAT_MAX_TOKENS} under the chat template, less when the "
        "context left is shorter; 16 with --raw)",
    )
    model_default = "default: the model's generation_config.json, else temperature 1.0, top_p 1.0, top_k off"
    p.add_argument("--temperature", type=float, default=None, help=model_default)
    p.add_argument("--top-p", type=float, default=None, help=model_default)
    p.add_argument("--top-k", type=int, default=None, help=model_default)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh draw)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole call (default: %(default)s)")
    p.add_argument(
        "--model", default="", help="the served model to use (default: the router's only one; several served: name one)"
    )
    add_client_args(p)  # --token, --tls-ca, --tls
    return p


def cmd_generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    import grpc

    from pdserve.client import Client

    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "model": args.model,
    }
    turn = [{"role": "user", "content": args.prompt}]
    chat_max = args.max_tokens if args.max_tokens is not None else GENERATE_CHAT_MAX_TOKENS
    with Client(args.target, timeout=args.timeout, **client_options(args)) as c:
        try:
            last = None
            try:
                chunks = (
                    c.stream(args.prompt, max_tokens=args.max_tokens, **sampling)
                    if args.raw
                    else c.stream(messages=turn, max_tokens=chat_max, **sampling)
                )
                first = next(chunks, None)
            except grpc.RpcError as e:
                if args.raw or e.code() != grpc.StatusCode.INVALID_ARGUMENT or NO_CHAT_TEMPLATE not in e.details():
                    raise
                print("note: the model has no chat template; a plain completion (--raw)", file=sys.stderr)
                chunks = c.stream(args.prompt, max_tokens=args.max_tokens, **sampling)
                first = next(chunks, None)
            for chunk in itertools.chain([first] if first is not None else [], chunks):  # streamed as they come
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if last is not None and last.usage is not None:
        print(
            f"\n[finish={last.finish_reason} prompt_tokens={last.usage.prompt_tokens} "
            f"completion_tokens={last.usage.completion_tokens}]",
            file=sys.stderr,
        )
    return 0


def version() -> str:
    """The installed package's version (the source tree's pyproject when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pdserve")
    except PackageNotFoundError:
        return "unknown"


COMMANDS = ("up", "serve", "generate", "health", "chat", "bench")
SERVICES = ("router", "prefill", "decode", "colocated", "gateway")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (
        "usage: pdserve up [--model DIR|ORG/NAME] [--port N] [--prefill N] [--decode M] [--kv-cache-memory SIZE] ...\n"
        "       pdserve up --colocated [N] ...   (N engines that prefill and decode, behind the router)\n"
        "       pdserve serve router|prefill|decode|colocated|gateway [flags]   (--help for flags)\n"
        "       pdserve generate [--target HOST:PORT] [--raw] PROMPT   (chat template unless --raw)\n"
        "       pdserve health [HOST:PORT] [--service NAME]   (exit 0 when SERVING)\n"
        "       pdserve chat [--target HOST:PORT] [--system TEXT]   (interactive; /reset, /exit, Ctrl-D)\n"
        "       pdserve bench --target HOST:PORT --tokenizer MODEL_DIR --rates 1,2,4 ...   (load, latency, goodput)\n"
        "       pdserve --version\n"
        "Each command takes --help. Client commands read $PDSERVE_TARGET (default localhost:50051)."
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"pdserve {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        from pdserve.cli.up import cmd_up

        return cmd_up(rest)
    if cmd == "serve":
        if not rest or rest[0] not in SERVICES:
            got = f"unknown service {rest[0]!r}" if rest and not rest[0].startswith("-") else "no service given"
            print(f"pdserve serve: {got}; choose one of {', '.join(SERVICES)} (then --help for its flags)",
                  file=sys.stderr)  # fmt: skip
            return 2
        return cmd_serve(rest[0], rest[1:])
    if cmd == "generate":
        return cmd_generate(rest)
    if cmd == "health":
        return cmd_health(rest)
    if cmd == "chat":
        from pdserve.cli.chat import cmd_chat

        return cmd_chat(rest)
    if cmd == "bench":  # pdserve.bench.cli: load generator, latency / goodput report, plots
        from pdserve.bench.cli import cmd_bench

        return cmd_bench(rest)
    print(f"{usage}\n\npdserve: unknown command {cmd!r}; the commands are {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
