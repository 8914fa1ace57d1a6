"""The remote tier: publish entries, find them by token prefix, fetch them checked.

:class:`Remote` owns a :class:`~promptstore.remote._client.Client`, the key
layout and the counters. Its read methods never raise for what the remote
does: a remote that is down, slow, evicted or sends damaged values gives
None (a miss) and a count in :meth:`Remote.stats`, logged once per kind. After
the remote was unreachable it is left alone for ``cooldown`` seconds, so a
dead remote costs each lookup nothing, not a timeout.

The caller (the store) passes a :class:`Key`: model identity, its id, the
entry key and prefix hashes it computes for its own index, so both tiers
name an entry alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from promptstore.codecs import Encoded, encode_layer, trim_floor
from promptstore.errors import CorruptEntry, PromptStoreError, UnknownStorageKind, UnsupportedVersion
from promptstore.remote import _wire
from promptstore.remote._client import Client
from promptstore.errors import RemoteCorrupt, RemoteError, RemoteMissing, RemoteUnavailable, RemoteURLError
from promptstore.remote._layout import NODE, Layout
from promptstore.remote._url import RemoteURL, parse_url

log = logging.getLogger("promptstore")

COOLDOWN = 5.0  # seconds a remote found unreachable is left alone
MAX_CANDIDATES = 4  # exact-prefix manifests read per round of a lookup
MANIFEST_ROUNDS = 4  # rounds of a lookup while index records name evicted manifests, or entries lost blocks


@dataclass(frozen=True)
class Key:
    """An entry or a query, named as the local store names it."""

    model: str
    mid: bytes  # model id
    ekey: bytes  # entry key of exactly these tokens
    tokens: np.ndarray  # uint32
    hashes: np.ndarray  # prefix hashes: hashes[i] of tokens[:i], i in 0..len


@dataclass(frozen=True)
class Found:
    """A remote entry usable for a query: its manifest, entry key and how many query tokens it covers."""

    ekey: bytes
    manifest: _wire.RManifest
    matched: int


class Remote:
    """One remote (a Redis server or cluster) under one namespace."""

    def __init__(self, url: Union[str, RemoteURL], cooldown: float = COOLDOWN):
        self.url = parse_url(url) if isinstance(url, str) else url
        self.layout = Layout(self.url.namespace)
        self.client = Client(self.url)
        self.cooldown = cooldown
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._logged: set = set()
        self._down_until = 0.0

    # -- bookkeeping -------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> Dict[str, int]:
        """Counters of this process: hits, misses, published, dropped, bytes
        fetched and published, blocks reused from the local tier, and errors
        by kind (``errors.unavailable``, ``errors.corrupt``, ``errors.missing``,
        ``errors.newer``, ``errors.full``, ``errors.refused``, ``errors.url``), ``skipped`` (calls not made while the remote cooled down)."""
        with self._lock:
            return dict(self._counts)

    def failed(self, op: str, err: Exception) -> None:
        """Count a failure of ``op`` under ``errors.<kind>`` and log its kind once;
        an unreachable remote is then left alone for ``cooldown`` seconds."""
        kind = "newer" if isinstance(err, (UnsupportedVersion, UnknownStorageKind)) else getattr(err, "kind", "corrupt")
        self.count(f"errors.{kind}")
        self.count("errors")
        if isinstance(err, (RemoteUnavailable, RemoteURLError)):
            self._down_until = time.monotonic() + self.cooldown
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:  # once per kind: a flapping remote must not flood the log
            log.warning("promptstore: remote %s: %s (counted in stats; further %s errors not logged)", op, err, kind)

    def available(self) -> bool:
        """False while cooling down after the remote was unreachable, and once closed."""
        if self.client.closed:
            return False
        if time.monotonic() < self._down_until:
            self.count("skipped")
            return False
        return True

    def close(self) -> None:
        self.client.close()

    # -- publishing ----------------------------------------------------------------

    def publish(self, key: Key, name: str, layers: Sequence[Encoded], trimmable: bool, meta: Dict[str, Any],
                created: float) -> int:
        """Write one entry: its missing blocks, then its manifest, then its index
        records (a reader never finds an index record before what it names).

        Returns:
            The block bytes sent (blocks the remote holds already are not sent).

        Raises:
            RemoteUnavailable: the remote failed; what was written is
                unreachable garbage at worst (blocks without a manifest),
                which Redis's eviction reclaims (under ``noeviction``
                nothing does: ``FLUSHDB`` or a new namespace).
            RemoteFull: the remote's memory is full under ``noeviction``.
            RemoteRefused: the remote refused the write otherwise (a
                read-only replica, ``MISCONF``, ``NOPERM``).
        """
        manifest, blocks = _wire.encode_entry(key.model, name, key.tokens, layers, trimmable, meta, created)
        addrs = list(blocks)
        keys = [self.layout.block(a) for a in addrs]
        held = self.client.exists(keys)
        new = [(k, blocks[a]) for k, a, h in zip(keys, addrs, held) if not h]
        self.client.set_new(new)
        self.client.set([(self.layout.manifest(key.ekey), manifest)])
        n = len(key.tokens)
        top = n // NODE
        value = f"{n}:{int(key.hashes[n]):016x}".encode()
        self.client.hset([(self.layout.ends(key.mid, int(key.hashes[top * NODE]), top), key.ekey.hex().encode(), value)])
        if trimmable and top >= 1:
            self.client.set([(self.layout.trims(key.mid, int(key.hashes[k * NODE]), k), key.ekey.hex().encode())
                             for k in range(1, top + 1)])
        sent = sum(len(v) for _, v in new)
        self.count("published")
        self.count("bytes_published", sent)
        self.count("blocks_held", len(addrs) - len(new))
        return sent

    # -- reading -------------------------------------------------------------------

    def find(self, key: Key, better_than: int = 0) -> Optional[Found]:
        """The remote entry covering the most tokens of ``key.tokens``, more
        than ``better_than``: one whose tokens are a prefix of the query, or
        a longer trimmable one sharing a longer prefix. None on a miss or
        any failure (counted)."""
        found = self.candidates(key, better_than)
        return found[0] if found else None

    def candidates(self, key: Key, better_than: int = 0) -> List[Found]:
        """The remote entries that could serve ``key.tokens`` beyond
        ``better_than`` tokens, their manifests read and checked, most tokens
        first: a fetch that fails (a block evicted) falls back to the next.
        Empty on a miss or any failure (counted). The first round of
        :meth:`rounds`."""
        return next(self.rounds(key, better_than), [])

    def rounds(self, key: Key, better_than: int = 0) -> Iterator[List[Found]]:
        """:meth:`candidates`, then, each time the caller asks for more, the
        next shorter ones (the next round of manifests read, at most
        ``MANIFEST_ROUNDS`` in all): for a caller whose fetches of every
        candidate failed (their blocks evicted). A failure ends them (counted)."""
        if not self.available():
            return
        found = self._find(key, better_than)
        while True:
            try:
                batch = next(found, None)
            except (RemoteError, CorruptEntry, UnsupportedVersion, UnknownStorageKind) as err:
                self.failed("lookup", err)
                return
            if batch is None:
                return
            yield batch

    def _find(self, key: Key, better_than: int) -> Iterator[List[Found]]:
        toks, h = key.tokens, key.hashes
        n_query = len(toks)
        nodes = list(range(n_query // NODE, better_than // NODE - 1, -1))
        ends = self._batch(self.client.hgetall, [self.layout.ends(key.mid, int(h[k * NODE]), k) for k in nodes], {},
                           "errors.corrupt_index")
        exact: List[Tuple[int, bytes]] = []
        for fields in ends:
            for field, value in fields.items():
                parsed = _end(field, value)
                if parsed is None:
                    self.count("errors.corrupt_index")
                    continue
                n, digest, ekey = parsed
                if better_than < n <= n_query and int(h[n]) == digest and ekey[:16] == key.mid:
                    exact.append((n, ekey))
        exact.sort(reverse=True)
        trim_nodes = [k for k in nodes if k >= 1]
        reps = self._batch(self.client.get, [self.layout.trims(key.mid, int(h[k * NODE]), k) for k in trim_nodes], None,
                           "errors.corrupt_index")
        rep = next((_ekey(r) for r in reps if r is not None and _ekey(r) is not None), None)
        # Manifests are read MAX_CANDIDATES at a time, longest first, until that
        # many are readable: index records are never removed, so those of
        # evicted entries must not hide the shorter entries still stored. What
        # was found is then yielded; asked for more (every fetch of it failed),
        # the next rounds are read.
        found: List[Found] = []
        pending = [e for _, e in exact]
        if rep is not None and rep not in pending:
            pending.insert(0, rep)
        for _ in range(MANIFEST_ROUNDS):
            wanted, pending = pending[:MAX_CANDIDATES], pending[MAX_CANDIDATES:]
            if not wanted:
                break
            readable = 0
            for ekey, raw in zip(wanted, self._batch(self.client.get, [self.layout.manifest(e) for e in wanted], b"")):
                if raw is None:  # evicted or deleted: the index record is stale
                    self.count("stale_index")
                    continue
                try:
                    man = _wire.decode_manifest(raw, f"remote entry {ekey.hex()[:16]}")
                except (RemoteCorrupt, UnsupportedVersion) as err:
                    self.failed("lookup", err)
                    continue
                readable += 1
                if man.model != key.model:
                    continue  # another identity under a colliding id: never restored
                m = _common(man.tokens, toks)
                usable = m if m == len(man.tokens) else (m if man.trimmable else 0)
                if usable < len(man.tokens) and trim_floor((layer.kind, layer.meta) for layer in man.layers) > usable:
                    usable = 0  # a chunked window past its first chunk: it no longer holds those tokens
                if usable > better_than:
                    # A prefix of a longer entry fetches only the blocks it needs.
                    found.append(Found(ekey, man.prefix(usable) or man, usable))
            if readable == len(wanted):
                yield sorted(found, key=lambda f: f.matched, reverse=True)
                found = []
        if found:
            yield sorted(found, key=lambda f: f.matched, reverse=True)

    def get(self, key: Key) -> Optional[Found]:
        """The remote entry of exactly ``key.tokens``, its manifest checked; None on a miss or failure."""
        if not self.available():
            return None
        try:
            raw = self.client.get([self.layout.manifest(key.ekey)])[0]
            if raw is None:
                return None
            man = _wire.decode_manifest(raw, f"remote entry {key.ekey.hex()[:16]}")
            if man.model != key.model or not np.array_equal(man.tokens, key.tokens):
                return None
            return Found(key.ekey, man, len(man.tokens))
        except (RemoteError, CorruptEntry, UnsupportedVersion, UnknownStorageKind) as err:
            self.failed("get", err)
            return None

    def fetch(self, found: Found, local: Optional[Dict[bytes, bytes]] = None) -> Optional[List[Any]]:
        """The cache of ``found``: its blocks (those not in ``local``, blocks
        the local tier gave, checked alike) fetched pipelined from every node,
        each checked against its address, decoded. None on failure (counted)."""
        if not self.available():
            return None
        local = local or {}
        try:
            need = {a: n for a, n in found.manifest.parts() if a not in local}
            keys = {a: self.layout.block(a) for a in need}
            # The blocks it lacks are read from the sockets straight into the
            # restored arrays (``Client.get_into``), each checked in place.
            # A restore staged through mlx's loader fills every array even after
            # one failed: after the first failure of this fetch, the others
            # fail at once instead of each waiting out the timeout again.
            failed: List[RemoteError] = []

            def once(call: Callable[[], Any]) -> Any:
                if failed:
                    raise failed[0]
                try:
                    return call()
                except RemoteError as err:
                    failed.append(err)
                    raise

            direct = _wire.Direct(
                frozenset(need),
                lambda addrs: once(lambda: self.client.exists([keys[a] for a in addrs])),
                lambda addrs, sinks: once(lambda: self.client.get_into([keys[a] for a in addrs], sinks)),
            )
            cache = _wire.assemble(found.manifest, local.get, f"remote entry {found.ekey.hex()[:16]}", direct)
        except (RemoteError, CorruptEntry, UnsupportedVersion, UnknownStorageKind) as err:
            self.failed("fetch", err)
            return None
        self.count("bytes_fetched", sum(need.values()))
        self.count("blocks_reused", len(found.manifest.parts()) - len(need))
        return cache

    def read_exact(self, key: Key) -> Optional[Tuple[Found, List[Any]]]:
        """The remote entry of exactly ``key.tokens``, fetched: ``(found,
        cache)``, or None (a miss, counted; failures counted by kind)."""
        found = self.get(key)
        cache = None if found is None else self.fetch(found)
        self.count("misses" if cache is None else "hits")
        return None if found is None or cache is None else (found, cache)

    def read_through(self, key: Key, better_than: int = 0, local_cache: Optional[Sequence[Any]] = None) -> Optional[Tuple[Found, List[Any]]]:
        """Find and fetch the best remote entry for ``key.tokens`` covering
        more than ``better_than`` tokens (the local tier's match, whose
        restored ``local_cache`` lends the blocks it shares): ``(found,
        cache)``, or None (a miss, counted; failures counted by kind)."""
        local = None
        for batch in self.rounds(key, better_than):
            for found in batch:
                if local is None:
                    local = {}
                    if local_cache is not None and better_than > 0:
                        local = local_blocks(local_cache, key.tokens[:better_than], key.model)
                cache = self.fetch(found, local)  # None: failed (counted)
                if cache is not None:
                    self.count("hits")
                    return found, cache
                if time.monotonic() < self._down_until:
                    break  # unreachable: the next candidate would wait out the same timeout
            else:
                continue  # every fetch of this round failed: the next round
            break
        self.count("misses")
        return None

    def _batch(self, read: Callable[[List[bytes]], List[Any]], keys: List[bytes], bad: Any, count: str = "") -> List[Any]:
        """``read(keys)``, pipelined; when the server refuses the batch for a key
        of another type (RemoteCorrupt), the keys one at a time, ``bad`` (and
        a ``count``) for each such key, so one damaged key hides no other.

        Raises:
            RemoteUnavailable
        """
        try:
            return read(keys)
        except RemoteCorrupt:
            out: List[Any] = []
            for k in keys:
                try:
                    out.extend(read([k]))
                except RemoteCorrupt:
                    out.append(bad)
                    if count:
                        self.count(count)
            return out

    def entries(self) -> Iterator[Tuple[bytes, _wire.RManifest]]:
        """Every readable manifest of the namespace (a scan: for ``ls --remote``).

        Raises:
            RemoteUnavailable
        """
        keys = list(self.client.scan(self.layout.manifest_pattern()))
        for i in range(0, len(keys), 256):
            batch = keys[i : i + 256]
            for k, raw in zip(batch, self._batch(self.client.get, batch, b"")):  # b"": corrupt when decoded
                if raw is None:  # evicted or deleted since the scan
                    self.count("stale_index")
                    continue
                try:
                    ekey = self.layout.ekey_of(k)
                    yield ekey, _wire.decode_manifest(raw, f"remote {k!r}")
                except (ValueError, RemoteError, CorruptEntry, UnsupportedVersion):
                    self.count("errors.corrupt")
                    continue


def local_blocks(cache: Sequence[Any], tokens: np.ndarray, model: str) -> Dict[bytes, bytes]:
    """Blocks of a cache the local tier restored, addressed as the remote
    addresses them: a fetch takes those the remote entry names from here
    (checked against their address like any other) instead of the network."""
    try:
        encoded = [encode_layer(layer) for layer in cache]
        _, blocks = _wire.encode_entry(model, "", tokens, encoded, False, {}, 0.0)
    except PromptStoreError:
        return {}
    return blocks


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _ekey(raw: Any) -> Optional[bytes]:
    try:
        ekey = bytes.fromhex(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return ekey if len(ekey) == 36 else None


def _end(field: Any, value: Any) -> Optional[Tuple[int, int, bytes]]:
    ekey = _ekey(field)
    try:
        n_s, digest_s = bytes(value).decode().split(":")
        n, digest = int(n_s), int(digest_s, 16)
    except (ValueError, UnicodeDecodeError):
        return None
    return None if ekey is None or n < 1 else (n, digest, ekey)
