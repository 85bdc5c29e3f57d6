"""Membership over real gRPC in one process: instances announce themselves (pdserve.server.announce) to the
router's Registry, the router health-checks them over grpc.health.v1, drains, marks down, forgets and
re-adds them. The "instances" here are gRPC servers serving only the health protocol (what membership uses)."""

import socket
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router.config import RouterConfig
from pdserve.router.estimator import OutputLengthEstimator
from pdserve.router.instances import PREFILL
from pdserve.router.membership import Membership
from pdserve.router.registry import RegistryServicer
from pdserve.router.scheduler import Scheduler
from pdserve.server.announce import Announcer
from pdserve.server.grpc_util import channel
from pdserve.v1 import router_admin_pb2 as pb
from pdserve.v1 import router_admin_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import instances, wait_states

FAST = dict(
    health_interval_s=0.1,
    health_timeout_s=0.5,
    unhealthy_after=2,
    heartbeat_interval_s=0.1,
    lease_s=0.6,
    remove_after_s=0.8,
    stats_interval_s=0.1,
)


class HealthOnly:
    """A gRPC server on a loopback port that serves grpc.health.v1 (port 0: a free one, fixed at the first start);
    can be stopped and started again on the same port."""

    def __init__(self, port: int = 0):
        self.port = port
        self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "HealthOnly":
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        bound = self.server.add_insecure_port(self.address)
        assert bound and self.port in (0, bound), (self.port, bound)
        self.port = bound
        self.server.start()
        self.serving(True)
        return self

    def serving(self, on: bool) -> None:
        self.health.set(
            "", health_pb2.HealthCheckResponse.SERVING if on else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    def stop(self) -> None:
        self.server.stop(0).wait()


@pytest.fixture
def router():
    """Scheduler + Membership + the Registry service on a real gRPC server; yields (address, membership)."""

    def make(**kw):
        cfg = RouterConfig(model="m", **{**FAST, **kw})
        m = Membership(cfg, Scheduler(cfg))
        server = grpc.server(futures.ThreadPoolExecutor(8))
        router_admin_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(m, OutputLengthEstimator(), cfg.pcs_fallback_mode), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        m.start()
        made.append((server, m))
        return f"127.0.0.1:{port}", m

    made = []
    yield make
    for server, m in made:
        m.close()
        server.stop(0)


def wait_state(router_addr: str, address: str, state: str | None) -> None:
    wait_states(router_addr, {address: state}, timeout=10.0)


def test_registered_instance_lifecycle(router):
    addr, m = router()
    inst = HealthOnly().start()
    ann = Announcer(addr, "prefill", inst.address).start()
    try:
        wait_state(addr, inst.address, "up")
        info = instances(addr)[inst.address]
        assert info.registered and info.role == pb.INSTANCE_ROLE_PREFILL
        inst.serving(False)  # shutting down: no new work, but not failed
        wait_state(addr, inst.address, "draining")
        inst.serving(True)
        wait_state(addr, inst.address, "up")
        inst.stop()  # the process dies (its heartbeats do not matter)
        wait_state(addr, inst.address, "down")
        assert instances(addr)[inst.address].failures >= 2
        inst.start()  # restarted on the same port
        wait_state(addr, inst.address, "up")
    finally:
        ann.stop()  # deregisters: drained, then forgotten
    wait_state(addr, inst.address, None)
    inst.stop()


def test_static_instance_is_marked_down_and_recovers_never_forgotten(router):
    # A port held bound but not listening (connections refused); SO_REUSEPORT, as gRPC servers bind, lets the
    # instance bind it later while it is still held, so no other process can take it in between.
    hold = socket.socket()
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind(("127.0.0.1", 0))
    port = hold.getsockname()[1]
    addr, m = router(prefill=[f"127.0.0.1:{port}"])
    wait_state(addr, f"127.0.0.1:{port}", "down")  # nothing listens there yet
    # A registered instance that goes silent after the static one went down: once it has been forgotten,
    # the static one has been down for longer than remove_after_s too.
    silent = HealthOnly().start()
    try:
        with channel(addr) as ch:
            req = pb.RegisterRequest(role=pb.INSTANCE_ROLE_PREFILL, address=silent.address)
            router_admin_pb2_grpc.RegistryStub(ch).Register(req, timeout=5)
        wait_state(addr, silent.address, "up")
        wait_state(addr, silent.address, None)  # lease ran out, then forgotten
    finally:
        silent.stop()
    assert instances(addr)[f"127.0.0.1:{port}"].registered is False  # static: still known
    inst = HealthOnly(port).start()
    hold.close()
    try:
        wait_state(addr, inst.address, "up")
    finally:
        inst.stop()


def test_lease_expiry_then_forget_and_reregister(router):
    addr, m = router()
    inst = HealthOnly().start()
    try:
        with channel(addr) as ch:
            stub = router_admin_pb2_grpc.RegistryStub(ch)
            r = stub.Register(pb.RegisterRequest(role=pb.INSTANCE_ROLE_PREFILL, address=inst.address), timeout=5)
            assert r.lease_s == FAST["lease_s"] and r.heartbeat_interval_s == FAST["heartbeat_interval_s"]
            wait_state(addr, inst.address, "up")
            # healthy but silent: the lease runs out, then the instance is forgotten
            wait_state(addr, inst.address, "down")
            wait_state(addr, inst.address, None)
            assert not stub.Heartbeat(
                pb.HeartbeatRequest(role=pb.INSTANCE_ROLE_PREFILL, address=inst.address), timeout=5
            ).known
        ann = Announcer(addr, "prefill", inst.address).start()  # heartbeat says unknown -> registers again
        wait_state(addr, inst.address, "up")
        ann.stop()
    finally:
        inst.stop()


def test_blame_marks_a_dead_instance_down_at_once(router):
    hold = socket.socket()  # bound, never listening: connections are refused
    hold.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{hold.getsockname()[1]}"
    live = HealthOnly().start()
    try:
        addr, m = router(prefill=[dead, live.address], health_interval_s=60.0)  # no periodic checks
        sched = m.scheduler
        insts = sched.instances[PREFILL]
        assert insts[dead].state.value == "up"
        assert m.blame(insts[dead], insts[live.address]) == [insts[dead]]
        assert insts[dead].state.value == "down" and insts[live.address].state.value == "up"
    finally:
        live.stop()
        hold.close()


@pytest.mark.parametrize(
    "req, reason",
    [
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_UNSPECIFIED, address="h:1"), "role"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="nohost"), "host:port"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="h:99999"), "host:port"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="h:1", capacity_pcs=-1), "capacity_pcs"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="h:1", model_name="m" * 257), "model_name"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="h:1", model_name="a\nb"), "model_name"),
        (pb.RegisterRequest(role=pb.INSTANCE_ROLE_DECODE, address="h:1", model_path="p" * 4097), "model_path"),
    ],
)
def test_register_rejects_bad_input(router, req, reason):
    addr, _ = router()
    with channel(addr) as ch, pytest.raises(grpc.RpcError) as e:
        router_admin_pb2_grpc.RegistryStub(ch).Register(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in e.value.details()


def test_an_announced_model_groups_the_instance(router):
    """An instance that names its model is in that model's group (listing, scheduler); one that names none
    serves the router's own model."""
    addr, m = router()
    named, unnamed = HealthOnly().start(), HealthOnly().start()
    announcers = [
        Announcer(addr, "prefill", named.address, model_name="beta", model_path="/models/beta").start(),
        Announcer(addr, "decode", unnamed.address).start(),
    ]
    try:
        wait_states(addr, {named.address: "up", unnamed.address: "up"}, timeout=10.0)
        listed = instances(addr)
        assert (listed[named.address].model, listed[unnamed.address].model) == ("beta", m.scheduler.default_model)
        assert m.scheduler.models() == {"beta": "/models/beta", m.scheduler.default_model: ""}
    finally:
        for a in announcers:
            a.stop()
        named.stop()
        unnamed.stop()
