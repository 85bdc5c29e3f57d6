"""`pdserve up`: the whole stack on loopback: router, N prefill + M decode (or N colocated) instances, the HTTP
gateway, as separate processes (`pdserve.cli.launch`).

Its flags come in three groups: the stack's shape, ports and placement (defined here); the settings every service
shares (`ServerOptions`: the flags of `pdserve serve`); and every engine setting of `pdserve serve
prefill|decode|colocated` (`EngineServiceConfig`), handed as given to each engine instance, so that a setting not
given keeps each service's own default (one place: the config dataclasses).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdserve.cli.mps import DEFAULT_PREFILL_SM_PERCENT, shared_gpus, want_mps
from pdserve.cli.mps import MODES as MPS_MODES
from pdserve.config import Setting, add_dataclass_args, config_from, given_flags, settings
from pdserve.server.service_config import EngineServiceConfig, ServerOptions

SHARED = ("log_level", "tls_cert", "tls_key", "tls_ca", "insecure", "drain_grace_s")  # as `pdserve serve` has them
ENV = "PDSERVE_<SERVICE>_"  # each service reads its own: PDSERVE_PREFILL_*, PDSERVE_DECODE_*, PDSERVE_ROUTER_*
STOP_MARGIN_S = 10.0  # beyond the drain grace: the services' own end margins, then SIGKILL
OWN = ("model", "router")  # engine settings `up` decides: its --model (or the demo model), the static list
PROCESS = ("torch_threads", "gil_switch_interval_us")  # how an engine instance's process runs its engine


def _engine_setting(s: Setting) -> bool:
    """A setting `up` hands to each engine instance: the engine's (`engine.*`) and how its process runs it."""
    return s.name not in OWN and s.name not in SHARED and (s.path[0] == "engine" or s.name in PROCESS)


def engine_settings() -> list[Setting]:
    return [s for s in settings(EngineServiceConfig) if _engine_setting(s)]


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve up",
        description="Run router + N prefill + M decode (or N colocated) + the HTTP gateway on loopback. Ctrl-C once: "
        "the services drain their in-flight requests (--drain-grace-s), twice: stop at once.",
        epilog=f"Engine and service flags not given here keep each service's default, or its environment variable "
        f"({ENV}NAME, e.g. PDSERVE_DECODE_KV_CACHE_MEMORY).",
    )
    stack = p.add_argument_group("the stack")
    stack.add_argument(
        "--model",
        action="append",
        help="HF model directory or Hugging Face Hub id org/name (default: $PDSERVE_MODEL, else the demo model "
        "SmolLM2-135M-Instruct, fetched once); repeat it to serve several models behind the one router, each with "
        "its own instances (--prefill / --decode or --colocated of them) and named by its hub id or directory "
        "name in requests' `model`",
    )
    stack.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PDSERVE_PORT", "50051")),
        help="router gRPC port, 0 = any free port (default: %(default)s; $PDSERVE_PORT)",
    )
    stack.add_argument("--host", default=ServerOptions.host, help="router and gateway interface (default: %(default)s)")
    stack.add_argument(
        "--gateway-port",
        type=int,
        default=int(os.environ.get("PDSERVE_GATEWAY_PORT", "8000")),
        help="OpenAI-compatible HTTP gateway port, 0 = any free port, -1 = no gateway (default: %(default)s; "
        "$PDSERVE_GATEWAY_PORT)",
    )
    stack.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("PDSERVE_METRICS_PORT", "0")),
        help="Prometheus /metrics ports counting up from this one: the router's, then each engine instance's; "
        "0 = any free ports, -1 = off (default: %(default)s; $PDSERVE_METRICS_PORT)",
    )
    stack.add_argument("--prefill", type=int, default=None, help="prefill instances (default: 1)")
    stack.add_argument("--decode", type=int, default=None, help="decode instances (default: 1)")
    stack.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="instead of prefill + decode: N colocated instances (N default 1), each one engine that prefills in "
        "chunks in its decode steps (--chunk-size: the prefill tokens per step, the colocated default then) "
        "(default: on one GPU the mode that measured the higher goodput, see --disaggregated; else off)",
    )
    stack.add_argument(
        "--disaggregated",
        action="store_true",
        help="prefill + decode instances even where the measured choice is colocated (default: with neither flag "
        "nor --prefill / --decode, one GPU runs the mode of the higher goodput measured by bench/one_gpu.py, "
        "pdserve/data/mode_choice.json; two GPUs or more and CPU run prefill + decode)",
    )
    stack.add_argument(
        "--gpus",
        default=os.environ.get("PDSERVE_GPUS", ""),
        help="GPU ids for the engine instances, e.g. 0,1 (default: every visible GPU; 'none': each engine's own "
        "device choice); prefill and decode get separate GPUs where there are enough, round-robin within each; "
        "an instance of --tensor-parallel-size N takes N consecutive ones (so 0,1,2,3 at N=2: two instances' "
        "worth; a count that is not a multiple of N is refused); --gpu-memory-utilization is then split evenly "
        "among the instances of a GPU ($PDSERVE_GPUS)",
    )
    stack.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallel size of the prefill instances when it differs from the decode ones' "
        "(--tensor-parallel-size; KV pages move between any two sizes) (default: --tensor-parallel-size)",
    )
    stack.add_argument(
        "--mps",
        choices=MPS_MODES,
        default=os.environ.get("PDSERVE_MPS", "auto"),
        help="CUDA MPS for a GPU that a prefill and a decode instance share: the stack's own MPS daemon, so their "
        "kernels run side by side instead of in time slices; auto = on where a GPU is shared and "
        "nvidia-cuda-mps-control is found (default: %(default)s; $PDSERVE_MPS)",
    )
    stack.add_argument(
        "--mps-prefill-sm-percent",
        type=int,
        default=int(os.environ.get("PDSERVE_MPS_PREFILL_SM_PERCENT", str(DEFAULT_PREFILL_SM_PERCENT))),
        metavar="P",
        help="under MPS, the share of the GPU's SMs a prefill instance may use (1-100; decode gets them all; the "
        "decode yields to the prefill within its TPOT bound, so all by default; 90 protects the decode steps of a "
        "stack whose decode does not yield) (default: %(default)s; $PDSERVE_MPS_PREFILL_SM_PERCENT)",
    )
    stack.add_argument(
        "--print-plan",
        action="store_true",
        help="print the mode and each engine instance's GPUs, then exit without starting anything",
    )
    stack.add_argument(
        "--router-config", default="", help="router TOML config file, see docs/router.md (default: none)"
    )
    stack.add_argument(
        "--auth-tokens-file", default="", help="public API bearer tokens, `token tenant` lines (default: auth off)"
    )
    stack.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds each service may take to start (default: %(default)s)",
    )
    add_dataclass_args(
        p.add_argument_group("every service"), ServerOptions, only=lambda s: s.name in SHARED, env_prefix=ENV
    )
    engines = p.add_argument_group("engine instances (as `pdserve serve prefill|decode|colocated`)")
    add_dataclass_args(engines, EngineServiceConfig, only=_engine_setting, env_prefix=ENV)
    return p


def cmd_up(argv: list[str]) -> int:
    p = up_parser()
    args = p.parse_args(argv)
    model_args = args.model or [os.environ.get("PDSERVE_MODEL", "")]  # several: pdserve.router.catalog
    args.model = model_args[0]
    gpus, mode = _choose_mode(p, args)  # sets args.colocated / args.prefill / args.decode
    print(mode.line(), flush=True)
    if args.colocated:  # one colocated instance per engine: the placement treats them as decode instances
        args.prefill, args.decode = 0, args.colocated
    engine = _engine_config(args)  # refuses bad engine settings before anything starts
    prefill_tp, decode_tp = _tp_sizes(p, args, engine.tensor_parallel_size)
    if args.torch_threads is None:  # the cores shared among the engine processes (every rank is one)
        ranks = args.prefill * (prefill_tp or 1) + args.decode * (decode_tp or 1)
        args.torch_threads = max(1, (os.cpu_count() or 2) // (ranks * len(model_args)))

    from pdserve.cli.launch import decode_yield_line, plan_placement, start_stack

    try:
        plan = plan_placement(args.prefill, args.decode, gpus, engine.gpu_memory_utilization, prefill_tp, decode_tp)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.mps_prefill_sm_percent <= 100:
        p.error(f"--mps-prefill-sm-percent wants 1..100, got {args.mps_prefill_sm_percent}")
    try:
        _, mps_line = want_mps(args.mps, plan, os.environ)
    except ValueError as e:
        p.error(str(e))
    for pl in plan:
        role = "colocated" if args.colocated else pl.role
        if pl.gpus:
            print(f"{role} {pl.index}: {pl.describe()}", flush=True)
        elif pl.tp is not None and pl.tp > 1:
            print(f"{role} {pl.index}: tensor parallel {pl.tp} (the engine's device, one process per rank)", flush=True)
    if shared_gpus(plan):
        print(f"pdserve up: {mps_line}", flush=True)
    if args.print_plan:
        return 0

    try:
        served = _served_models(model_args)  # [(name, directory)], the first one the router's own
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (model_name, model), more_models = served[0], served[1:]

    shared = {name: given_flags(args, [s for s in settings(ServerOptions) if s.name == name]) for name in SHARED}
    tls = [*shared["tls_cert"], *shared["tls_key"], *shared["tls_ca"]]
    auth = ["--auth-tokens-file", args.auth_tokens_file] if args.auth_tokens_file else []
    if not (args.tls_cert or os.environ.get("PDSERVE_TLS_CERT")):
        print(
            "pdserve up: PLAINTEXT (no TLS): fine on loopback only. Internal ports accept only this stack's random "
            "internal token; --tls-cert/--tls-key/--tls-ca for TLS and mTLS (docs/security.md)",
            flush=True,
        )
    if not auth:
        print('pdserve up: public API auth off (no --auth-tokens-file): every caller is tenant "default"', flush=True)
    router_extra = [
        *(["--config", args.router_config] if args.router_config else []),
        *shared["log_level"],
        *tls,
        *auth,
        *shared["insecure"],
    ]
    if shared_gpus(plan):
        print(f"pdserve up: {decode_yield_line(router_extra, os.environ, str(model))}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    stack = None
    t0 = time.monotonic()
    try:
        stack = start_stack(
            model,
            Path(tempfile.mkdtemp(prefix="pdserve-up-")),
            extra=[*given_flags(args, engine_settings()), *shared["log_level"], *tls],
            router_port=args.port,
            router_host=args.host,
            to_terminal=True,
            timeout=args.ready_timeout,
            num_prefill=args.prefill,
            num_decode=args.decode,
            router_extra=router_extra,
            gateway_extra=[*shared["log_level"], *shared["tls_ca"], *shared["insecure"]],
            persist_estimator=True,
            gateway_port=None if args.gateway_port < 0 else args.gateway_port,
            model_name=model_name,
            gpus=gpus,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            num_colocated=args.colocated,
            metrics_port=args.metrics_port,
            more_models=more_models,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            mps=args.mps,
            mps_prefill_sm_percent=args.mps_prefill_sm_percent,
        )
        engines = (
            f"colocated {', '.join(stack.colocated)}"
            if args.colocated
            else f"prefill {', '.join(stack.prefill)}, decode {', '.join(stack.decode)}"
        )
        internal = getattr(stack.router, "internal", stack.router)
        print(  # one write of the line (as PDSERVE_READY): the services share this stdout
            f"pdserve is up: router at {stack.router}  (internal {internal}; {engines}, kv {engine.kv_dtype})\n",
            end="",
            flush=True,
        )
        for name, addrs in stack.models.items():
            print(f"model {name!r}: {', '.join(addrs)}", flush=True)
        if stack.gateway:
            print(f"OpenAI-compatible gateway at http://{stack.gateway}/v1  (model {model_name!r})", flush=True)
        if more_models:
            print(f"models served (requests' `model`): {', '.join(repr(n) for n, _ in served)}", flush=True)
        metrics = _metrics_lines(stack)
        if metrics:
            print("metrics (Prometheus):  " + "  ".join(metrics), flush=True)
        print(f"ready in {time.monotonic() - t0:.1f} s; Ctrl-C to stop (the services drain first)", flush=True)
        print(f'try:  pdserve generate --target {stack.router} "hello"', flush=True)
        print(f"      pdserve chat --target {stack.router}", flush=True)
        why = _serve_until_unservable(stack)
        print(f"error: {why}; stopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if stack is not None:
            _drain(stack, args.drain_grace_s)
            stack = None
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def _serve_until_unservable(stack) -> str:
    """Wait while the stack can serve (`Stack.unservable`); an engine instance that exits meanwhile (e.g. one rank
    of a tensor-parallel instance died and took its instance down) is reported once and left to the router's
    failover. Returns why the stack stopped serving."""
    reported: set[int] = set()
    while not (why := stack.unservable()):
        for i, proc in enumerate(stack.procs):
            if proc.poll() is not None and i not in reported:
                reported.add(i)
                print(
                    f"pdserve up: {stack.roles[i]} instance (pid {proc.pid}) exited with code {proc.returncode}; "
                    "the router fails its requests over to the others",
                    file=sys.stderr,
                    flush=True,
                )
        time.sleep(0.5)
    return why


def _choose_mode(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The GPUs of `--gpus` and the serving mode: the one a flag forces (`--colocated N`, `--disaggregated`,
    `--prefill` / `--decode`), else `pdserve.cli.mode_choice`'s rule (one GPU: the measured better mode). Sets
    `args.colocated` (0: prefill + decode), `args.prefill`, `args.decode`; conflicting flags stop it."""
    from pdserve.cli.launch import parse_gpus, visible_gpus
    from pdserve.cli.mode_choice import choose_mode, forced_mode, load_measurements

    split_given = args.disaggregated or args.prefill is not None or args.decode is not None
    if args.colocated and split_given:
        p.error("--colocated runs colocated engines: it excludes --disaggregated, --prefill and --decode")
    if args.colocated < 0 or any(n is not None and n < 1 for n in (args.prefill, args.decode)):
        p.error("--prefill and --decode must be >= 1 (--colocated >= 0)")
    args.prefill, args.decode = args.prefill or 1, args.decode or 1
    try:
        gpus = parse_gpus(args.gpus, visible_gpus)
    except ValueError as e:
        p.error(str(e))
    if args.colocated or split_given:
        return gpus, forced_mode(args.colocated, args.disaggregated)
    try:  # the flag's value (a size given only in the environment is resolved with the engine settings)
        decode_tp = max(1, int(args.tensor_parallel_size or 1))
    except ValueError:
        p.error(f"--tensor-parallel-size wants an integer, got {args.tensor_parallel_size!r}")
    mode = choose_mode(gpus, load_measurements(), args.prefill_tensor_parallel_size or decode_tp, decode_tp)
    args.colocated = 1 if mode.colocated else 0
    return gpus, mode


def _tp_sizes(p: argparse.ArgumentParser, args: argparse.Namespace, engine_tp: int) -> tuple[int | None, int | None]:
    """(prefill, decode) tensor parallel sizes the placement hands each instance (`--tensor-parallel-size` of its
    role): None for both when every instance runs at 1 and no size was asked for (each keeps its own setting)."""
    from pdserve.engine.tp.layout import MAX_TP_SIZE

    prefill_tp = args.prefill_tensor_parallel_size
    if prefill_tp is not None and not 1 <= prefill_tp <= MAX_TP_SIZE:
        p.error(f"--prefill-tensor-parallel-size must be in 1..{MAX_TP_SIZE}, got {prefill_tp}")
    if prefill_tp is not None and args.colocated:
        p.error("--prefill-tensor-parallel-size is for prefill instances; colocated ones take --tensor-parallel-size")
    if prefill_tp is None and engine_tp == 1:
        return None, None
    return (engine_tp if prefill_tp is None else prefill_tp), engine_tp


def _served_models(model_args: list[str]) -> list[tuple[str, str]]:
    """(served name, local directory) of each `--model` ("": the demo model), fetching hub ids; ValueError when
    one names no usable model or two share a name."""
    from pdserve.models.hub import ModelNotFound, resolve_model

    say = lambda line: print(line, flush=True)  # noqa: E731
    served: list[tuple[str, str]] = []
    for value in model_args:
        if not value:
            from pdserve.models.demo import ensure_demo_model

            path = str(ensure_demo_model(say=say))
            served.append((Path(path).name, path))
            continue
        try:  # a model directory, or a hub id fetched into the HF cache (pdserve.models.hub)
            resolved = resolve_model(value, say=say)
        except ModelNotFound as e:
            raise ValueError(str(e)) from None
        served.append((resolved.name, str(resolved.path)))
    names = [n for n, _ in served]
    if len(set(names)) != len(names):
        raise ValueError(f"two --model values are served under one name: {', '.join(names)}")
    return served


def _metrics_lines(stack) -> list[str]:
    """`name http://host:port/metrics` of every service that serves /metrics (the gateway on its own port)."""
    named = [("router", stack.router)]
    for role in ("prefill", "decode", "colocated"):
        named += [(f"{role}{i}", a) for i, a in enumerate(getattr(stack, role))]
    for name, addrs in getattr(stack, "models", {}).items():
        named += [(f"{name}:{i}", a) for i, a in enumerate(addrs)]
    lines = [f"{name} http://{a.metrics}/metrics" for name, a in named if getattr(a, "metrics", "")]
    return [*lines, f"gateway http://{stack.gateway}/metrics"] if stack.gateway else lines


def _drain(stack, grace_flag: str | None) -> None:
    """The first SIGINT / SIGTERM: every service drains (finishes in-flight requests within its drain grace) and
    exits; a second one during that ends them at once."""
    grace = float(grace_flag) if grace_flag is not None else ServerOptions.drain_grace_s
    print(
        f"pdserve up: stopping: draining in-flight requests (up to {grace:g} s); Ctrl-C again to stop at once",
        flush=True,
    )
    try:
        stack.stop(timeout=grace + STOP_MARGIN_S)
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        print("pdserve up: second signal: stopping at once", file=sys.stderr, flush=True)
        stack.signal_all()  # a service's second signal ends it at once
        stack.stop(timeout=5.0)
    print("pdserve up: stopped", flush=True)


def _engine_config(args: argparse.Namespace):
    """The EngineConfig the engine instances will run (the decode / colocated one: the same settings), built as
    they build it (flags given here, then their environment, then their defaults); SystemExit when it is bad."""
    from pdserve.decode import colocated_config, config

    cls, prefix = (
        (colocated_config.ColocatedConfig, colocated_config.ENV_PREFIX)
        if args.colocated
        else (config.DecodeConfig, config.ENV_PREFIX)
    )
    given = {s.name: getattr(args, s.name) for s in engine_settings()}
    return config_from(cls, argparse.Namespace(model=args.model or "(the demo model)", **given), prefix).engine


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
