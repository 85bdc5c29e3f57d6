"""Scheduler in-process (the policy code, no network): admission at the threshold, the dispatch gate and
priority order under contention, retries, release of every unit of load, the assignment policies."""

import threading

import pytest

from pdserve.router.admission import Rejected
from pdserve.router.config import RouterConfig
from pdserve.router.instances import DECODE, PREFILL, State
from pdserve.router.scheduler import Cancelled, Job, QueueTimeout, Scheduler, Unavailable


def make(n_prefill=2, n_decode=2, **kw) -> Scheduler:
    s = Scheduler(RouterConfig(model="m", **kw))
    for i in range(n_prefill):
        s.add(PREFILL, f"p{i}:1")
    for i in range(n_decode):
        s.add(DECODE, f"d{i}:1")
    return s


def job(pcs=10.0, mult=1.0, prompt_len=32, pages=4, page_hash=None, name="j") -> Job:
    return Job(name, pcs, pcs / mult, prompt_len, pages, page_hash)


def loads(s: Scheduler):
    return {a: (round(i.load_pcs, 6), i.in_flight) for r in (PREFILL, DECODE) for a, i in s.instances[r].items()}


def idle(s):
    return all(v == (0, 0) for v in loads(s).values()) and len(s.queue) == 0


def test_decode_admission_follows_the_kv_pool_with_retry_after():
    s = make()
    for d in s.instances[DECODE].values():
        s.update_stats(d, pages_free=100, pages_total=100, active=0)
    admitted = []
    for _ in range(7):
        j = job(pages=30)
        try:
            s.submit(j)
            admitted.append(j)
        except Rejected as e:
            assert e.retry_after_s > 0 and "decode" in e.reason and "pool" in e.reason
            break
    # each pool holds 100 pages: 3 × 30 fit, a 4th (120) does not; two instances
    assert len(admitted) == 6 and s.rejected == 1
    s.finish(admitted[0], completed=True)
    s.submit(job(pages=30))  # room again
    with pytest.raises(Rejected):
        s.submit(job(pages=30))


def test_prefill_admission_queues_a_ttft_budget_at_the_measured_rate():
    s = make(2, 1, ttft_budget_ms=500, prefill_floor_tokens=1000)
    p0, p1 = s.instances[PREFILL]["p0:1"], s.instances[PREFILL]["p1:1"]
    # unmeasured: the floor (1000 tokens) each
    jobs = [job(prompt_len=400, name=f"a{i}") for i in range(4)]
    for j in jobs:
        s.submit(j)
    with pytest.raises(Rejected) as e:
        s.submit(job(prompt_len=400))
    assert "500 ms" in e.value.reason and "prefill" in e.value.reason
    # unmeasured rate = floor / budget = 2000 tokens/s: (800 + 400) / 2000 - 0.5 = 0.1 s until it fits
    assert e.value.retry_after_s == pytest.approx(0.1)
    # p0 measured 10k tokens/s: 5000 tokens within 500 ms; p1 stays at its floor
    s.observe_page_size(p0, 0, prefill_tokens_per_s=10_000.0)
    s.observe_page_size(p1, 0, prefill_tokens_per_s=0.0)  # nothing measured: the rate is not reset
    assert p0.prefill_tokens_per_s == 10_000.0
    more = [job(prompt_len=1000, name=f"b{i}") for i in range(4)]
    for j in more:
        s.submit(j)
        assert (j.prefill or j.reserved[0]) is p0
    assert p0.queued_tokens + p0.inflight_tokens == 4800
    with pytest.raises(Rejected):
        s.submit(job(prompt_len=1000))
    for j in jobs + more:
        s.finish(j)
    assert idle(s) and p0.queued_tokens == p0.inflight_tokens == 0


def test_dispatch_never_takes_an_instance_past_its_budget():
    """The decode policy prefers d0 (free pages, idle) for everything; admission reserved on both: the pool
    wins, each instance ends with 3 requests (90 of 100 pages)."""
    s = make(1, 2)
    ds = s.instances[DECODE]
    s.update_stats(ds["d0:1"], pages_free=100, pages_total=100, active=0)
    s.update_stats(ds["d1:1"], pages_free=100, pages_total=100, active=50)
    jobs = [job(pages=30) for _ in range(6)]
    for j in jobs:
        s.submit(j)
        s.wait(j, 1.0)
    assert [ds[a].pages for a in ("d0:1", "d1:1")] == [90, 90]
    with pytest.raises(Rejected):
        s.submit(job(pages=30))


def test_idle_instance_admits_a_request_larger_than_its_budget():
    s = make(1, 1, prefill_floor_tokens=100)
    s.update_stats(s.instances[DECODE]["d0:1"], pages_free=10, pages_total=10, active=0)
    big = job(prompt_len=500, pages=50)
    s.submit(big)
    assert s.wait(big, 1.0)[0].address == "p0:1"
    with pytest.raises(Rejected):
        s.submit(job(prompt_len=1, pages=1))
    s.finish(big)
    assert idle(s)


def test_no_healthy_instance_is_unavailable():
    s = make(1, 1)
    s.set_state(s.instances[PREFILL]["p0:1"], State.DOWN)
    with pytest.raises(Unavailable, match="prefill"):
        s.submit(job())


def test_gate_and_priority_order_under_contention():
    # One prefill instance, at most 1 prompt token in flight: requests go one at a time, in priority order.
    s = make(1, 1, prefill_max_inflight_tokens=1, priority_aging_pcs_per_s=0.0)
    blocker = job(pcs=50, name="blocker")
    s.submit(blocker)
    s.wait(blocker, 1.0)
    jobs = [
        job(pcs=20, mult=m, name=n)
        for n, m in [("low1", 0.5), ("normal1", 1.0), ("high1", 1.5), ("low2", 0.5), ("high2", 1.5), ("normal2", 1.0)]
    ]
    for j in jobs:
        s.submit(j)
    assert len(s.queue) == 6 and all(not j.event.is_set() for j in jobs)
    order = []
    current = blocker
    for _ in jobs:
        s.first_token(current)
        s.finish(current, completed=True)
        current = next(j for j in jobs if j.event.is_set() and j.rid not in order)
        order.append(current.rid)
        assert sum(j.event.is_set() for j in jobs) == len(order)  # strictly one at a time
    assert order == ["high1", "high2", "normal1", "normal2", "low1", "low2"]


def test_queue_timeout_and_full_queue():
    s = make(1, 1, prefill_max_inflight_tokens=1, max_queue=2)
    first = job()
    s.submit(first)
    waiting = [job(), job()]
    for j in waiting:
        s.submit(j)
    with pytest.raises(Rejected, match="queue is full"):
        s.submit(job())
    with pytest.raises(QueueTimeout):
        s.wait(waiting[0], 0.05)
    s.finish(waiting[0])
    for j in (first, waiting[1]):
        s.finish(j)
    assert idle(s)


def test_cancel_while_queued_wakes_the_waiter_and_frees_its_place():
    s = make(1, 1, prefill_max_inflight_tokens=1)
    first, queued = job(), job()
    s.submit(first)
    s.submit(queued)
    woke = []
    t = threading.Thread(target=lambda: woke.append(pytest.raises(Cancelled, s.wait, queued, 30.0)))
    t.start()
    s.cancel(queued)
    t.join(timeout=5)
    assert woke and len(s.queue) == 0
    s.retry(queued, [])  # a cancelled job is not put back
    assert len(s.queue) == 0
    s.finish(queued)
    s.finish(first)
    assert idle(s)


def test_decode_gate_waits_for_free_pages():
    s = make(1, 1)
    d = s.instances[DECODE]["d0:1"]
    s.update_stats(d, pages_free=10, pages_total=20, active=0)  # the pool could hold both; 10 pages are in use
    a, b = job(pages=8), job(pages=8)
    s.submit(a)
    s.wait(a, 1.0)
    s.submit(b)
    assert not b.event.is_set()  # 10 - 8 pages free < 8 needed
    s.finish(a, completed=True)
    assert b.event.is_set()
    s.finish(b)


def test_retry_excludes_the_blamed_instance_and_every_release_returns_load():
    s = make(2, 2)
    j = job()
    s.submit(j)
    p, d = s.wait(j, 1.0)
    s.retry(j, [p])
    p2, d2 = s.wait(j, 1.0)
    assert p2 is not p and s.retries == 1
    s.retry(j, [])  # nothing blamed: both of the last pair are avoided for this job
    p3, d3 = s.wait(j, 1.0)
    assert d3 is not d2 and j.excluded == {p.address, p2.address, d2.address}
    assert p3 in (p, p2)  # every prefill excluded: any up instance rather than none
    s.first_token(j)
    s.finish(j, completed=True)
    s.finish(j)  # idempotent
    assert idle(s)


def test_decode_capacity_from_kv_pool():
    s = make(1, 1)
    d = s.instances[DECODE]["d0:1"]
    s.update_stats(d, pages_free=100, pages_total=100, active=0, page_size=16)
    assert s.page_size == 16
    assert d.capacity_pcs == 0.5 * 16 * 100  # max(w_in, w_out) · tokens the pool holds


def test_page_size_learned_from_stats_and_odd_instance_refused():
    s = make(2, 2)
    p0, p1 = s.instances[PREFILL]["p0:1"], s.instances[PREFILL]["p1:1"]
    d0, d1 = s.instances[DECODE]["d0:1"], s.instances[DECODE]["d1:1"]
    assert s.page_size is None
    s.observe_page_size(p0, 0)  # not reported: nothing learned
    assert s.page_size is None
    s.observe_page_size(p0, 16)
    s.update_stats(d0, pages_free=100, pages_total=100, active=0, page_size=16)
    s.observe_page_size(p1, 32)  # disagrees with the first report: refused, never dispatched to
    s.update_stats(d1, pages_free=100, pages_total=100, active=0, page_size=32)
    assert s.page_size == 16 and p1.refused and d1.refused and not p0.refused and not d0.refused
    for i in range(6):
        j = job(name=f"j{i}")
        s.submit(j)
        assert s.wait(j, 1.0) == (p0, d0)
        s.finish(j, completed=True)
    s.observe_page_size(p1, 16)  # restarted with the cluster's page size: accepted again
    assert not p1.refused
    s.remove(PREFILL, "p0:1")
    j = job()
    s.submit(j)
    assert s.wait(j, 1.0) == (p1, d0)
    s.finish(j)
    assert idle(s)


def test_concurrent_submit_finish_leaves_no_load():
    s = make(3, 2, prefill_max_inflight_tokens=64)

    def worker(k):
        for i in range(200):
            j = job(pcs=1 + (i % 7), prompt_len=16 + i % 40, name=f"{k}-{i}")
            try:
                s.submit(j)
                s.wait(j, 5.0)
                if i % 3:
                    s.first_token(j)
            except Rejected:
                continue
            finally:
                s.finish(j, completed=True)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert idle(s) and all(
        i.inflight_tokens == 0 and i.pages == 0 for r in (PREFILL, DECODE) for i in s.instances[r].values()
    )


# ---- assignment policies ------------------------------------------------------------------------------------
def run_one(s: Scheduler, j: Job):
    s.submit(j)
    p, d = s.wait(j, 1.0)
    return p.address, d.address


def test_pcs_prefill_least_outstanding_and_balanced():
    s = make(3, 2)
    held = [job(pcs=100 * (k + 1)) for k in range(3)]
    for j in held:
        run_one(s, j)
    # the third instance holds 300, the first 100: a new request goes to the least-loaded one
    assert run_one(s, job(pcs=5))[0] == held[0].prefill.address
    s2 = make(3, 2)
    counts = {}
    for _ in range(30):
        p, _ = run_one(s2, j := job(pcs=10))
        counts[p] = counts.get(p, 0) + 1
        s2.finish(j, completed=True)
    assert sorted(counts.values()) == [10, 10, 10]


def test_prefix_affinity_holds_while_load_allows():
    s = make(3, 2, affinity_slack_pcs=100)
    h = b"prefix-1"
    first = job(pcs=10, page_hash=h)
    p0, _ = run_one(s, first)
    hits = []
    for _ in range(5):  # same leading page: same instance, although it is now the most loaded
        hits.append(run_one(s, job(pcs=10, page_hash=h))[0])
    assert hits == [p0] * 5 and s.instances[PREFILL][p0].affinity_hits == 5
    others = {run_one(s, job(pcs=10, page_hash=bytes([k])))[0] for k in range(4)}
    assert p0 not in others  # new prefixes go to the less loaded instances
    # p0 holds 60 PCS, the others 20: within the slack of 100, so this one still goes to p0 (now 260) ...
    assert run_one(s, job(pcs=200, page_hash=h))[0] == p0
    # ... and now p0 is 240 above the least-loaded instance: affinity yields to balance.
    assert run_one(s, job(pcs=10, page_hash=h))[0] != p0
    s_off = make(3, 2, affinity=False)
    assert len({run_one(s_off, job(pcs=10, page_hash=h))[0] for _ in range(3)}) == 3


def test_decode_prefers_free_pages_and_few_active():
    s = make(1, 3)
    ds = s.instances[DECODE]
    s.update_stats(ds["d0:1"], pages_free=100, pages_total=1000, active=2)  # nearly full
    s.update_stats(ds["d1:1"], pages_free=900, pages_total=1000, active=40)  # many sequences
    s.update_stats(ds["d2:1"], pages_free=800, pages_total=1000, active=2)
    assert run_one(s, job(pages=10))[1] == "d2:1"
    s_p2c = make(1, 3, decode_choice="p2c", seed=1)
    for a, (free, act) in zip(("d0:1", "d1:1", "d2:1"), ((100, 2), (900, 40), (800, 2))):
        s_p2c.update_stats(s_p2c.instances[DECODE][a], free, 1000, act)
    picks = set()
    for _ in range(20):
        picks.add(run_one(s_p2c, j := job(pages=1))[1])
        s_p2c.finish(j)
    assert picks == {"d1:1", "d2:1"}  # two random candidates: the worst never wins, the middle one sometimes


def test_baselines_round_robin_and_least_requests():
    s = make(3, 2, policy="round_robin")
    assert [run_one(s, job())[0] for _ in range(6)] == ["p0:1", "p1:1", "p2:1"] * 2
    s = make(2, 2, policy="least_requests", prefill_max_inflight_tokens=0)
    a = job(pcs=1000)
    run_one(s, a)
    assert run_one(s, job(pcs=1))[0] != a.prefill.address


def test_a_shrunk_budget_never_stalls_the_queue_behind_its_own_reservations():
    """Jobs admitted before the SLO controller shrank an instance's budget stay queued with their reservations.
    The head of the queue must still go to an idle instance: the jobs behind it are not work ahead of it. (The
    router once sat idle for a whole SLO window this way on the H200 c32 run.)"""
    s = make(1, 1, prefill_floor_tokens=1000, prefill_max_inflight_tokens=1)
    s.update_stats(s.instances[DECODE]["d0:1"], pages_free=1000, pages_total=1000, active=0)
    p = s.instances[PREFILL]["p0:1"]
    blocker = job(prompt_len=300, name="blocker")
    s.submit(blocker)
    s.wait(blocker, 1.0)
    queued = [job(prompt_len=300, name=f"q{i}") for i in range(2)]
    for j in queued:
        s.submit(j)  # 900 of 1000 tokens: admitted, queued behind the gate
    assert not any(j.event.is_set() for j in queued)
    p.ttft_factor = 0.2  # the controller's cut: 200 tokens, less than the queued reservations
    s.first_token(blocker)
    s.finish(blocker, completed=True)
    assert queued[0].event.is_set() and not queued[1].event.is_set()  # p0 idle: the head goes
    s.first_token(queued[0])
    s.finish(queued[0], completed=True)
    assert queued[1].event.is_set()
    s.first_token(queued[1])
    s.finish(queued[1], completed=True)
    assert idle(s)


def test_callers_rejected_together_are_sent_back_one_after_another():
    """RetrySlots: a burst of rejections gets pushbacks spaced by one request's drain time (its prompt at the
    instances' rate), so they return in turn instead of together; never more than max_spread_s past each one's
    own earliest retry; a later rejection, after the promises passed, starts afresh."""
    s = make(1, 1, ttft_budget_ms=500, prefill_floor_tokens=1000)  # unmeasured: 2000 tokens/s
    for i in range(2):
        s.submit(job(prompt_len=400, name=f"a{i}"))
    waits = []
    for i in range(8):
        with pytest.raises(Rejected) as e:
            s.submit(job(prompt_len=400, name=f"r{i}"))
        waits.append(e.value.retry_after_s)
    # the first: (800 + 400) / 2000 - 0.5 = 0.1 s; then 400 tokens / 2000 tokens/s = 0.2 s apart, up to 0.1 + 2 s
    want = [min(0.1 + 0.2 * k, 2.1) for k in range(8)]
    assert waits == pytest.approx(want, abs=0.01)
    assert s.rejected == 8


def test_retry_slots_forget_promises_that_passed_and_cap_the_spread():
    from pdserve.router.admission import RetrySlots

    slots = RetrySlots(max_spread_s=1.0)
    assert slots.promise(100.0, 0.1, 0.5) == pytest.approx(0.1)
    assert slots.promise(100.0, 0.1, 0.5) == pytest.approx(0.6)
    assert slots.promise(100.0, 0.1, 0.5) == pytest.approx(1.1)  # capped: 0.1 + 1.0
    assert slots.promise(100.0, 0.1, 0.5) == pytest.approx(1.1)
    assert slots.promise(200.0, 0.3, 0.5) == pytest.approx(0.3)  # the promises are long past
