"""A router + prefill + decode stack of real processes that a fault suite can break and mend: SIGKILL or SIGTERM any
process, start it again on the same port, read every instance's KV pool and active requests, sample each process's
resident memory. The engines start first on free ports, the router last (static instance list, fast health checks),
so the router never sees a closed port at start. Used by bench/reliability.py and its smoke test.

Internal calls the harness itself makes (Stats, ListInstances) go through `channel_for(address)`, which carries the
stack's internal identity when it has one (`Identity`); the abuse scenarios open their own, anonymous channels."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.cli.launch import start_service, wait_ready
from pdserve.server.auth import new_token
from pdserve.server.grpc_util import CHANNEL_OPTIONS
from pdserve.server.security import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, ChannelSecurity
from pdserve.server.tls import TlsConfig
from pdserve.v1 import internal_pb2, internal_pb2_grpc, router_admin_pb2, router_admin_pb2_grpc

PREFILL, DECODE, ROUTER = "prefill", "decode", "router"
HARNESS_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Identity:
    """How the stack is secured and how the harness reaches it as an insider: `env` (what every service process
    gets: the internal token as $PDSERVE_INTERNAL_TOKEN, TLS paths), `service_args` / `router_args` (flags), and
    `internal` (the identity the harness's own internal calls carry). `public_metadata`: what the harness's public
    calls carry (a bearer token when the router authenticates callers). The default: a fresh internal token,
    plaintext on loopback, no public auth."""

    env: dict[str, str] = field(default_factory=dict)
    service_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    internal: ChannelSecurity = field(default_factory=ChannelSecurity.anonymous)
    public_metadata: list[tuple[str, str]] = field(default_factory=list)

    tls: TlsConfig = field(default_factory=TlsConfig)  # the stack's certificate and CA (TLS off: empty)

    @classmethod
    def with_token(cls) -> Identity:
        token = new_token()
        return cls(env={ENV_TOKEN: token}, internal=ChannelSecurity(token=token))

    @classmethod
    def with_tls(cls, pki: Path) -> Identity:
        """The internal token plus TLS on every port and client certificates on internal ones (mTLS): a new CA in
        `pki`, one certificate (localhost, 127.0.0.1) every process presents as server and client."""
        from pdserve.testing.certs import CertAuthority

        tls = CertAuthority.create(pki).issue("stack")
        token = new_token()
        env = {ENV_TOKEN: token, ENV_TLS_CERT: tls.cert, ENV_TLS_KEY: tls.key, ENV_TLS_CA: tls.ca}
        return cls(env=env, internal=ChannelSecurity(tls, token), tls=tls)

    def public_channel(self, address: str) -> grpc.aio.Channel:
        """An asyncio channel to a public port: TLS verified against the stack's CA when TLS is on. Its own
        subchannels, reconnecting fast: a channel opened after a restart must not inherit the backoff of one that
        saw the port closed (gRPC shares subchannels between channels by default)."""
        if not self.tls.on:
            return grpc.aio.insecure_channel(address, options=HARNESS_CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(Path(self.tls.ca).read_bytes())
        return grpc.aio.secure_channel(address, creds, options=HARNESS_CHANNEL_OPTIONS)

    def channel(self, address: str) -> grpc.Channel:
        return self.internal.open(address, HARNESS_CHANNEL_OPTIONS)


@dataclass
class Member:
    """One service process of the stack and how to start it again."""

    role: str
    args: list[str]
    proc: subprocess.Popen
    log: Path
    address: str = ""
    info: dict = field(default_factory=dict)  # its ready file (address, pid, metrics, any extra ports)

    @property
    def port(self) -> str:
        return self.address.rsplit(":", 1)[1]


class FaultStack:
    """`FaultStack(model, work, prefill=2, decode=2, engine_args=[...]).start()`; `.router`, `.prefill`, `.decode`
    (addresses); `kill(addr)`, `restart(addr)`, `stats(addr)`, `pages_in_use()`, `wait_drained()`, `rss_mb()`,
    `stop()`. `extra_prefill` / `extra_decode`: addresses of servers the caller runs itself (a scripted prefill),
    put on the router's static list as they are."""

    def __init__(
        self,
        model: Path | str,
        work: Path,
        *,
        prefill: int = 1,
        decode: int = 1,
        engine_args: Sequence[str] = (),
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        extra_prefill: Sequence[str] = (),
        extra_decode: Sequence[str] = (),
        identity: Identity | None = None,
        start_timeout: float = 300.0,
    ):
        self.model = str(model)
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.counts = {PREFILL: prefill, DECODE: decode}
        self.role_args = {
            PREFILL: ["--model", self.model, *engine_args, *prefill_args],
            DECODE: ["--model", self.model, *engine_args, *decode_args],
        }
        self.router_args = list(router_args)
        self.extra = {PREFILL: list(extra_prefill), DECODE: list(extra_decode)}
        self.identity = identity or Identity.with_token()
        from pdserve.cache.value_auth import ENV_SECRET, ENV_SECRET_FILE, write_secret_file  # pdserve.cache: torch

        self.env = dict(self.identity.env)  # + one prompt-cache secret its prefill instances share (`pdserve up` too)
        if not (self.env.get(ENV_SECRET) or self.env.get(ENV_SECRET_FILE)):
            self.env[ENV_SECRET_FILE] = str(write_secret_file(self.work / "cache_secret"))
        self.start_timeout = start_timeout
        self.members: dict[str, Member] = {}  # address -> member
        self._channels: dict[str, grpc.Channel] = {}

    # ---- addresses ----------------------------------------------------------------------------------------------
    def addresses(self, role: str) -> list[str]:
        return [a for a, m in self.members.items() if m.role == role]

    @property
    def prefill(self) -> list[str]:
        return self.addresses(PREFILL)

    @property
    def decode(self) -> list[str]:
        return self.addresses(DECODE)

    @property
    def router(self) -> str:
        return self.addresses(ROUTER)[0]

    @property
    def router_member(self) -> Member:
        return self.members[self.router]

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def _launch(self, role: str, args: list[str]) -> Member:
        proc, ready, log = start_service(role, [*args, *self.identity.service_args], self.work, env=self.env)
        member = Member(role, args, proc, log)
        member.info = {"ready": str(ready)}
        return member

    def _await(self, member: Member) -> Member:
        ready = Path(member.info["ready"])
        member.address = wait_ready(member.proc, ready, member.log, timeout=self.start_timeout)
        import json

        member.info = {"ready": str(ready), **json.loads(ready.read_text())}
        self.members[member.address] = member
        return member

    def start(self) -> FaultStack:
        try:
            engines = [
                self._launch(r, list(self.role_args[r])) for r in (PREFILL, DECODE) for _ in range(self.counts[r])
            ]
            for m in engines:
                self._await(m)
            rargs = ["--model", self.model, "--estimator-store", "memory", "--health-interval-s", "0.2"]
            rargs += ["--stats-interval-s", "0.2", *self.router_args]
            for a in [*self.prefill, *self.extra[PREFILL]]:
                rargs += ["--prefill", a]
            for a in [*self.decode, *self.extra[DECODE]]:
                rargs += ["--decode", a]
            self._await(self._launch(ROUTER, rargs + list(self.identity.router_args)))
            self.wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, address: str, sig: int = signal.SIGKILL) -> Member:
        """Send `sig` to the process serving `address` (SIGKILL: it vanishes mid-whatever)."""
        m = self.members[address]
        if m.proc.poll() is None:
            m.proc.send_signal(sig)
        return m

    def wait_exit(self, address: str, timeout: float) -> int | None:
        """The process's exit code, or None when it is still running after `timeout` seconds."""
        try:
            return self.members[address].proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, address: str, extra: Sequence[str] = ()) -> Member:
        """Start the service of `address` again on the same port (after it died) and wait until it is ready;
        `extra` flags go after its own (a later flag wins)."""
        old = self.members[address]
        if old.proc.poll() is None:
            old.proc.kill()
            old.proc.wait(30)
        args = [*old.args, *extra, "--port", old.port]
        internal = old.info.get("internal_address")
        if internal:  # the router: its Registry port too, where registered engines heartbeat
            args += ["--internal-port", internal.rsplit(":", 1)[1]]
        self._drop_channel(address)
        member = self._launch(old.role, args)
        member.args = old.args  # the flags it was first started with (the ports are added on each restart)
        self._await(member)
        return member

    def stop(self) -> None:
        for m in self.members.values():
            if m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
        for m in self.members.values():
            try:
                m.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(10)
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> FaultStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {m.log.name}\n{m.log.read_text()[-chars:]}" for m in self.members.values())

    # ---- insider reads ----------------------------------------------------------------------------------------
    def channel_for(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.identity.channel(address)
        return ch

    def _drop_channel(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            ch.close()

    def registry_address(self) -> str:
        """Where the router serves its Registry: an internal port from its ready file, else the public one."""
        info = self.router_member.info
        return info.get("internal_address") or self.router

    def listing(self, timeout: float = 10.0) -> router_admin_pb2.ListInstancesResponse:
        stub = router_admin_pb2_grpc.RegistryStub(self.channel_for(self.registry_address()))
        return stub.ListInstances(router_admin_pb2.ListInstancesRequest(), timeout=timeout)

    def states(self) -> dict[str, str]:
        return {i.address: i.state for i in self.listing().instances}

    def wait_up(self, timeout: float = 120.0) -> None:
        """Until the router sees every engine instance (its own and the extra ones) up."""
        want = [*self.prefill, *self.decode, *self.extra[PREFILL], *self.extra[DECODE]]
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = self.states()
                if all(states.get(a) == "up" for a in want):
                    return
            except grpc.RpcError as e:
                states = {"listing": e.code().name}
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {self.router}: instances {states}, wanted all of {want} up")
            time.sleep(0.1)

    def stats(self, address: str, timeout: float = 5.0) -> internal_pb2.InstanceStats:
        ch = self.channel_for(address)
        stub = internal_pb2_grpc.PrefillStub(ch) if self.members[address].role == PREFILL else None
        if stub is None:
            return internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=timeout)
        return stub.Stats(internal_pb2.StatsRequest(), timeout=timeout)

    def pages_in_use(self) -> dict[str, tuple[int, int]]:
        """address -> (KV pool pages in use, active requests) for every engine process of the stack."""
        out = {}
        for a in [*self.prefill, *self.decode]:
            s = self.stats(a)
            out[a] = (s.kv_pages_total - s.kv_pages_free, s.active_requests)
        return out

    def wait_drained(
        self, timeout: float = 30.0, baseline: dict[str, tuple[int, int]] | None = None
    ) -> dict[str, tuple[int, int]]:
        """Wait until no instance holds a page or a request beyond its `baseline` (pages, requests) reading (or
        `timeout` passes); return the last reading."""
        deadline = time.monotonic() + timeout
        base = baseline or {}
        while True:
            try:
                used = self.pages_in_use()
                drained = all(p <= base.get(a, (0, 0))[0] and r <= base.get(a, (0, 0))[1] for a, (p, r) in used.items())
                if drained or time.monotonic() > deadline:
                    return used
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def rss_mb(self) -> dict[str, float]:
        """Resident memory (MiB) of each live process, keyed role@address."""
        out = {}
        for a, m in self.members.items():
            if m.proc.poll() is not None:
                continue
            try:
                for line in Path(f"/proc/{m.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[f"{m.role}@{a}"] = int(line.split()[1]) / 1024
            except OSError:
                pass
        return out
