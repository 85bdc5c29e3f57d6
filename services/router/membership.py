"""Membership: the static instance list plus instances that register and heartbeat; health over grpc.health.v1.

One background thread, every `health_interval_s`:
  - Check(service="") on every instance (gRPC futures, all in parallel, each with `health_timeout_s`):
    SERVING → up (a down one recovers); NOT_SERVING → draining (it is shutting down: no new requests);
    error → a failure; `unhealthy_after` consecutive failures → down.
  - registered instances: no heartbeat for `lease_s` → down; down for `remove_after_s` → forgotten
    (they register again when they come back); deregistered ones are forgotten once idle.
  - every `stats_interval_s`: Stats of every instance: its KV page size (the first one reported is the cluster's;
    an instance reporting another is refused: up, but given no request), for decode and colocated instances the
    free KV pages and active sequences the decode policy uses, for prefill and colocated ones the measured prefill
    rate. Also once at start and when an instance registers. (A colocated instance serves the Decode service.)
Every instance serves one model: a registered one names it (RegisterRequest.model_name, with the directory the
router may load its tokenizer from); static instances and those that name none serve the router's own --model
(Scheduler.default_model). The scheduler keeps them grouped by it.
Static instances are never forgotten: a static instance that recovers (restarted on its address) comes back up.
A request that fails UNAVAILABLE makes the router check both of its instances at once (`blame`): the one that
fails is marked down immediately and the retry avoids it.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.config import RouterConfig
from pdserve.router.instances import COLOCATED, DECODE, PREFILL, Instance, State
from pdserve.router.scheduler import Scheduler
from pdserve.server.grpc_util import channel
from pdserve.server.security import ServiceSecurity
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.router.membership")


class Membership:
    def __init__(self, cfg: RouterConfig, scheduler: Scheduler):
        self.cfg = cfg
        self.scheduler = scheduler
        self.security = ServiceSecurity.of(cfg).channel()  # the router's internal identity (token, client cert)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # channels
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.static = {(PREFILL, a) for a in cfg.prefill} | {(DECODE, a) for a in cfg.decode}
        self.static |= {(COLOCATED, a) for a in cfg.colocated}
        for role, addr in sorted(self.static):
            scheduler.add(role, addr)

    # ---- channels ---------------------------------------------------------------------------------------------
    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self.security)
            return ch

    def decode_stub(self, address: str) -> internal_pb2_grpc.DecodeStub:
        return internal_pb2_grpc.DecodeStub(self.channel(address))

    def prefill_stub(self, address: str) -> internal_pb2_grpc.PrefillStub:
        return internal_pb2_grpc.PrefillStub(self.channel(address))

    def _forget(self, inst: Instance) -> None:
        self.scheduler.remove(inst.role, inst.address)
        log.info("%s %s forgotten", inst.role, inst.address)
        with self.scheduler.lock:
            still_used = any(inst.address in insts for insts in self.scheduler.instances.values())
        if not still_used:
            with self._lock:
                ch = self._channels.pop(inst.address, None)
            if ch is not None:
                ch.close()

    # ---- registry RPCs --------------------------------------------------------------------------------------
    def register(
        self, role: str, address: str, capacity_pcs: float = 0.0, model_name: str = "", model_path: str = ""
    ) -> None:
        """`model_name`: the model it serves ("" = the router's --model); `model_path`: its model directory."""
        model = model_name or self.scheduler.default_model
        self.scheduler.add(
            role,
            address,
            registered=(role, address) not in self.static,
            capacity_pcs=capacity_pcs,
            model=model,
            model_path=model_path if model_name else "",
        )
        with self.scheduler.lock:
            inst = self.scheduler.instances[role][address]
            inst.leaving = False
        log.info("%s %s registered (model %r)", role, address, model)
        self.poll_stats([inst])  # its page size (and pool) before it gets a request

    def heartbeat(self, role: str, address: str) -> bool:
        """False when the instance is unknown (it should register again)."""
        with self.scheduler.lock:
            inst = self.scheduler.instances[role].get(address)
            if inst is None or inst.leaving:
                return False
            inst.last_heartbeat = time.monotonic()
            revive = inst.state == State.DOWN and inst.consecutive_failures == 0
        if revive:
            self.scheduler.set_state(inst, State.UP)
        return True

    def deregister(self, role: str, address: str) -> None:
        with self.scheduler.lock:
            inst = self.scheduler.instances[role].get(address)
            if inst is None:
                return
            inst.leaving = (role, address) not in self.static
        self.scheduler.set_state(inst, State.DRAINING)
        log.info("%s %s deregistered: draining", role, address)

    def blame(self, *insts: Instance) -> list[Instance]:
        """A request failed UNAVAILABLE on these: health-check them now. Those that fail the check are marked
        down at once (the failed request was the first strike) and returned; [] when all look healthy."""
        req = health_pb2.HealthCheckRequest(service="")
        futures = [
            (
                i,
                health_pb2_grpc.HealthStub(self.channel(i.address)).Check.future(
                    req, timeout=self.cfg.health_timeout_s
                ),
            )
            for i in dict.fromkeys(insts)  # a colocated request blames one instance, named twice
        ]
        failed = []
        for inst, fut in futures:
            try:
                ok = fut.result().status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            if not ok:
                failed.append(inst)
                with self.scheduler.lock:
                    inst.failures += 1
                    inst.consecutive_failures = max(inst.consecutive_failures + 1, self.cfg.unhealthy_after)
                if inst.state == State.UP:
                    log.warning(
                        "%s %s: up -> down (request failed UNAVAILABLE, health check failed)", inst.role, inst.address
                    )
                    self.scheduler.set_state(inst, State.DOWN)
        return failed

    # ---- background loop ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.poll_stats()  # the static instances' page size before the first request, when they are up already
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def _run(self) -> None:
        next_health = next_stats = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self._wake.is_set() or now >= next_health:
                self._wake.clear()
                self.check_health()
                next_health = time.monotonic() + self.cfg.health_interval_s
            if now >= next_stats:
                self.poll_stats()
                self.scheduler.update_slo()
                next_stats = time.monotonic() + self.cfg.stats_interval_s
            self._wake.wait(max(0.0, min(next_health, next_stats) - time.monotonic()))

    def _all(self) -> list[Instance]:
        with self.scheduler.lock:
            return [i for insts in self.scheduler.instances.values() for i in insts.values()]

    def check_health(self) -> None:
        """One round of health checks and lease bookkeeping (also callable directly, e.g. from tests)."""
        req = health_pb2.HealthCheckRequest(service="")
        futures = [
            (
                i,
                health_pb2_grpc.HealthStub(self.channel(i.address)).Check.future(
                    req, timeout=self.cfg.health_timeout_s
                ),
            )
            for i in self._all()
        ]
        now = time.monotonic()
        for inst, fut in futures:
            try:
                serving = fut.result().status == health_pb2.HealthCheckResponse.SERVING
                ok = True
            except grpc.RpcError as e:
                ok, serving, err = False, False, e
            registered = (inst.role, inst.address) not in self.static
            with self.scheduler.lock:
                if ok:
                    inst.consecutive_failures = 0
                else:
                    inst.failures += 1
                    inst.consecutive_failures += 1
                lease_ok = not registered or now - inst.last_heartbeat <= self.cfg.lease_s
                if inst.leaving:
                    target = State.DRAINING
                elif ok and serving and lease_ok:
                    target = State.UP
                elif ok and not serving and lease_ok:
                    target = State.DRAINING
                elif not lease_ok or inst.consecutive_failures >= self.cfg.unhealthy_after:
                    target = State.DOWN
                else:
                    target = inst.state  # one failure: keep its state until it repeats
                forget = registered and (
                    (inst.leaving and inst.in_flight == 0)
                    or (
                        inst.state == State.DOWN
                        and inst.down_since is not None
                        and now - inst.down_since > self.cfg.remove_after_s
                    )
                )
            if target != inst.state:
                log.warning(
                    "%s %s: %s -> %s%s",
                    inst.role,
                    inst.address,
                    inst.state.value,
                    target.value,
                    f" ({err.code().name})" if not ok else "",
                )
                self.scheduler.set_state(inst, target)
            if forget:
                self._forget(inst)

    def poll_stats(self, insts: list[Instance] | None = None) -> None:
        """Stats of every instance not down (or of `insts`): the KV page size of each, and for decode its free
        pages and active sequences."""
        futures = []
        for i in self._all() if insts is None else insts:
            if i.state == State.DOWN:
                continue
            stub = (internal_pb2_grpc.PrefillStub if i.role == PREFILL else internal_pb2_grpc.DecodeStub)(
                self.channel(i.address)
            )
            futures.append((i, stub.Stats.future(internal_pb2.StatsRequest(), timeout=self.cfg.health_timeout_s)))
        for inst, fut in futures:
            try:
                s = fut.result()
            except grpc.RpcError:
                continue  # health checks decide about failures
            if inst.role != PREFILL:
                self.scheduler.update_stats(
                    inst, s.kv_pages_free, s.kv_pages_total, s.active_requests, s.page_size, s.prefill_tokens_per_s
                )
            else:
                self.scheduler.observe_page_size(inst, s.page_size, s.prefill_tokens_per_s)
