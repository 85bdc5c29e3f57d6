"""Several models behind one scheduler: instances grouped by the model they serve, a job admitted, queued and
dispatched within its model only (prefill and decode of one model: never a cross-model pair), per-model queues
(a full model does not hold back another) and per-model KV page sizes."""

from __future__ import annotations

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.instances import COLOCATED, DECODE, PREFILL
from pdserve.router.scheduler import Job, Scheduler, Unavailable


def sched(**kw) -> Scheduler:
    return Scheduler(RouterConfig(model="m", **kw), default_model="alpha")


def job(name: str, model: str, pages: int = 2, prompt_len: int = 8) -> Job:
    return Job(name, 10.0, 10.0, prompt_len, pages, None, model=model)


def up(s: Scheduler, role: str, address: str, model: str | None, page_size: int = 16, pages: int = 64):
    inst = s.add(role, address, model=model)
    if role == PREFILL:
        s.observe_page_size(inst, page_size)
    else:
        s.update_stats(inst, pages, pages, 0, page_size)
    return inst


def run(s: Scheduler, j: Job):
    s.submit(j)
    return s.wait(j, 1.0)


def test_instances_without_a_model_serve_the_default_one():
    s = sched()
    p = up(s, PREFILL, "p:1", None)
    assert p.model == "alpha" and s.models() == {"alpha": ""}
    up(s, PREFILL, "p:2", "beta")
    assert set(s.models()) == {"alpha", "beta"}


def test_pairs_are_always_of_the_jobs_model():
    s = sched()
    for m in ("alpha", "beta"):
        for k in range(2):
            up(s, PREFILL, f"{m}-p{k}:1", m)
            up(s, DECODE, f"{m}-d{k}:1", m)
    for i in range(12):
        m = ("alpha", "beta")[i % 2]
        j = job(f"r{i}", m)
        p, d = run(s, j)
        assert p.model == d.model == m, (p.address, d.address)
        s.first_token(j)
        s.finish(j, completed=True, completion_tokens=4)


def test_a_model_without_a_decode_instance_is_unavailable_by_name():
    """A prefill of beta and a decode of alpha only: a beta request is never paired with alpha's decode."""
    s = sched()
    up(s, PREFILL, "beta-p:1", "beta")
    up(s, PREFILL, "alpha-p:1", "alpha")
    up(s, DECODE, "alpha-d:1", "alpha")
    with pytest.raises(Unavailable, match="no healthy decode instance of model 'beta'"):
        s.submit(job("b", "beta"))
    with pytest.raises(Unavailable, match="of model 'gamma'"):
        s.submit(job("g", "gamma"))
    assert run(s, job("a", "alpha"))[1].address == "alpha-d:1"


def test_colocated_mode_is_per_model():
    """alpha runs on its colocated instance while beta (no colocated one) runs on its prefill/decode pair."""
    s = sched()
    c = up(s, COLOCATED, "alpha-c:1", "alpha")
    up(s, PREFILL, "beta-p:1", "beta")
    up(s, DECODE, "beta-d:1", "beta")
    assert run(s, job("a", "alpha")) == (c, c)
    p, d = run(s, job("b", "beta"))
    assert (p.address, d.address) == ("beta-p:1", "beta-d:1")


def test_a_full_model_does_not_hold_back_another():
    """alpha's only prefill instance is full (prefill_max_inflight_tokens): its next request waits in the queue
    while a later beta request runs at once."""
    s = sched(prefill_max_inflight_tokens=8)
    up(s, PREFILL, "alpha-p:1", "alpha")
    up(s, DECODE, "alpha-d:1", "alpha")
    up(s, PREFILL, "beta-p:1", "beta")
    up(s, DECODE, "beta-d:1", "beta")
    first = job("a1", "alpha")
    run(s, first)  # alpha-p now has 8 prompt tokens awaiting their first token
    waiting = job("a2", "alpha")
    s.submit(waiting)
    assert not waiting.event.is_set() and s.queue.depth("alpha") == 1
    b = job("b", "beta")
    assert run(s, b)[0].address == "beta-p:1"
    s.first_token(first)
    assert waiting.event.wait(1.0) and waiting.prefill is not None and waiting.prefill.address == "alpha-p:1"
    assert len(s.queue) == 0


def test_each_model_has_its_own_page_size():
    s = sched()
    a = up(s, DECODE, "alpha-d:1", "alpha", page_size=16)
    b = up(s, DECODE, "beta-d:1", "beta", page_size=32)
    b2 = up(s, PREFILL, "beta-p:1", "beta", page_size=16)
    assert (s.page_size_of("alpha"), s.page_size_of("beta"), s.page_size) == (16, 32, 16)
    assert not a.refused and not b.refused
    assert "differs from the cluster's 32 of model 'beta'" in b2.refused


def test_an_instance_restarted_with_another_model_moves_group():
    s = sched()
    up(s, PREFILL, "p:1", "alpha")
    up(s, DECODE, "d:1", "alpha")
    inst = s.add(PREFILL, "p:1", model="beta", model_path="/models/beta")
    assert inst.model == "beta" and s.models() == {"alpha": "", "beta": "/models/beta"}
    with pytest.raises(Unavailable, match="no healthy prefill instance of model 'alpha'"):
        s.submit(job("a", "alpha"))


def test_prefix_affinity_is_per_model():
    """Both models see a prompt with the same leading page: alpha's affinity still points at alpha's instance."""
    s = sched()
    for m in ("alpha", "beta"):
        for k in range(2):
            up(s, PREFILL, f"{m}-p{k}:1", m)
        up(s, DECODE, f"{m}-d:1", m)
    h = b"same-page"

    def once(name: str, model: str):
        j = Job(name, 10.0, 10.0, 8, 2, h, model=model)
        p, _ = run(s, j)
        s.first_token(j)
        s.finish(j, completed=True)
        return p

    first = once("a1", "alpha")
    once("b1", "beta")
    again = once("a2", "alpha")  # least loaded would be the other alpha instance (fewer assigned)
    assert again is first and first.affinity_hits == 1
