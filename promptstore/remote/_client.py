"""The connection: one Redis or Valkey server, or a Redis Cluster found from any node.

Every call is bounded: connect and socket timeouts are the URL's
``timeout``, a single server gets no retries, a cluster one retry (to follow
a topology change: MOVED/ASK are followed by redis-py itself). Whatever
fails (refused, timed out, a node down, the cluster down, an error reply
to a read) is RemoteUnavailable; an error reply to a write is RemoteRefused
(``_failure`` tells them apart). After a failed connection (refused, timed
out, a node or the cluster down) the next call connects afresh, so a
cluster that changed is discovered again; the calls of other threads in
flight on the old connection finish first (the last closes it). An error
reply leaves the connection as it is: it is in step, and other threads'
calls go on over it. Commands are pipelined in batches: a cluster pipeline
sends each node its share, all nodes at once, then reads.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from promptstore.errors import RemoteCorrupt, RemoteError, RemoteFull, RemoteRefused, RemoteUnavailable, RemoteURLError
from promptstore.remote import _direct
from promptstore.remote._url import RemoteURL

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry
except ImportError:  # the remote tier is an extra: pip install 'promptstore[remote]'
    redis = None  # type: ignore[assignment]

BATCH = 256  # commands per pipeline round trip
GET_BATCH = 4096  # reads of one fetch: one round trip (blocks are at most a few MB each)


class _Held:
    """A redis-py client and how many calls use it. Closing it closes every
    connection of its pool, those other threads' calls read from too: a
    reset retires it, and the last call using it closes it."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.users = 0
        self.retired = False


class Client:
    """Pipelined reads and writes of raw keys, with bounded timeouts."""

    def __init__(self, url: RemoteURL):
        self.url = url
        self._lock = threading.Lock()
        self._held: Optional[_Held] = None
        self.closed = False  # closed: every call raises RemoteUnavailable, none connects again
        self.cluster = False
        self.reads = {"direct": 0, "through redis-py": 0}  # get_into calls by the way they read

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """The redis-py client (connected on first use), held for one call."""
        with self._lock:
            if self.closed:
                raise RemoteUnavailable(f"remote {self.url}: closed")
            if self._held is None:
                self._held = _Held(self._connect())
            held = self._held
            held.users += 1
        try:
            yield held.conn
        finally:
            with self._lock:
                held.users -= 1
                last = held.retired and not held.users
            if last:
                _close(held.conn)

    def _connect(self) -> Any:
        if redis is None:
            raise RemoteUnavailable("the remote tier needs redis-py: pip install 'promptstore[remote]' (or redis>=5)")
        u = self.url
        common: Dict[str, Any] = dict(
            username=u.username, password=u.password, socket_timeout=u.timeout,
            socket_connect_timeout=u.timeout, ssl=u.tls, health_check_interval=0,
        )
        try:
            # Probed on database 0: a cluster node refuses SELECT of any other,
            # which would hide the real mistake (a /db in a cluster's URL).
            probe = redis.Redis(host=u.host, port=u.port, db=0, retry=Retry(NoBackoff(), 0), **common)
            enabled = probe.info("cluster").get("cluster_enabled")
            if not enabled:
                self.cluster = False
                if not u.db:
                    return probe
                probe.close()
                return redis.Redis(host=u.host, port=u.port, db=u.db, retry=Retry(NoBackoff(), 0), **common)
            probe.close()
            if u.db:
                raise RemoteURLError(f"{u}: a Redis Cluster has only database 0")
            self.cluster = True
            return RedisCluster(host=u.host, port=u.port, retry=Retry(NoBackoff(), 1), require_full_coverage=False,
                                **common)
        except RemoteURLError:
            raise
        except Exception as err:
            raise _failure(u, err) from err

    def reset(self) -> None:
        """Drop the connection; the next call connects (and discovers) again.
        Calls in flight on it finish first (the last one closes it)."""
        with self._lock:
            held, self._held = self._held, None
            if held is None:
                return
            held.retired = True
            last = not held.users
        if last:
            _close(held.conn)

    def _failed(self, err: Exception, write: bool = False) -> RemoteError:
        """The error to raise for ``err`` (of a write: ``write``); the connection
        is reset, unless the server answered with an error reply (it is in step)."""
        if not _answered(err):
            self.reset()
        return _failure(self.url, err, write)

    def close(self) -> None:
        """Drop the connection for good: a call made later raises RemoteUnavailable."""
        self.closed = True
        self.reset()

    def _pipelined(self, ops: Sequence[Tuple[str, Tuple[Any, ...], Dict[str, Any]]], batch: int = 0,
                   write: bool = False) -> List[Any]:
        """Run ``(method, args, kwargs)`` pipeline commands in batches (``write``:
        commands that write); their replies."""
        out: List[Any] = []
        if not ops:
            return out
        with self._connection() as conn:
            try:
                step = batch or BATCH
                for i in range(0, len(ops), step):
                    pipe = conn.pipeline(transaction=False)
                    for name, args, kwargs in ops[i : i + step]:
                        getattr(pipe, name)(*args, **kwargs)
                    out.extend(pipe.execute(raise_on_error=True))
            except Exception as err:
                raise self._failed(err, write) from err
        return out

    def get(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        return self._pipelined([("get", (k,), {}) for k in keys], GET_BATCH)

    def get_into(self, keys: Sequence[bytes], sinks: Sequence[Sequence[memoryview]]) -> List[bool]:
        """GET every key into its sink (writable byte views filled in order,
        adding up to the value's length), straight from the socket where it
        can (``_direct``), else through redis-py; whether each key was there.

        Raises:
            RemoteUnavailable: the connection failed or the server answered an error.
            RemoteCorrupt: a value's length differs from its sink's.
        """
        if not keys:
            return []
        with self._connection() as conn:
            try:
                found = _direct.get_into(conn, self.cluster, keys, sinks)
                self.reads["direct"] += 1
                return found
            except _direct.Unsupported:
                self.reads["through redis-py"] += 1  # read through redis-py below
            except _direct.WrongSize as err:
                raise RemoteCorrupt(f"remote key {keys[err.index]!r}: {err} (truncated?)") from err
            except Exception as err:
                raise self._failed(err) from err
        found = []
        for key, value, sink in zip(keys, self.get(keys), sinks):
            if value is None:
                found.append(False)
                continue
            want = sum(len(v) for v in sink)
            if len(value) != want:
                raise RemoteCorrupt(f"remote key {key!r}: {len(value)} bytes, expected {want} (truncated?)")
            pos, src = 0, memoryview(value)
            for view in sink:
                view[:] = src[pos : pos + len(view)]
                pos += len(view)
            found.append(True)
        return found

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        return [bool(r) for r in self._pipelined([("exists", (k,), {}) for k in keys])]

    def set_new(self, items: Sequence[Tuple[bytes, bytes]]) -> None:
        """SET each key only when absent (content-addressed values never change)."""
        self._pipelined([("set", (k, v), {"nx": True}) for k, v in items], write=True)

    def set(self, items: Sequence[Tuple[bytes, bytes]]) -> None:
        self._pipelined([("set", (k, v), {}) for k, v in items], write=True)

    def hset(self, items: Sequence[Tuple[bytes, bytes, bytes]]) -> None:
        self._pipelined([("hset", (k, f, v), {}) for k, f, v in items], write=True)

    def hgetall(self, keys: Sequence[bytes]) -> List[Dict[bytes, bytes]]:
        return self._pipelined([("hgetall", (k,), {}) for k in keys])

    def scan(self, pattern: bytes, count: int = 1000) -> Iterator[bytes]:
        """Every key matching ``pattern`` (on every master of a cluster)."""
        with self._connection() as conn:
            try:
                yield from conn.scan_iter(match=pattern, count=count)
            except Exception as err:
                raise self._failed(err) from err

    def memory(self) -> List[Dict[str, Any]]:
        """``INFO memory`` of the server, or of every master."""
        with self._connection() as conn:
            try:
                if self.cluster:
                    return list(conn.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
                return [conn.info("memory")]
            except Exception as err:
                raise self._failed(err) from err


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        pass


def _answered(err: Exception) -> bool:
    """Whether ``err`` is the server's error reply to a command (redis-py's
    ResponseError, the direct read's ReplyError), which leaves the
    connection in step: not a failed connection or a timeout, nor a cluster
    whose slots are moving or uncovered (CLUSTERDOWN, TRYAGAIN, a redirect
    not followed), after which the cluster is discovered again."""
    if isinstance(err, _direct.ReplyError):
        return True
    if redis is None or not isinstance(err, redis.ResponseError):
        return False
    return not isinstance(err, (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.AskError))


def _failure(url: RemoteURL, err: Exception, write: bool = False) -> RemoteError:
    """The error a failed call raises: RemoteCorrupt when the server refused a
    key holding another type than the tier writes there (damage, or another
    program's key: the remote is up, and every other key still serves),
    RemoteFull when it refused a write for want of memory (``OOM``, under
    ``noeviction``: reads still serve), RemoteRefused for any other error
    reply to a write (``write``: a read-only replica, ``MISCONF``,
    ``NOPERM``; reads still serve), RemoteUnavailable otherwise (the tier
    then cools down). A pipeline's error names its command and its
    arguments (a block's bytes): only the reply is kept."""
    text = str(err).split(" of pipeline caused error: ", 1)[-1][:300]
    reply = _answered(err)
    if "WRONGTYPE" in text and reply:
        return RemoteCorrupt(f"remote {url}: a key holds a value of another type ({text})")
    if reply and (type(err).__name__ == "OutOfMemoryError" or text.startswith("OOM") or "> 'maxmemory'" in text):
        return RemoteFull(f"remote {url}: it refused a write, its memory is full ({text}); raise maxmemory or use an eviction policy")
    if reply and write:
        return RemoteRefused(f"remote {url}: it refused a write ({type(err).__name__}: {text}); publishes are dropped, reads go on")
    what = "timed out" if isinstance(err, TimeoutError) or "Timeout" in type(err).__name__ else "failed"
    return RemoteUnavailable(f"remote {url} {what}: {type(err).__name__}: {text}")
