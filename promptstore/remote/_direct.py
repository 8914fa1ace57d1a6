"""GETs whose values are read straight into their destinations.

redis-py parses a reply into a ``bytes`` object through a buffer of its own,
so a value it returns has been copied twice before the caller copies it
where it belongs. A fetch of a 4K-token entry (178 MB in 512-token blocks)
spent most of its time there: pipelined GETs of 926 KB values took 0.47-0.55
s through redis-py and 0.16-0.20 s read from the socket straight into one
buffer (one-off script, one redis-server on loopback). :func:`get_into`
sends the GETs of a pipeline on redis-py's own connections (one per node
of a cluster, all sent before any is read) and reads each bulk reply from
the socket into the caller's views: its header, then its body with
``recv_into``.

It only reads what it understands. A redirect (the cluster moved a slot),
an unknown reply type, data waiting before the GETs were sent, or a
connection without the socket it needs raise :class:`Unsupported`, and
the caller reads the same keys through redis-py instead. Whatever
interrupts a read leaves the stream out of step, so on any error every
connection this call used is closed (the pool opens new ones).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

_CHUNK = 1 << 16  # bytes asked of the socket while looking for a reply's header
_MAX_LINE = 1 << 16  # a header (or an error line) longer than this is not RESP
_NEEDS = ("connect", "can_read", "pack_commands", "send_packed_command", "disconnect")  # of a redis-py connection


class Unsupported(Exception):
    """The direct read cannot run here; read through redis-py instead."""


class WrongSize(Exception):
    """A value's length differs from what its views hold."""

    def __init__(self, index: int, got: int, want: int):
        super().__init__(f"{got} bytes, expected {want}")
        self.index, self.got, self.want = index, got, want


class ReplyError(Exception):
    """The server answered a GET with an error (other than a redirect)."""


class _Reader:
    """RESP replies read from a socket, bulk bodies straight into views."""

    def __init__(self, sock: Any):
        self.sock = sock
        self.buf = bytearray()

    def _more(self) -> None:
        chunk = self.sock.recv(_CHUNK)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        start = 0
        while True:
            i = self.buf.find(b"\r\n", start)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            if len(self.buf) > _MAX_LINE:
                raise ConnectionError("a reply header without an end: not RESP")
            start = max(0, len(self.buf) - 1)
            self._more()

    def exact(self, views: Sequence[memoryview]) -> None:
        for view in views:
            n = len(view)
            got = min(n, len(self.buf))
            view[:got] = self.buf[:got]
            del self.buf[:got]
            while got < n:
                r = self.sock.recv_into(view[got:])
                if r == 0:
                    raise ConnectionError("the server closed the connection inside a reply")
                got += r

    def skip(self, n: int) -> None:
        while len(self.buf) < n:
            self._more()
        del self.buf[:n]

    def bulk_into(self, index: int, views: Sequence[memoryview]) -> bool:
        """Read one GET reply into ``views``; False for a missing key."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return False
            want = sum(len(v) for v in views)
            if n != want:
                raise WrongSize(index, n, want)
            self.exact(views)
            if self.line():
                raise ConnectionError("a bulk reply longer than its length")
            return True
        if kind == b"_":  # RESP3 null
            return False
        if kind == b"-":
            if rest.split(b" ", 1)[0] in (b"MOVED", b"ASK", b"TRYAGAIN", b"CLUSTERDOWN"):
                raise Unsupported(rest.decode(errors="replace"))
            raise ReplyError(rest.decode(errors="replace"))
        if kind == b"!":  # RESP3 blob error
            n = int(rest)
            self.skip(n + 2)
            raise ReplyError(f"a blob error of {n} bytes")
        raise Unsupported(f"reply type {kind!r}")


def _take(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py 5 names the command
        return pool.get_connection("GET")


def _groups(conn: Any, cluster: bool, keys: Sequence[bytes]) -> List[Tuple[Any, List[int]]]:
    """The connection pool of each server the keys live on, with the keys' indexes."""
    if not cluster:
        return [(conn.connection_pool, list(range(len(keys))))]
    by_node: Dict[str, Tuple[Any, List[int]]] = {}
    for i, key in enumerate(keys):
        try:
            node = conn.get_node_from_key(key)
            client = conn.get_redis_connection(node)
        except Exception as err:  # a slot not covered, a topology being found: redis-py says what
            raise Unsupported(f"{type(err).__name__}: {err}") from err
        by_node.setdefault(node.name, (client.connection_pool, []))[1].append(i)
    return list(by_node.values())


def get_into(conn: Any, cluster: bool, keys: Sequence[bytes], sinks: Sequence[Sequence[memoryview]]) -> List[bool]:
    """GET every key, each value read into its sink (writable byte views
    filled in order, adding up to the value's length); whether each key was
    there.

    Raises:
        Unsupported: read these keys through redis-py instead.
        WrongSize: a value's length differs from its sink's.
        ReplyError: the server answered with an error.
        OSError, ConnectionError, TimeoutError: the connection failed.
    """
    found = [False] * len(keys)
    taken: List[Tuple[Any, Any]] = []
    ok = False
    try:
        groups = _groups(conn, cluster, keys)
        for pool, idx in groups:
            c = _take(pool)
            taken.append((pool, c))
            if not all(hasattr(c, name) for name in _NEEDS):
                raise Unsupported("this redis-py's connections lack what a direct read uses")
            c.connect()
            if getattr(c, "_sock", None) is None or c.can_read(timeout=0):
                raise Unsupported("the connection has no socket of its own, or data already waits on it")
            c.send_packed_command(c.pack_commands([("GET", keys[i]) for i in idx]), check_health=False)
        for (_, c), (_, idx) in zip(taken, groups):
            reader = _Reader(c._sock)
            for i in idx:
                found[i] = reader.bulk_into(i, sinks[i])
            if reader.buf:
                raise ConnectionError("more data than the replies")
        ok = True
        return found
    finally:
        for pool, c in taken:
            if not ok:
                c.disconnect()
            pool.release(c)
