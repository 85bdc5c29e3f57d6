"""A private Redis Cluster of `shards` `redis-server` processes on loopback (tests, benchmarks): each node owns an
equal range of the 16384 hash slots, no replicas, no persistence; `url` is a seed node's (the cluster client
discovers the rest). One server tops out near 1.2-1.5 GB/s of megabyte values on a host (its single thread), so
a prompt cache meant to beat a GPU's prefill spreads its pages over several (see docs/benchmarks.md)."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.testing.redis_server import RedisServer

SLOTS = 16384


class RedisClusterServers:
    def __init__(self, workdir: Path | str, shards: int = 3, args: tuple[str, ...] = ()):
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.workdir = Path(workdir)
        self.nodes = [
            RedisServer(
                self.workdir / f"node{i}",
                args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(self.workdir / f"node{i}.conf"),
                    "--cluster-port",
                    RedisServer.FREE_PORT,
                    *args,
                ],
            )  # fmt: skip
            for i in range(shards)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url.removesuffix("/0")

    def start(self, timeout: float = 20.0) -> RedisClusterServers:
        """Start every node, give each its slot range, join them, and wait until every node says the cluster is ok."""
        try:
            for i in range(len(self.nodes)):  # a cluster config left by an earlier run in this workdir: slots taken
                (self.workdir / f"node{i}.conf").unlink(missing_ok=True)
            for n in self.nodes:
                n.start()
            per = -(-SLOTS // len(self.nodes))
            for i, n in enumerate(self.nodes):
                n.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, min(SLOTS, (i + 1) * per) - 1)
            seed = self.nodes[0].client()
            for n in self.nodes[1:]:
                seed.execute_command("CLUSTER", "MEET", "127.0.0.1", n.port, n.extra_ports[0])
            deadline = time.monotonic() + timeout
            for n in self.nodes:
                c = n.client()
                while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"Redis Cluster of {len(self.nodes)} nodes not ok after {timeout} s")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
