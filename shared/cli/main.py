"""The `pdserve` command: `up` (whole stack on loopback), `serve <service>` (router, prefill, decode, gateway),
`generate`, `chat` (`pdserve.cli.chat`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.cli.client_args import add_client_args, client_options
from pdserve.config import add_dataclass_args, config_from

DEFAULT_TARGET = "localhost:50051"


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
    cls, prefix = _service(name)
    parser = argparse.ArgumentParser(
        prog=f"pdserve serve {name}", description=f"Run one {name} instance (flags override {prefix}* env vars)."
    )
    add_dataclass_args(parser, cls)
    cfg: Any = config_from(cls, parser.parse_args(argv), prefix)
    from pdserve.server.runner import setup_logging

    setup_logging(cfg.log_level)
    _preflight(name, cfg)
    _server_main(name)(cfg)
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


# ---- up -------------------------------------------------------------------------------------------------------
def cmd_up(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve up", description="Run router + N prefill + M decode on loopback.")
    p.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_MODEL", ""),
        help="HF model directory (default: the demo model SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("PDSERVE_PORT", "50051")), help="router port (0 = any free port)"
    )
    p.add_argument("--host", default="127.0.0.1", help="router interface")
    p.add_argument(
        "--gateway-port",
        type=int,
        default=int(os.environ.get("PDSERVE_GATEWAY_PORT", "8000")),
        help="OpenAI-compatible HTTP gateway port (0 = any free port, -1 = no gateway)",
    )
    p.add_argument("--kv-dtype", choices=["int8", "fp8", "auto"], default="int8")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default 2048; colocated: 512)")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="instead of prefill + decode: N colocated instances (default 1), each one engine that prefills in "
        "chunks between decode steps (--chunk-size: the prefill tokens per step, default 512 in this mode)",
    )
    p.add_argument(
        "--gpus",
        default=os.environ.get("PDSERVE_GPUS", ""),
        help="GPU ids for the engine instances, e.g. 0,1 (default: every visible GPU; 'none': each engine's own "
        "device choice); prefill and decode get separate GPUs where there are enough, round-robin within each",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="fraction of each GPU's total memory its instances may fill together (split evenly among them)",
    )
    p.add_argument("--router-config", default="", help="router TOML config file (see docs/router.md)")
    # security (docs/security.md): without TLS the stack is plaintext on loopback; internal calls need its token
    p.add_argument("--tls-cert", default=os.environ.get("PDSERVE_TLS_CERT", ""), help="PEM cert of every service")
    p.add_argument("--tls-key", default=os.environ.get("PDSERVE_TLS_KEY", ""), help="PEM key of --tls-cert")
    p.add_argument("--tls-ca", default=os.environ.get("PDSERVE_TLS_CA", ""), help="PEM internal CA (mTLS)")
    p.add_argument("--auth-tokens-file", default="", help="public API bearer tokens (`token tenant` lines)")
    p.add_argument("--insecure", action="store_true", help="allow plaintext on a non-loopback --host")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="CPU threads per engine process (default: the cores shared among the engine processes)",
    )
    args = p.parse_args(argv)
    if args.prefill < 1 or args.decode < 1 or args.colocated < 0:
        p.error("--prefill and --decode must be >= 1 (--colocated >= 0)")
    if args.colocated:  # one colocated instance per engine: the placement treats them as decode instances
        args.prefill, args.decode = 0, args.colocated
    if args.chunk_size is None:
        args.chunk_size = 512 if args.colocated else 2048
    args.torch_threads = args.torch_threads or max(1, (os.cpu_count() or 2) // (args.prefill + args.decode))

    from pdserve.cli.launch import plan_placement, start_stack, visible_gpus

    try:
        gpus = parse_gpus(args.gpus, visible_gpus)
        plan = plan_placement(args.prefill, args.decode, gpus, args.gpu_memory_utilization)
    except ValueError as e:
        p.error(str(e))
    for pl in plan:
        if pl.gpu is not None:
            role = "colocated" if args.colocated else pl.role
            print(f"{role} {pl.index}: cuda:{pl.gpu}, {pl.memory_fraction:.0%} of its memory", flush=True)

    model = args.model
    if not model:
        from pdserve.models.demo import ensure_demo_model

        model = str(ensure_demo_model(say=lambda line: print(line, flush=True)))
    elif not (Path(model) / "config.json").exists():
        print(f"error: {model} is not a model directory (no config.json)", file=sys.stderr)
        return 2

    tls = [f for flag, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca))
           if v for f in (flag, v)]  # fmt: skip
    insecure = ["--insecure"] if args.insecure else []
    auth = ["--auth-tokens-file", args.auth_tokens_file] if args.auth_tokens_file else []
    if not args.tls_cert:
        print(
            "pdserve up: PLAINTEXT (no TLS): fine on loopback only. Internal ports accept only this stack's random "
            "internal token; --tls-cert/--tls-key/--tls-ca for TLS and mTLS (docs/security.md)",
            flush=True,
        )
    if not auth:
        print('pdserve up: public API auth off (no --auth-tokens-file): every caller is tenant "default"', flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    stack = None
    try:
        stack = start_stack(
            model,
            Path(tempfile.mkdtemp(prefix="pdserve-up-")),
            kv_dtype=args.kv_dtype,
            page_size=args.page_size,
            chunk_size=args.chunk_size,
            extra=[
                *("--dtype", args.dtype, "--log-level", args.log_level, "--torch-threads", str(args.torch_threads)),
                *tls,
            ],
            router_port=args.port,
            router_host=args.host,
            to_terminal=True,
            timeout=args.ready_timeout,
            num_prefill=args.prefill,
            num_decode=args.decode,
            router_extra=[*(["--config", args.router_config] if args.router_config else []), *tls, *auth, *insecure],
            gateway_extra=[*(["--tls-ca", args.tls_ca] if args.tls_ca else []), *insecure],
            persist_estimator=True,
            gateway_port=None if args.gateway_port < 0 else args.gateway_port,
            model_name=Path(model).name,
            gpus=gpus,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_colocated=args.colocated,
        )
        engines = (
            f"colocated {', '.join(stack.colocated)}"
            if args.colocated
            else f"prefill {', '.join(stack.prefill)}, decode {', '.join(stack.decode)}"
        )
        internal = getattr(stack.router, "internal", stack.router)
        print(
            f"pdserve is up: router at {stack.router}  (internal {internal}; {engines}, kv {args.kv_dtype})", flush=True
        )
        if stack.gateway:
            print(f"OpenAI-compatible gateway at http://{stack.gateway}/v1  (model {Path(model).name!r})", flush=True)
        print(f'try:  pdserve generate --target {stack.router} "hello"', flush=True)
        print(f"      pdserve chat --target {stack.router}", flush=True)
        while all(proc.poll() is None for proc in stack.procs):
            time.sleep(0.5)
        print("error: a service exited; stopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def parse_gpus(text: str, visible) -> list[int]:
    """`--gpus`: "" = `visible()` (every GPU this host shows), "none" = no placement, else comma-separated ids."""
    text = text.strip()
    if not text:
        return visible()
    if text.lower() == "none":
        return []
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--gpus wants comma-separated GPU ids or 'none', got {text!r}") from None


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
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
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
def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve generate", description="Stream a completion to the terminal.")
    p.add_argument("prompt")
    p.add_argument("--target", default=os.environ.get("PDSERVE_TARGET", DEFAULT_TARGET))
    p.add_argument("--max-tokens", type=int, default=None, help="default: the API's, 16 for a prompt")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    add_client_args(p)  # --token, --tls-ca, --tls
    args = p.parse_args(argv)
    import grpc

    from pdserve.client import Client

    with Client(args.target, timeout=args.timeout, **client_options(args)) as c:
        try:
            last = None
            for chunk in c.stream(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
            ):
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (
        "usage: pdserve up [--model DIR] [--port N] [--prefill N] [--decode M] [--kv-dtype int8|fp8|auto] ...\n"
        "       pdserve up --colocated [N] ...   (N engines that prefill and decode, behind the router)\n"
        "       pdserve serve router|prefill|decode|colocated|gateway [flags]   (--help for flags)\n"
        "       pdserve generate [--target HOST:PORT] PROMPT\n"
        "       pdserve health [HOST:PORT] [--service NAME]   (exit 0 when SERVING)\n"
        "       pdserve chat [--target HOST:PORT] [--system TEXT]   (interactive; /reset, /exit, Ctrl-D)\n"
        "       pdserve bench --target HOST:PORT --tokenizer MODEL_DIR --rates 1,2,4 ...   (load, latency, goodput)"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        return cmd_up(rest)
    if cmd == "serve" and rest and rest[0] in ("router", "prefill", "decode", "colocated", "gateway"):
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
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
