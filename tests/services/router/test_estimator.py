"""Output-length estimator: learns a synthetic workload with known structure, falls back while cold or wrong,
persists to a file and to a real Redis, and never trusts state saved for another model."""

import statistics

import pytest

from pdserve.router.estimator import OutputLengthEstimator, features
from pdserve.router.estimator_store import FileStore, Persistence, RedisStore, open_store
from pdserve.router.pcs import count_special, fallback_output_len
from pdserve.testing.synthetic import rel_error, workload

SPECIAL = frozenset({0, 1, 2, 3, 4})


def run(est: OutputLengthEstimator, samples, skip: int = 0) -> dict[str, float]:
    """Online: predict, then learn the outcome. Mean errors after `skip` warm-up requests."""
    errs = {"learned": [], "length_only": [], "oracle": []}
    for i, s in enumerate(samples):
        f = features(s.token_ids, SPECIAL, count_special(s.token_ids, SPECIAL))
        p = est.predict(f, s.max_tokens)
        fb = fallback_output_len(s.max_tokens, len(s.token_ids), "length_only")
        if i >= skip:
            errs["learned"].append(rel_error(p if p is not None else fb, s.output_len))
            errs["length_only"].append(rel_error(fb, s.output_len))
            errs["oracle"].append(rel_error(s.oracle, s.output_len))
        est.observe(f, s.output_len, p)
    return {k: statistics.mean(v) for k, v in errs.items()}


def test_learns_known_structure_close_to_oracle():
    est = OutputLengthEstimator(min_samples=50, max_error=0.5)
    assert not est.use_learned() and est.mode("length_only") == "length_only"  # cold
    e = run(est, workload(3000, seed=1), skip=1000)
    print(f"relative error: learned {e['learned']:.3f}, length_only {e['length_only']:.3f}, oracle {e['oracle']:.3f}")
    assert e["learned"] < 0.6 * e["length_only"]
    assert e["learned"] < e["oracle"] + 0.05  # the noise floor of the workload is the oracle's error
    assert est.use_learned() and est.mode("length_only") == "learned"
    assert abs(est.error - e["learned"]) < 0.05  # its own running error tracks the measured one


def test_high_error_switches_to_fallback():
    est = OutputLengthEstimator(min_samples=10, max_error=0.3)
    run(est, workload(400, seed=2))
    assert est.use_learned()
    # The world changes: every task now answers with 1 token. The running error climbs past max_error.
    f = features(list(range(5, 60)), SPECIAL, 0)
    for _ in range(200):
        est.observe(f, 1, 300)
    assert est.error > 0.3 and not est.use_learned() and est.mode("max_tokens") == "max_tokens"


def test_prediction_never_exceeds_max_tokens():
    est = OutputLengthEstimator(min_samples=1)
    f = features(list(range(5, 40)), SPECIAL, 0)
    assert est.predict(f, 100) is None
    for _ in range(5):
        est.observe(f, 500, None)
    assert est.predict(f, 100) == 100 and est.predict(f, 1000) == 500


def test_file_persistence_round_trip(tmp_path):
    est = OutputLengthEstimator(model="m1")
    run(est, workload(300, seed=3))
    store = open_store(str(tmp_path / "est.json"), "m1")
    assert isinstance(store, FileStore)
    p = Persistence(est, store, interval_s=60)
    p.save()
    again = OutputLengthEstimator(model="m1")
    assert Persistence(again, store, 60).load()
    assert (again.samples, again.error) == (est.samples, est.error)
    f = features(workload(1, seed=3)[0].token_ids, SPECIAL, 0)
    assert again.predict(f, 1024) == est.predict(f, 1024)
    other = OutputLengthEstimator(model="m2")  # another tokenizer: signatures would mean something else
    assert not Persistence(other, store, 60).load() and other.samples == 0
    (tmp_path / "bad.json").write_text('{"version": 1, "model": "m1", "levels": "x"}')
    assert not Persistence(OutputLengthEstimator(model="m1"), FileStore(tmp_path / "bad.json"), 60).load()


def test_default_store_is_a_file_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    store = open_store("", "abc")
    assert isinstance(store, FileStore) and store.path == tmp_path / "router-estimator-abc.json"


def test_background_save_and_close(tmp_path):
    est = OutputLengthEstimator(model="m")
    p = Persistence(est, FileStore(tmp_path / "s.json"), interval_s=0.05)
    p.start()
    run(est, workload(50, seed=4))
    p.close()  # saves what changed
    assert not est.dirty and OutputLengthEstimator(model="m").load_json((tmp_path / "s.json").read_text())


@pytest.fixture
def redis_server(tmp_path):
    from pdserve.testing.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def test_redis_persistence_and_outage(redis_server):
    est = OutputLengthEstimator(model="m1")
    run(est, workload(300, seed=5))
    store = open_store(redis_server.url, "m1")
    assert isinstance(store, RedisStore)
    Persistence(est, store, 60).save()
    assert redis_server.client().exists("pdserve:router:estimator:m1")
    again = OutputLengthEstimator(model="m1")
    assert Persistence(again, open_store(redis_server.url, "m1"), 60).load() and again.samples == est.samples
    redis_server.stop()  # Redis down: loading starts cold, saving keeps the state dirty; nothing raises
    cold = OutputLengthEstimator(model="m1")
    assert not Persistence(cold, store, 60).load() and cold.samples == 0
    est.observe(features([5] * 20, SPECIAL, 0), 10, None)
    Persistence(est, store, 60).save()
    assert est.dirty
