from pdserve.router.instances import InstancePool
from pdserve.router.pcs import PCSWeights, score


def test_pcs_formula():
    special = frozenset({1, 2})
    p = score([1, 5, 6, 2, 7], special, max_tokens=16, w=PCSWeights())
    assert (p.input_len, p.num_special, p.est_output_len) == (5, 2, 16)
    assert abs(p.score - (0.3 * 5 + 0.5 * 16 + 1.2 * 2)) < 1e-9


def test_least_outstanding_pcs():
    pool = InstancePool("decode", ["a", "b"])
    a = pool.acquire(100.0)
    b = pool.acquire(10.0)
    assert (a.address, b.address) == ("a", "b")
    assert pool.acquire(1.0).address == "b"  # b has 10 outstanding, a has 100
    pool.release(a, 100.0)
    assert pool.acquire(1.0).address == "a"
    assert pool.acquire(1.0, exclude=frozenset({"a"})).address == "b"
