"""The router's Registry service: instances Register / Heartbeat / Deregister; ListInstances shows the table."""

from __future__ import annotations

import grpc

from pdserve.router.estimator import OutputLengthEstimator
from pdserve.router.instances import COLOCATED, DECODE, PREFILL
from pdserve.router.membership import Membership
from pdserve.v1 import router_admin_pb2 as pb
from pdserve.v1 import router_admin_pb2_grpc

ROLES = {pb.INSTANCE_ROLE_PREFILL: PREFILL, pb.INSTANCE_ROLE_DECODE: DECODE, pb.INSTANCE_ROLE_COLOCATED: COLOCATED}
ROLE_ENUM = {v: k for k, v in ROLES.items()}
MAX_MODEL_NAME_CHARS = 256
MAX_MODEL_PATH_CHARS = 4096


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a served model name (None: it can): at most 256 printable characters."""
    if len(name) > MAX_MODEL_NAME_CHARS:
        return f"model_name is longer than {MAX_MODEL_NAME_CHARS} characters"
    if not name.isprintable():
        return "model_name must be printable characters"
    return None


def _role_and_address(request, context: grpc.ServicerContext) -> tuple[str, str]:
    role = ROLES.get(request.role)
    if role is None:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "role must be INSTANCE_ROLE_PREFILL, INSTANCE_ROLE_DECODE or INSTANCE_ROLE_COLOCATED",
        )
    host, sep, port = request.address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address must be host:port, got {request.address!r}")
    assert role is not None  # context.abort raised above
    return role, request.address


class RegistryServicer(router_admin_pb2_grpc.RegistryServicer):
    def __init__(self, membership: Membership, estimator: OutputLengthEstimator, fallback_mode: str):
        self.membership = membership
        self.estimator = estimator
        self.fallback_mode = fallback_mode

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        role, address = _role_and_address(request, context)
        if not request.capacity_pcs >= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "capacity_pcs must be >= 0")
        problem = model_name_problem(request.model_name)
        if problem is None and (len(request.model_path) > MAX_MODEL_PATH_CHARS or not request.model_path.isprintable()):
            problem = f"model_path must be at most {MAX_MODEL_PATH_CHARS} printable characters"
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.membership.register(role, address, request.capacity_pcs, request.model_name, request.model_path)
        cfg = self.membership.cfg
        return pb.RegisterResponse(heartbeat_interval_s=cfg.heartbeat_interval_s, lease_s=cfg.lease_s)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        role, address = _role_and_address(request, context)
        return pb.HeartbeatResponse(known=self.membership.heartbeat(role, address))

    def Deregister(self, request: pb.DeregisterRequest, context: grpc.ServicerContext) -> pb.DeregisterResponse:
        role, address = _role_and_address(request, context)
        self.membership.deregister(role, address)
        return pb.DeregisterResponse()

    def ListInstances(self, request, context: grpc.ServicerContext) -> pb.ListInstancesResponse:
        sched = self.membership.scheduler
        resp = pb.ListInstancesResponse()
        with sched.lock:
            for role in (PREFILL, DECODE, COLOCATED):
                for i in sched.instances[role].values():
                    s = i.stats
                    resp.instances.add(
                        role=ROLE_ENUM[role],
                        address=i.address,
                        state=i.state.value,
                        registered=(role, i.address) not in self.membership.static,
                        capacity_pcs=i.capacity_pcs,
                        load_pcs=i.load_pcs,
                        in_flight=i.in_flight,
                        assigned=i.assigned,
                        affinity_hits=i.affinity_hits,
                        failures=i.failures,
                        kv_pages_free=s.pages_free if s else 0,
                        kv_pages_total=s.pages_total if s else 0,
                        active_requests=s.active if s else 0,
                        model=i.model,
                    )
            resp.queued, resp.rejected, resp.retries = len(sched.queue), sched.rejected, sched.retries
        resp.estimator_samples = self.estimator.samples
        resp.estimator_error = self.estimator.error
        resp.estimator_mode = self.estimator.mode(self.fallback_mode)
        return resp
