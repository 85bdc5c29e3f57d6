"""The private Redis Cluster of tests and benchmarks: every slot served across its shards, and a second cluster
in the same directory (a bench run again on one host) starts instead of finding its slots taken."""

from __future__ import annotations

import redis.cluster

from pdserve.testing.redis_cluster import RedisClusterServers


def test_a_cluster_starts_again_in_the_same_directory(tmp_path):
    for round_ in range(2):
        servers = RedisClusterServers(tmp_path, shards=2).start()
        try:
            client = redis.cluster.RedisCluster.from_url(servers.url)
            keys = [f"k{round_}-{i}".encode() for i in range(20)]
            for k in keys:
                client.set(k, b"v")
            assert all(n.client().dbsize() > 0 for n in servers.nodes)  # both shards hold keys
            assert all(client.get(k) == b"v" for k in keys)
            client.close()
        finally:
            servers.stop()
