"""Start router/prefill/decode as separate processes on loopback (`pdserve up`, tests, benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cli.mps import DEFAULT_PREFILL_SM_PERCENT, MpsDaemon, client_env, shared_gpus, want_mps
from pdserve.cli.placement import DECODE as DECODE  # placement's names, imported from here by callers
from pdserve.cli.placement import GPU_MEMORY_UTILIZATION, plan_placement
from pdserve.cli.placement import PREFILL as PREFILL
from pdserve.cli.placement import Placement as Placement
from pdserve.server.auth import new_token
from pdserve.server.launcher_watch import LAUNCHER_PID_ENV


class Address(str):
    """A service's host:port as its ready file gives it; `.internal`: the router's internal (Registry) port, which
    engines' `--router` and Registry calls use (the address itself for other services); `.metrics`: its Prometheus
    /metrics host:port ("" when off or not told)."""

    internal: str
    metrics: str

    def __new__(cls, address: str, internal: str = "", metrics: str = "") -> Address:
        self = super().__new__(cls, address)
        self.internal = internal or address
        self.metrics = metrics
        return self


@dataclass
class Stack:
    router: str  # an Address when started by start_stack (.internal, .metrics), as are the instances' addresses
    prefill: list[str]
    decode: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    gateway: str = ""  # the OpenAI-compatible HTTP gateway's host:port, when started
    internal_token: str = ""  # the stack's internal token (its processes got it as $PDSERVE_INTERNAL_TOKEN)
    colocated: list[str] = field(default_factory=list)  # colocated instances (instead of prefill + decode)
    models: dict[str, list[str]] = field(default_factory=dict)  # further models: served name -> engine addresses
    # per process of `procs`: what it serves, "router", "gateway" or an engine group "<role>" / "<role>:<model>"
    # (the instances of one group stand in for each other: the router fails a dead one's requests over)
    roles: list[str] = field(default_factory=list)
    # run once every process has ended (Stack.stop): the stack's own helpers outside `procs`, e.g. its MPS daemon
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def signal_all(self) -> None:
        """SIGTERM to every live process: the first makes a service drain (pdserve.server.shutdown), a second one
        ends it at once."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """Drain and end every process: SIGTERM, then up to `timeout` seconds in all for them to exit (a service
        lets its in-flight requests finish within its --drain-grace-s), then SIGKILL."""
        self.signal_all()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        while self.cleanup:
            self.cleanup.pop()()

    def unservable(self) -> str:
        """Why the stack can no longer serve ("" while it can): its router or gateway exited, or every instance of an
        engine group did. One instance of several exiting (a tensor-parallel rank died, it crashed) leaves its
        requests to the router's failover."""
        gone = [i for i, p in enumerate(self.procs) if p.poll() is not None]
        if not self.roles:  # a stack not started by start_stack: any exit is fatal
            return "a service exited" if gone else ""
        for i in gone:
            if self.roles[i] in ("router", "gateway"):
                return f"the {self.roles[i]} exited with code {self.procs[i].returncode}"
        groups: dict[str, list[int]] = {}
        for i, role in enumerate(self.roles):
            if role not in ("router", "gateway"):
                groups.setdefault(role, []).append(i)
        for role, members in groups.items():
            if all(i in gone for i in members):
                return f"every {role} instance exited"
        return ""

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in self.logs if p.exists())


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


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA (Linux, WSL2), ROCm: torch.cuda may see GPUs


def visible_gpus() -> list[int]:
    """Ids of the CUDA devices this process sees (empty without CUDA). Torch is asked in a child process, so the
    launcher itself never loads it (~200 MB it would hold for the stack's lifetime); without a GPU driver's device
    node it is not asked at all."""
    if not any(Path(node).exists() for node in GPU_DEVICE_NODES):
        return []
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return list(range(int(out.stdout.strip().splitlines()[-1])))


def start_service(
    name: str, args: list[str], workdir: Path, env: dict | None = None, to_terminal: bool = False
) -> tuple[subprocess.Popen, Path, Path]:
    """Start `pdserve serve NAME ARGS`; its output goes to workdir/NAME<i>.log (or the terminal)."""
    idx = len(list(workdir.glob(f"{name}*.json*"))) + len(list(workdir.glob(f"{name}*.log")))
    ready = workdir / f"{name}{idx}.json"
    log = workdir / f"{name}{idx}.log"
    out = None if to_terminal else log.open("w")
    if to_terminal:
        log.touch()  # reserves the index: a second instance started before this one is ready gets the next one
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", name, "--ready-file", str(ready), *args],
        stdout=out,
        stderr=None if to_terminal else subprocess.STDOUT,
        env={**os.environ, **(env or {}), LAUNCHER_PID_ENV: str(os.getpid())},  # it ends if this process dies
        # its own session: a terminal's Ctrl-C (SIGINT to the whole foreground process group) reaches only the
        # launcher, which stops the services one signal each (Stack.stop); with the terminal's SIGINT too, every
        # service would see two signals and exit without draining
        start_new_session=True,
    )
    return proc, ready, log


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float = 300.0) -> Address:
    """Block until the service wrote its ready file; returns its host:port (the router's: `.internal` too)."""
    deadline = time.monotonic() + timeout
    tail = lambda: log.read_text()[-4000:] if log.exists() else ""  # noqa: E731
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{ready.stem} exited with code {proc.returncode} before it was ready\n{tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ready.stem} not ready after {timeout:.0f}s\n{tail()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return Address(info["address"], info.get("internal_address", ""), info.get("metrics", ""))


def start_stack(
    model: Path | str,
    workdir: Path,
    kv_dtype: str | None = None,
    page_size: int | None = None,
    chunk_size: int | None = None,
    num_prefill: int = 1,
    num_decode: int = 1,
    extra: Sequence[str] = (),
    router_port: int = 0,
    router_host: str = "127.0.0.1",
    to_terminal: bool = False,
    timeout: float = 300.0,
    router_extra: Sequence[str] = (),
    persist_estimator: bool = False,
    gateway_port: int | None = None,
    model_name: str = "pdserve",
    gpus: list[int] | None = None,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    num_colocated: int = 0,
    gateway_extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    metrics_port: int = 0,
    more_models: Sequence[tuple[str, str]] = (),
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    mps: str = "off",
    mps_prefill_sm_percent: int = DEFAULT_PREFILL_SM_PERCENT,
) -> Stack:
    """Start prefill and decode instances on free ports, then a router wired to them (its static list;
    `kv_dtype`, `page_size`, `chunk_size`: engine flags, None = each service's default;
    `router_extra` adds router flags, e.g. `--config FILE`). The router's output-length estimator is kept in
    `workdir` (each stack starts cold) unless `persist_estimator` (`pdserve up`: its config or the cache dir).
    With `gateway_port` (0 = any free port) an OpenAI-compatible gateway serving `model_name` starts last.
    `gpus` places the engine instances (`plan_placement`: `--device cuda:N`, each GPU's memory fraction split
    among its instances; `prefill_tp` / `decode_tp`: their `--tensor-parallel-size`, each instance on that many
    consecutive GPUs; colocated instances take `decode_tp`); None or [] leaves the device to each engine.
    `num_colocated` > 0: that many colocated instances (`pdserve serve colocated`, each prefills and decodes)
    instead of the prefill and decode ones.
    Security: every process gets `env` and the stack's internal token ($PDSERVE_INTERNAL_TOKEN: the caller's
    environment's, else a new random one) and one prompt-cache secret its prefill / colocated instances share
    ($PDSERVE_CACHE_SECRET_FILE: the caller's, else a new one in workdir/cache_secret, mode 0400); TLS / auth flags
    go in `extra`, `router_extra`, `gateway_extra`. `metrics_port` > 0: the services' /metrics ports count up from
    it (router, then the engine instances in order); 0: each picks a free port, -1: off.
    Several models: `model` is served as `model_name` (the router's own --model: static instances); each of
    `more_models` ((served name, model directory)) gets as many instances again, which register with the router
    under that name (`Stack.models`); every model's instances share the GPUs (the memory split among them all).
    `mps` (auto / on / off, `pdserve.cli.mps.want_mps`): a CUDA MPS daemon of the stack's own for the instances on
    a GPU that prefill and decode share, the prefill ones limited to `mps_prefill_sm_percent` of its SMs."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(env or {})
    token = env.get("PDSERVE_INTERNAL_TOKEN") or os.environ.get("PDSERVE_INTERNAL_TOKEN") or new_token()
    env["PDSERVE_INTERNAL_TOKEN"] = token
    from pdserve.cache.value_auth import ENV_SECRET, ENV_SECRET_FILE, write_secret_file  # pdserve.cache: torch

    if not any(env.get(k) or os.environ.get(k) for k in (ENV_SECRET, ENV_SECRET_FILE)):
        env[ENV_SECRET_FILE] = str(write_secret_file(workdir / "cache_secret"))
    given = (("--page-size", page_size), ("--chunk-size", chunk_size), ("--kv-dtype", kv_dtype))
    engine_flags = [*[a for flag, v in given if v is not None for a in (flag, str(v))], *extra]
    common = ["--model", str(model), *engine_flags]
    if num_colocated:  # placed like decode instances: one per GPU, round-robin
        num_prefill, num_decode = 0, num_colocated
    n_models = 1 + len(more_models)
    plan = plan_placement(num_prefill, num_decode, gpus or [], gpu_memory_utilization / n_models, prefill_tp, decode_tp)
    metrics = lambda k: ["--metrics-port", str(metrics_port + k if metrics_port > 0 else metrics_port)]  # noqa: E731
    shared = shared_gpus(plan)
    tpot_slo = router_tpot_slo_ms(router_extra, {**os.environ, **env}, str(model))
    daemon = start_mps(mps, plan, shared, workdir, {**os.environ, **env})

    def penv(p: Placement) -> dict[str, str]:  # an instance's environment: the stack's, its GPUs', MPS, the share
        share = gpu_share_env(p, shared, workdir, tpot_slo, {**os.environ, **env})
        return {**share, **env, **p.env({**os.environ, **env}), **client_env(p, shared, daemon, mps_prefill_sm_percent)}

    try:
        started = [
            start_service(
                "colocated" if num_colocated else p.role,
                [*common, *p.args(), *metrics(1 + k)],
                workdir,
                env=penv(p),
                to_terminal=to_terminal,
            )
            for k, p in enumerate(plan)
        ]
    except BaseException:
        if daemon is not None:
            daemon.stop()
        raise
    cleanup: list[Callable[[], None]] = [daemon.stop] if daemon is not None else []
    procs = [s[0] for s in started]
    role_of = "colocated" if num_colocated else None
    roles = [role_of or p.role for p in plan]
    logs = [s[2] for s in started]
    try:
        addrs: list[str] = [wait_ready(*s, timeout=timeout) for s in started]
        pre, dec = addrs[:num_prefill], addrs[num_prefill:]
        store = [] if persist_estimator else ["--estimator-store", str(workdir / "router-estimator.json")]
        rargs = ["--model", str(model), "--host", router_host, "--port", str(router_port), *store, *metrics(0)]
        rargs += ["--served-model-name", model_name, *router_extra]
        for a in pre:
            rargs += ["--prefill", a]
        for a in dec:
            rargs += ["--colocated" if num_colocated else "--decode", a]
        r = start_service("router", rargs, workdir, env=env, to_terminal=to_terminal)
        procs.append(r[0])
        roles.append("router")
        logs.append(r[2])
        router = wait_ready(*r, timeout=timeout)
        models: dict[str, list[str]] = {}
        for j, (name, path) in enumerate(more_models):  # they register with the router under their name
            first = 1 + len(plan) * (j + 1)
            more = [
                start_service(
                    "colocated" if num_colocated else p.role,
                    [
                        *("--model", str(path), "--served-model-name", name, "--router", router.internal),
                        *engine_flags,
                        *p.args(),
                        *metrics(first + k),
                    ],
                    workdir,
                    env=penv(p),
                    to_terminal=to_terminal,
                )
                for k, p in enumerate(plan)
            ]
            procs += [m[0] for m in more]
            roles += [f"{role_of or p.role}:{name}" for p in plan]
            logs += [m[2] for m in more]
            models[name] = [wait_ready(*m, timeout=timeout) for m in more]
            wait_registered(router.internal, models[name], name, env, timeout)
        gateway = ""
        if gateway_port is not None:
            g = start_service(
                "gateway",
                [
                    *("--router", router, "--host", router_host, "--port", str(gateway_port)),
                    *("--model-name", model_name, *gateway_extra),
                ],
                workdir,
                env=env,
                to_terminal=to_terminal,
            )
            procs.append(g[0])
            roles.append("gateway")
            logs.append(g[2])
            gateway = wait_ready(*g, timeout=timeout)
    except BaseException:  # also KeyboardInterrupt: never leave half a stack running
        Stack("", [], [], procs, logs, cleanup=cleanup).stop()
        raise
    if num_colocated:
        return Stack(
            router, [], [], procs, logs, gateway, token, colocated=dec, models=models, roles=roles, cleanup=cleanup
        )
    return Stack(router, pre, dec, procs, logs, gateway, token, models=models, roles=roles, cleanup=cleanup)


# The decode's TPOT bound while it holds steps back for the prefill of its GPU, as a share of the router's TPOT SLO:
# a held request still ends within the SLO with a step's worth of room.
YIELD_TPOT_SHARE = 13 / 15
ROUTER_TPOT_SLO_MS = 15.0  # services/router/config.py's default of --slo-tpot-ms


def yield_tpot_ms(tpot_slo_ms: float) -> str:
    """The decode's `--yield-tpot-ms` for a router TPOT SLO (`YIELD_TPOT_SHARE` of it), as an env value."""
    return f"{round(YIELD_TPOT_SHARE * tpot_slo_ms, 1):g}"


def router_tpot_slo_ms(router_extra: Sequence[str], environ: Mapping[str, str], model: str = "model") -> float:
    """The router's TPOT SLO as the stack starts it (`model`: the stack's): its flags, environment, `--config` file
    and default, resolved as the router resolves them (a configuration the router would refuse: the default; the
    router then says why)."""
    import argparse

    from pdserve.config import add_dataclass_args, config_from
    from pdserve.router.config import ENV_PREFIX, RouterConfig

    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, RouterConfig, env_prefix=ENV_PREFIX)
    try:
        args, _ = parser.parse_known_args(["--model", model, *router_extra])
        return float(config_from(RouterConfig, args, ENV_PREFIX, environ).slo_tpot_ms)
    except (SystemExit, ValueError, OSError):
        return ROUTER_TPOT_SLO_MS


def decode_yield_line(router_extra: Sequence[str], environ: Mapping[str, str], model: str) -> str:
    """What `pdserve up` says of the decode's yield on a shared GPU (the value `gpu_share_env` hands it)."""
    given = environ.get("PDSERVE_DECODE_YIELD_TPOT_MS")
    if given is not None:
        ms, why = given, "$PDSERVE_DECODE_YIELD_TPOT_MS"
    else:
        slo = router_tpot_slo_ms(router_extra, environ, model)
        ms, why = yield_tpot_ms(slo), f"13/15 of the router's TPOT SLO of {slo:g} ms"
    try:
        off = float(ms) <= 0
    except ValueError:  # the decode refuses it, saying why
        off = False
    if off:
        return f"decode does not yield to the prefill on its GPU ({why} = {ms})"
    return (
        f"decode holds its steps back while the prefill on its GPU computes, while its requests' TPOT stays within "
        f"{ms} ms ({why}; PDSERVE_DECODE_YIELD_TPOT_MS=0 to not)"
    )


def gpu_share_env(
    p: Placement,
    shared: list[int],
    workdir: Path,
    tpot_slo_ms: float = ROUTER_TPOT_SLO_MS,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A one-GPU instance on a GPU it shares with the other role: the file where its prefill marks steps and its
    decode reads them (pdserve.engine.gpu_share), one per GPU under `workdir`, and the decode's `--yield-tpot-ms`
    (`YIELD_TPOT_SHARE` of the router's TPOT SLO: the decode holds its steps back while the prefill computes, as
    long as its requests' TPOT stays within it). What `environ` (the stack's environment) names is left out: it
    wins."""
    if len(p.gpus) != 1 or p.gpus[0] not in shared:
        return {}
    env = {f"PDSERVE_{p.role.upper()}_GPU_SHARE_FILE": str(workdir / f"gpu-share-{p.gpus[0]}")}
    if p.role == DECODE:
        env["PDSERVE_DECODE_YIELD_TPOT_MS"] = yield_tpot_ms(tpot_slo_ms)
    return {k: v for k, v in env.items() if k not in (environ or {})}


def start_mps(
    mode: str, plan: Sequence[Placement], shared: list[int], workdir: Path, environ: dict[str, str]
) -> MpsDaemon | None:
    """The stack's MPS daemon where `want_mps` says so and a CUDA client runs under it on the `shared` GPUs; with
    "auto" a daemon or client that fails means no MPS (said on stderr), with "on" an error."""
    if not want_mps(mode, plan, environ)[0]:
        return None
    try:
        daemon = MpsDaemon.start(workdir / "mps", environ)
    except RuntimeError as e:
        if mode == "on":
            raise
        print(f"pdserve up: MPS off: {e}", file=sys.stderr, flush=True)
        return None
    why = daemon.probe(shared, environ)
    if not why:
        return daemon
    daemon.stop()
    if mode == "on":
        raise RuntimeError(f"--mps on: {why}")
    print(f"pdserve up: MPS off: {why}", file=sys.stderr, flush=True)
    return None


def wait_registered(registry: str, addresses: list[str], model: str, env: dict[str, str], timeout: float) -> None:
    """Until the router's Registry (`registry`: its internal port) lists every one of `addresses` up, serving
    `model`. A registry this process cannot call (TLS given by flags only) is not waited for after a few seconds:
    the instances register right after they are ready."""
    import grpc

    from pdserve.server.grpc_util import CHANNEL_OPTIONS
    from pdserve.server.security import ChannelSecurity
    from pdserve.v1 import router_admin_pb2, router_admin_pb2_grpc

    start = time.monotonic()
    with ChannelSecurity.from_env({**os.environ, **env}).open(registry, CHANNEL_OPTIONS) as ch:
        stub = router_admin_pb2_grpc.RegistryStub(ch)
        while True:
            try:
                listed = stub.ListInstances(router_admin_pb2.ListInstancesRequest(), timeout=5).instances
                up = {i.address for i in listed if i.model == model and i.state == "up"}
                if set(map(str, addresses)) <= up:
                    return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start > 5:
                    return  # cannot ask this registry (e.g. TLS given by flags): they register on their own
            if time.monotonic() - start > timeout:
                raise RuntimeError(
                    f"the instances of model {model!r} did not register with the router in {timeout:.0f}s"
                )
            time.sleep(0.1)
