"""The router's scheduler: admission, the priority queue, the dispatch gate and the assignment policy, over
the instance table that membership keeps up to date. One lock guards all of it; every call is O(instances).

Request life cycle (calls made by the servicer's RPC thread):
    submit(job)       admission (Rejected → RESOURCE_EXHAUSTED), queue, dispatch if something has room
    wait(job, t)      until dispatched: (prefill, decode); QueueTimeout / Unavailable when it cannot be
    first_token(job)  prefill work done: its PCS and tokens leave the prefill instance (TTFT sample)
    retry(job)        UNAVAILABLE before the first token: back into the queue at its old place, those
                      instances excluded for this job
    finish(job)       always (finally): releases whatever the job still holds; idempotent (TPOT sample)

Dispatch gate (what "has room" means): a prefill instance takes another request while fewer than
`prefill_max_inflight_tokens` prompt tokens sent to it await their first token (so a 4k-token prompt fills it
and the next request waits for whichever instance frees first, instead of queueing behind that prefill); a
decode instance while its estimated free KV pages cover the request (an idle one always takes one). The gate is
what makes the queue — and with it the priority order — matter: instances are given work as they free up.

Colocated instances (prefill and decode in one engine): while the router has any that is up, every request goes
to one of them; the job's prefill and decode are that one instance, which carries the prompt tokens until the
first token and the KV pages until the end, and must pass both gates and both admission budgets.

Models (`pdserve.router.model_groups`): every instance serves one model and every job names one; a job is admitted
against, queued for and dispatched to instances of its model only (one queue per model, strict order within it),
so its prefill and decode instances always serve the same model.

SLO (`pdserve.router.slo`): first_token / finish feed each instance's TTFT / TPOT window; submit runs the
controllers (at most every `slo_interval_s`) and stores their factors on the instances, which admission applies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from pdserve.router.admission import (
    Rejected,
    RetrySlots,
    admit_colocated,
    admit_decode,
    admit_prefill,
    decode_fits,
    prefill_fits,
)
from pdserve.router.config import RouterConfig
from pdserve.router.instances import COLOCATED, DECODE, PREFILL, ROLES, DecodeStats, Instance, State
from pdserve.router.model_groups import ModelDrainRates, ModelQueues, for_model
from pdserve.router.policy import Policy, make_policy
from pdserve.router.slo import TPOT, TTFT, SloTracker

log = logging.getLogger("pdserve.router.scheduler")

DEFAULT_DECODE_CAPACITY_PCS = 16384.0  # until the first Stats tell the KV pool size (decode_capacity_pcs = 0)


class Unavailable(Exception):
    """No healthy instance of a role (UNAVAILABLE)."""


class QueueTimeout(Rejected):
    """Waited `max_queue_wait_s` (or the client's deadline) without room on any instance."""


class Cancelled(Exception):
    """The caller went away while the request was queued."""


@dataclass(eq=False)
class Job:
    rid: str
    pcs: float
    weighted_pcs: float  # PCS / priority multiplier: the queue's ordering value at arrival (lowest first)
    prompt_len: int
    need_pages: int  # KV pages for prompt + estimated output on the decode instance
    page_hash: bytes | None  # leading page (prefix affinity)
    model: str = ""  # the served model it runs on (its instances' group)
    arrival: float = field(default_factory=time.monotonic)
    key: float = 0.0  # heap key (set by the queue)
    queued: bool = False
    excluded: set[str] = field(default_factory=set)
    reserved: list[Instance] = field(default_factory=list)
    prefill: Instance | None = None
    decode: Instance | None = None
    prefill_open: bool = False  # prefill accounting held (no first token yet)
    decode_open: bool = False
    first_token_at: float | None = None  # monotonic time the caller's first token was streamed (TTFT, TPOT)
    cancelled: bool = False
    event: threading.Event = field(default_factory=threading.Event)


class RoleView:
    """`.role` and `.snapshot()` of one role's instances (metrics gauges, listings)."""

    def __init__(self, scheduler: Scheduler, role: str):
        self.scheduler, self.role = scheduler, role

    def snapshot(self) -> list[Instance]:
        with self.scheduler.lock:
            return [Instance(**vars(i)) for i in self.scheduler.instances[self.role].values()]


class Scheduler:
    def __init__(self, cfg: RouterConfig, policy: Policy | None = None, default_model: str = ""):
        """`default_model`: the model of instances that name none (the static list, older engines)."""
        self.cfg = cfg
        self.default_model = default_model
        self.lock = threading.Lock()
        self.instances: dict[str, dict[str, Instance]] = {role: {} for role in ROLES}
        self.queue = ModelQueues(cfg.priority_aging_pcs_per_s)  # one per model
        self.policy = policy or make_policy(cfg)
        self.drain = ModelDrainRates()  # KV pages of finished decode requests per second, per model (retry hints)
        self.rejected = 0
        self.retry_slots = RetrySlots()  # rejected callers sent back one after another
        self.retries = 0
        self.page_sizes: dict[str, int] = {}  # model -> tokens per KV page, learned from its instances' Stats
        self.slo = SloTracker(cfg.slo_settings())

    @property
    def page_size(self) -> int | None:
        """The default model's KV page size (None until one of its instances reported it)."""
        return self.page_sizes.get(self.default_model)

    def page_size_of(self, model: str) -> int | None:
        with self.lock:
            return self.page_sizes.get(model)

    def models(self) -> dict[str, str]:
        """Every model some known instance serves (any state) -> a model directory one of them announced ("" =
        the router's --model). The router's own --model is added by its caller."""
        with self.lock:
            out: dict[str, str] = {}
            for insts in self.instances.values():
                for i in insts.values():
                    if not out.get(i.model):
                        out[i.model] = i.model_path
            return out

    # ---- membership side -----------------------------------------------------------------------------------
    def add(
        self,
        role: str,
        address: str,
        registered: bool = False,
        capacity_pcs: float = 0.0,
        model: str | None = None,
        model_path: str = "",
    ) -> Instance:
        """Add an instance (or bring a known one back up); `model`: the model it serves (None: as known, else the
        default model). An instance that comes back serving another model (restarted) moves to that group."""
        with self.lock:
            inst = self.instances[role].get(address)
            if inst is None:
                inst = self.instances[role][address] = Instance(
                    role,
                    address,
                    self._capacity(role, capacity_pcs),
                    registered=registered,
                    model=self.default_model if model is None else model,
                    model_path=model_path,
                )
            else:
                inst.registered = inst.registered or registered
                if capacity_pcs:
                    inst.capacity_pcs = capacity_pcs
                if model is not None and (model, model_path) != (inst.model, inst.model_path):
                    if model != inst.model:
                        log.info("%s %s now serves model %r (was %r)", role, address, model, inst.model)
                        inst.refused, inst.stats = "", None  # its page size is checked against its new group
                    inst.model, inst.model_path = model, model_path
                inst.state, inst.consecutive_failures, inst.down_since = State.UP, 0, None
            inst.last_heartbeat = time.monotonic()
            self._dispatch()
            return inst

    def remove(self, role: str, address: str) -> None:
        with self.lock:
            self.instances[role].pop(address, None)

    def set_state(self, inst: Instance, state: State) -> None:
        with self.lock:
            if inst.state != state:
                inst.state = state
                inst.down_since = time.monotonic() if state == State.DOWN else None
                if state == State.UP:
                    self._dispatch()

    def update_stats(
        self,
        inst: Instance,
        pages_free: int,
        pages_total: int,
        active: int,
        page_size: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> None:
        """A decode or colocated instance's Stats (page_size 0: not reported; prefill_tokens_per_s: a colocated
        instance's measured prefill rate, 0 = none yet, the last measurement is kept)."""
        with self.lock:
            self._observe_page_size(inst, page_size)
            inst.stats = DecodeStats(pages_free, pages_total, active, inst.in_flight, inst.pages)
            if prefill_tokens_per_s > 0:
                inst.prefill_tokens_per_s = prefill_tokens_per_s
            model_page_size = self.page_sizes.get(inst.model)
            if inst.role != PREFILL and not self.cfg.decode_capacity_pcs and pages_total and model_page_size:
                w = max(self.cfg.pcs_w_in, self.cfg.pcs_w_out)
                inst.capacity_pcs = w * model_page_size * pages_total  # PCS of prompts+outputs filling the pool
            self._dispatch()

    def observe_page_size(self, inst: Instance, page_size: int, prefill_tokens_per_s: float = 0.0) -> None:
        """A prefill instance's Stats: its KV page size (0: not reported) and measured prefill rate (0: none yet;
        the last measurement is kept)."""
        with self.lock:
            self._observe_page_size(inst, page_size)
            if prefill_tokens_per_s > 0:
                inst.prefill_tokens_per_s = prefill_tokens_per_s
            self._dispatch()

    def _observe_page_size(self, inst: Instance, page_size: int) -> None:
        """The first instance of a model to report sets that model's page size; one that reports another is
        refused (up but never given a request: its pages could not be exchanged with the others') until it
        agrees. Models do not exchange pages: each has its own."""
        if not page_size:
            return
        known = self.page_sizes.get(inst.model)
        if known is None:
            known = self.page_sizes[inst.model] = page_size
            log.info("KV page size %d%s (from %s %s)", page_size, for_model(inst.model), inst.role, inst.address)
        refused = (
            ""
            if page_size == known
            else f"KV page size {page_size} differs from the cluster's {known}{for_model(inst.model)}"
        )
        if refused and not inst.refused:
            log.error("%s %s refused: %s", inst.role, inst.address, refused)
        elif inst.refused and not refused:
            log.info("%s %s accepted: KV page size now %d", inst.role, inst.address, page_size)
        inst.refused = refused

    def view(self, role: str) -> RoleView:
        return RoleView(self, role)

    def _capacity(self, role: str, given: float) -> float:
        if given > 0:
            return given
        if role == PREFILL:
            return self.cfg.prefill_capacity_pcs
        return self.cfg.decode_capacity_pcs or DEFAULT_DECODE_CAPACITY_PCS

    def _eligible(self, role: str, model: str, exclude: AbstractSet[str] = frozenset()) -> list[Instance]:
        """Up, accepted instances of `role` serving `model` (those in `exclude` only when there is no other)."""
        up = [i for i in self.instances[role].values() if i.state == State.UP and not i.refused and i.model == model]
        return [i for i in up if i.address not in exclude] or up

    def _colocated_mode(self, model: str) -> bool:
        """A model's requests go to its colocated instances while any is up (else to prefill/decode pairs)."""
        return bool(self._eligible(COLOCATED, model))

    def _roles(self, model: str) -> tuple[str, ...]:
        return (COLOCATED,) if self._colocated_mode(model) else (PREFILL, DECODE)

    def update_slo(self) -> None:
        """Run the SLO controllers now (membership calls it every Stats poll, so an idle router relaxes too)."""
        with self.lock:
            self._update_slo(time.monotonic())

    def _update_slo(self, now: float) -> None:
        """Run the SLO controllers (each at most every slo_interval_s) and store their factors."""
        insts = [i for role in ROLES for i in self.instances[role].values()]
        factors = self.slo.update([i.address for i in insts], now)
        for i in insts:
            i.ttft_factor, i.tpot_factor = factors[i.address]

    # ---- request side ---------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Admit and queue (dispatching at once when there is room). Raises Rejected or Unavailable."""
        with self.lock:
            self._update_slo(time.monotonic())
            model = job.model
            cands = {role: self._eligible(role, model) for role in self._roles(model)}
            for role, insts in cands.items():
                if not insts:
                    raise Unavailable(f"no healthy {role} instance{for_model(model)}")
            try:
                budget_s, floor = self.cfg.ttft_budget_ms / 1e3, self.cfg.prefill_floor_tokens
                if COLOCATED in cands:
                    c = cands[COLOCATED]
                    drain = self.drain.of(model)
                    targets = [admit_colocated(c, job.prompt_len, job.need_pages, budget_s, floor, drain)]
                else:
                    targets = [
                        admit_prefill(cands[PREFILL], job.prompt_len, budget_s, floor),
                        admit_decode(cands[DECODE], job.need_pages, self.drain.of(model)),
                    ]
            except Rejected as e:
                self.rejected += 1
                e.retry_after_s = self.retry_slots.promise(time.monotonic(), e.retry_after_s, e.spacing_s)
                raise
            if len(self.queue) >= self.cfg.max_queue:
                self.rejected += 1
                raise Rejected(f"router queue is full ({self.cfg.max_queue} requests)", 1.0)
            self._reserve(job, targets)
            self.queue.of(model).push(job, job.weighted_pcs, job.arrival)
            self._dispatch(model)

    def wait(self, job: Job, timeout: float) -> tuple[Instance, Instance]:
        """Block until `job` is dispatched; raise QueueTimeout (or Unavailable) after `timeout` seconds,
        Cancelled when `cancel` was called first."""
        woke = job.event.wait(max(0.0, timeout))
        if job.cancelled:
            raise Cancelled(job.rid)
        if not woke:
            with self.lock:
                if self.queue.of(job.model).remove(job):
                    self._unreserve(job)
                    for role in self._roles(job.model):
                        if not any(i.state == State.UP and i.model == job.model for i in self.instances[role].values()):
                            raise Unavailable(f"no healthy {role} instance{for_model(job.model)}")
                    waited = time.monotonic() - job.arrival
                    raise QueueTimeout(f"no instance had room for this request within {waited:.1f}s", 1.0)
        assert job.prefill is not None and job.decode is not None, "a woken, uncancelled job is dispatched"
        return job.prefill, job.decode

    def cancel(self, job: Job) -> None:
        """The caller is gone: drop `job` from the queue and wake its waiter (what it holds: `finish`)."""
        with self.lock:
            job.cancelled = True
            if self.queue.of(job.model).remove(job):
                self._unreserve(job)
            job.event.set()

    def first_token(self, job: Job) -> None:
        with self.lock:
            if job.first_token_at is None and job.prefill is not None:  # the caller's first token: TTFT
                job.first_token_at = now = time.monotonic()
                self.slo.observe(job.prefill.address, TTFT, now - job.arrival, now)
            self._release_prefill(job, done=True)
            self._dispatch(job.model)

    def retry(self, job: Job, blamed: list[Instance]) -> None:
        """Back into the queue (same place), excluding `blamed` (or, when none could be blamed, both instances
        it just ran on) for this job."""
        with self.lock:
            self._release_prefill(job, done=False)
            self._release_decode(job, done=False)
            if job.cancelled:
                return
            for inst in blamed or [i for i in (job.prefill, job.decode) if i is not None]:
                job.excluded.add(inst.address)
            self.retries += 1
            job.event.clear()
            cands = [self._eligible(r, job.model, job.excluded) for r in self._roles(job.model)]
            self._reserve(job, [min(c, key=lambda i: i.load_pcs / i.capacity_pcs) for c in cands if c])
            self.queue.of(job.model).requeue(job)
            self._dispatch(job.model)

    def finish(self, job: Job, completed: bool = False, completion_tokens: int = 0) -> None:
        """Release everything `job` holds (idempotent); `completed` counts its PCS as drained by decode and, with
        `completion_tokens`, gives the decode instance a TPOT sample and the SLO tally the request."""
        with self.lock:
            if completed and job.decode_open and job.decode is not None and job.first_token_at is not None:
                now = time.monotonic()
                tpot = None
                if completion_tokens > 1:
                    tpot = (now - job.first_token_at) / (completion_tokens - 1)
                    self.slo.observe(job.decode.address, TPOT, tpot, now)
                self.slo.finished(job.first_token_at - job.arrival, tpot)
            if self.queue.of(job.model).remove(job):
                self._unreserve(job)
            self._release_prefill(job, done=False)
            self._release_decode(job, done=completed)
            self._dispatch(job.model)

    # ---- internals (lock held) ----------------------------------------------------------------------------
    def _reserve(self, job: Job, targets: list[Instance]) -> None:
        for inst in targets:
            inst.reserved_pcs += job.pcs
            if inst.role != DECODE:
                inst.queued_tokens += job.prompt_len
            if inst.role != PREFILL:
                inst.queued_pages += job.need_pages
        job.reserved = targets

    def _unreserve(self, job: Job) -> None:
        for inst in job.reserved:
            inst.reserved_pcs = max(0.0, inst.reserved_pcs - job.pcs)
            if inst.role != DECODE:
                inst.queued_tokens = max(0, inst.queued_tokens - job.prompt_len)
            if inst.role != PREFILL:
                inst.queued_pages = max(0, inst.queued_pages - job.need_pages)
        job.reserved = []

    @staticmethod
    def _charge(inst: Instance, job: Job, sign: int, part: str) -> None:
        """Add (+1, at dispatch) or remove (-1, at release) `job`'s `part` (PREFILL: until the first token,
        DECODE: until the end) on `inst`. A colocated instance carries both parts: its PCS and in-flight count
        with the decode part, its prompt tokens with the prefill part."""
        if part == PREFILL:
            inst.inflight_tokens += sign * job.prompt_len
        else:
            inst.pages += sign * job.need_pages
        if inst.role != COLOCATED or part == DECODE:
            inst.running_pcs = max(0.0, inst.running_pcs + sign * job.pcs)
            inst.in_flight += sign

    def _release_prefill(self, job: Job, done: bool) -> None:
        if job.prefill_open:
            assert job.prefill is not None
            self._charge(job.prefill, job, -1, PREFILL)
            job.prefill_open = False

    def _release_decode(self, job: Job, done: bool) -> None:
        if job.decode_open:
            assert job.decode is not None
            self._charge(job.decode, job, -1, DECODE)
            job.decode_open = False
            if done:
                self.drain.of(job.model).add(job.need_pages)

    def _in_budget(self, inst: Instance, job: Job) -> bool:
        """Dispatching `job`, the head of the queue, keeps `inst` within its admission budget: the policy may
        prefer another instance than the one admission reserved on, never an overloaded one. Only what `inst`
        already runs counts: every other queued job is behind `job` (strict order), so its reservation is not
        work ahead of it. (Counting those reservations deadlocked a burst: once the SLO controller shrank the
        budget below the queued reservations, the head never fit on idle instances, no request ran, no TTFT
        sample came to relax the factor, and the router sat idle for its whole SLO window, 30 s.)"""
        if inst.role != DECODE:
            cfg = self.cfg
            budget_s = cfg.ttft_budget_ms / 1e3
            if not prefill_fits(inst, inst.inflight_tokens, job.prompt_len, budget_s, cfg.prefill_floor_tokens):
                return False
        if inst.role == PREFILL:
            return True
        return decode_fits(inst, inst.pages, job.need_pages)

    def _prefill_room(self, inst: Instance) -> bool:
        limit = self.cfg.prefill_max_inflight_tokens
        return limit <= 0 or inst.inflight_tokens < limit

    @staticmethod
    def _decode_room(inst: Instance, job: Job) -> bool:
        free = inst.pages_free_estimate()
        return free is None or inst.in_flight == 0 or free >= job.need_pages

    def _dispatch(self, model: str | None = None) -> None:
        """Start queued jobs of `model` (None: of every model) in priority order while the head one finds room
        (strict order within a model: no overtaking)."""
        for m in self.queue.models() if model is None else [model]:
            self._dispatch_model(m)

    def _dispatch_model(self, model: str) -> None:
        queue = self.queue.of(model)
        while (job := queue.peek()) is not None:
            if self._colocated_mode(model):
                cs = [
                    i
                    for i in self._eligible(COLOCATED, model, job.excluded)
                    if self._prefill_room(i) and self._decode_room(i, job) and self._in_budget(i, job)
                ]
                if not cs:
                    return
                queue.pop()
                self._unreserve(job)
                c = self.policy.pick_colocated(job, cs)
                self._charge(c, job, +1, PREFILL)
                self._charge(c, job, +1, DECODE)
                c.assigned += 1
                job.prefill, job.decode, job.prefill_open, job.decode_open = c, c, True, True
                job.event.set()
                continue
            ps = [
                i
                for i in self._eligible(PREFILL, model, job.excluded)
                if self._prefill_room(i) and self._in_budget(i, job)
            ]
            ds = [
                i
                for i in self._eligible(DECODE, model, job.excluded)
                if self._decode_room(i, job) and self._in_budget(i, job)
            ]
            if not ps or not ds:
                return
            queue.pop()
            self._unreserve(job)  # before picking: its own reservation must not count against an instance
            p, d = self.policy.pick_prefill(job, ps), self.policy.pick_decode(job, ds)
            # the pairing is within one model: the prefill ships its KV to a decode of the same model only
            assert p.model == d.model == job.model, (p.model, d.model, job.model)
            for inst, part in ((p, PREFILL), (d, DECODE)):
                self._charge(inst, job, +1, part)
                inst.assigned += 1
            job.prefill, job.decode, job.prefill_open, job.decode_open = p, d, True, True
            job.event.set()
