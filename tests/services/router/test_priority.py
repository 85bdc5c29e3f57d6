"""Priority from the request field or `x-priority` metadata; queue order by PCS / multiplier; aging."""

import pytest

from pdserve.router.priority import Priority, PriorityQueue, resolve
from pdserve.v1 import generate_pb2


def test_resolve_field_metadata_default():
    assert resolve(generate_pb2.PRIORITY_HIGH, []) is Priority.HIGH
    assert resolve(generate_pb2.PRIORITY_UNSPECIFIED, [("x-priority", "low")]) is Priority.LOW
    assert resolve(generate_pb2.PRIORITY_UNSPECIFIED, [("x-priority", b" High ")]) is Priority.HIGH
    assert resolve(generate_pb2.PRIORITY_LOW, [("x-priority", "high")]) is Priority.LOW  # the field wins
    assert resolve(generate_pb2.PRIORITY_UNSPECIFIED, [("other", "x")]) is Priority.NORMAL
    with pytest.raises(ValueError, match="x-priority must be high, normal or low"):
        resolve(generate_pb2.PRIORITY_UNSPECIFIED, [("x-priority", "urgent")])
    with pytest.raises(ValueError, match="priority 7 is not a Priority value"):  # proto3 keeps unknown numbers
        resolve(7, [("x-priority", "high")])


class Item:
    def __init__(self, name):
        self.name, self.key, self.queued = name, 0.0, False


def drain(q):
    out = []
    while (it := q.pop()) is not None:
        out.append(it.name)
    return out


def test_order_by_weighted_pcs_then_arrival():
    q = PriorityQueue(aging_per_s=0.0)
    for name, cost, t in [
        ("low", 100 / 0.5, 0.0),
        ("normal", 100, 0.1),
        ("high", 100 / 1.5, 0.2),
        ("normal2", 100, 0.3),
        ("small-normal", 20, 0.4),
        ("big-high", 400 / 1.5, 0.5),
    ]:
        q.push(Item(name), cost, t)
    assert len(q) == 6
    assert drain(q) == ["small-normal", "high", "normal", "normal2", "low", "big-high"]
    assert len(q) == 0


def test_aging_bounds_the_wait_of_big_and_low_priority_requests():
    aging = 10.0
    q = PriorityQueue(aging_per_s=aging)
    low = Item("low")
    q.push(low, 1000 / 0.5, arrival=0.0)  # a big low-priority request: value 2000 at t=0
    # Small high-priority requests keep arriving, one per second, each worth 10 / 1.5 when it arrives.
    for k in range(1, 400):
        q.push(Item(f"high@{k}"), 10 / 1.5, arrival=float(k))
    order = drain(q)
    # It is overtaken only by those arriving less than (2000 - 6.67) / aging = 199.3 s after it.
    assert order.index("low") == 199, order.index("low")
    assert q.value(low, now=199.0) == pytest.approx(2000 - 1990)


def test_remove_and_requeue_keep_counts_and_place():
    q = PriorityQueue(aging_per_s=1.0)
    a, b, c = Item("a"), Item("b"), Item("c")
    q.push(a, 5, 0.0)
    q.push(b, 1, 0.0)
    q.push(c, 10, 0.0)
    assert q.remove(b) and not q.remove(b) and len(q) == 2
    assert q.pop() is a
    q.requeue(a)  # a retry goes back to where it was: ahead of c
    assert drain(q) == ["a", "c"]
