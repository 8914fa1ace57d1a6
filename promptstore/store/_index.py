"""The prefix index: which stored entries can serve a query, best first.

Three LMDB tables, all keyed under the model id:

* ``nodes``: one record per ``BLOCK`` tokens of every entry (``k*BLOCK <= n``),
  key model id + hash of ``tokens[:k*BLOCK]`` + k, value the number of entries
  through it. Nodes are prefix-closed, so the deepest node a query reaches is
  found by binary search over k.
* ``ends`` (dupsort): under the node of an entry's last block, its length,
  prefix hash and key, sorted by length: the longest stored exact prefix of a
  query is one backwards cursor walk from the query's length.
* ``segs`` (dupsort, trimmable entries only): under every node of an entry,
  the entry's tokens of that block (big-endian u32, at most ``BLOCK``). Keys
  sort like token sequences, so within the query's deepest block the entry
  sharing the longest prefix with the query is a neighbour of the query's own
  segment: a longer entry is trimmed down to the true common prefix.

A query costs one vectorised hash pass, O(log(L/BLOCK)) node probes, a cursor
walk and two neighbour reads: it grows with the query, never with the number
of entries. Hashes only address; every candidate is checked token by token.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from promptstore.format._entry import Manifest
from promptstore.store import _keys
from promptstore.store._schema import ENDS, NODES, SEGS, U32, U64, Tables, end_value, node_key, parse_end

BLOCK = 64
_COUNT = U32

ManifestOf = Callable[[bytes], Optional[Manifest]]  # entry key -> Manifest or None (damaged/missing)


def _seg(tokens: np.ndarray, k: int) -> bytes:
    return np.ascontiguousarray(tokens[k * BLOCK : (k + 1) * BLOCK], dtype=">u4").tobytes()


def _count(raw) -> int:
    if raw is None:
        return 0
    raw = bytes(raw)
    return _COUNT.unpack(raw)[0] if len(raw) == 4 else 1  # damaged: keep the node, it only guides


def add(txn, dbs: Tables, mid: bytes, tokens: np.ndarray, hashes: np.ndarray, ekey: bytes, trimmable: bool) -> None:
    """Index an entry of ``tokens`` (``hashes = prefix_hashes(tokens)``)."""
    n = len(tokens)
    last = n // BLOCK
    for k in range(last + 1):
        nk = node_key(mid, hashes[k * BLOCK], k)
        txn.put(nk, _COUNT.pack(_count(txn.get(nk, db=dbs.nodes)) + 1), db=dbs.nodes)
        if trimmable:
            txn.put(nk + _seg(tokens, k), ekey, db=dbs.segs, dupdata=True)
    nk = node_key(mid, hashes[last * BLOCK], last)
    txn.put(nk, end_value(n, hashes[n], ekey), db=dbs.ends, dupdata=True)


def remove(txn, dbs: Tables, mid: bytes, tokens: np.ndarray, hashes: np.ndarray, ekey: bytes) -> None:
    """Undo :func:`add` for one entry."""
    n = len(tokens)
    last = n // BLOCK
    for k in range(last + 1):
        nk = node_key(mid, hashes[k * BLOCK], k)
        count = _count(txn.get(nk, db=dbs.nodes)) - 1
        if count <= 0:
            txn.delete(nk, db=dbs.nodes)
        else:
            txn.put(nk, _COUNT.pack(count), db=dbs.nodes)
        txn.delete(nk + _seg(tokens, k), ekey, db=dbs.segs)
    nk = node_key(mid, hashes[last * BLOCK], last)
    txn.delete(nk, end_value(n, hashes[n], ekey), db=dbs.ends)


def clear(txn, dbs) -> None:
    for name in (NODES, ENDS, SEGS):
        txn.drop(dbs[name], delete=False)


def _deepest(txn, dbs: Tables, mid: bytes, hashes: np.ndarray, L: int) -> int:
    """The deepest block k whose node exists for the query, or -1."""

    def has(k: int) -> bool:
        return txn.get(node_key(mid, hashes[k * BLOCK], k), db=dbs.nodes) is not None

    if not has(0):
        return -1
    lo, hi = 0, L // BLOCK
    while lo < hi:
        k = (lo + hi + 1) // 2
        if has(k):
            lo = k
        else:
            hi = k - 1
    return lo


def exact_prefixes(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray, deepest: int, manifest: ManifestOf) -> Iterator[Tuple[int, bytes, Manifest]]:
    """Stored entries that are exact prefixes of ``toks``, longest first.

    Per block, the ends stored under the query's node are either walked (few
    of them) or probed at each length the query could match there (at most
    ``BLOCK`` seeks): the cost is bounded by the query, not by how many
    entries share the prefix.
    """
    L = len(toks)
    cur = txn.cursor(db=dbs.ends)
    for k in range(deepest, -1, -1):
        nk = node_key(mid, hashes[k * BLOCK], k)
        if not cur.set_key(nk):
            continue
        top = min(L, (k + 1) * BLOCK - 1)
        if cur.count() <= top - k * BLOCK + 1:
            found = _walk_ends(cur, nk, hashes, L)
        else:
            found = _probe_ends(cur, nk, hashes, k * BLOCK, top)
        for n, ekey in found:
            man = manifest(ekey)
            if man is not None and len(man.tokens) == n and np.array_equal(man.tokens, toks[:n]):
                yield n, ekey, man


def _walk_ends(cur, nk: bytes, hashes: np.ndarray, L: int) -> Iterator[Tuple[int, bytes]]:
    """Every end under ``nk`` whose length and prefix hash fit the query, longest first."""
    more = cur.prev_dup() if cur.set_range_dup(nk, U32.pack(L + 1)) else cur.last_dup()
    while more:
        n, h, ekey = parse_end(bytes(cur.value()))
        if n <= L and h == int(hashes[n]):
            yield n, ekey
        more = cur.prev_dup()


def _probe_ends(cur, nk: bytes, hashes: np.ndarray, lo: int, hi: int) -> Iterator[Tuple[int, bytes]]:
    """The ends under ``nk`` at exactly ``(n, hashes[n])`` for n from ``hi`` down to ``lo``."""
    for n in range(hi, lo - 1, -1):
        probe = U32.pack(n) + U64.pack(int(hashes[n]))
        ok = cur.set_range_dup(nk, probe)
        while ok:
            value = bytes(cur.value())
            if value[:12] != probe:
                break
            yield n, value[12:]
            ok = cur.next_dup()


def best_trim(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray, deepest: int, manifest: ManifestOf) -> Optional[Tuple[int, bytes, Manifest]]:
    """The trimmable entry sharing the longest prefix with ``toks``: ``(common, key, manifest)``.

    From the deepest node down, the first node that holds trimmable segments
    has the answer among the two neighbours of the query's own segment: every
    trimmable entry through a deeper node would have been found there.
    """
    cur = txn.cursor(db=dbs.segs)
    for k in range(deepest, -1, -1):
        nk = node_key(mid, hashes[k * BLOCK], k)
        found = False
        best = None
        for ekey in _neighbours(cur, nk, nk + _seg(toks, k)):
            found = True
            man = manifest(ekey)
            if man is None or not man.trimmable:
                continue
            m = min(len(man.tokens), len(toks))
            same = man.tokens[:m] == toks[:m]
            common = m if same.all() else int(np.argmin(same))
            if best is None or common > best[0]:
                best = (common, ekey, man)
        if found:
            return best
    return None


def _neighbours(cur, nk: bytes, query: bytes) -> Iterator[bytes]:
    """Entry keys of the segments under ``nk`` just after and just before ``query``."""
    if cur.set_range(query):
        if bytes(cur.key()).startswith(nk):
            yield bytes(cur.value())
        if cur.prev() and bytes(cur.key()).startswith(nk):
            yield bytes(cur.value())
    elif cur.last() and bytes(cur.key()).startswith(nk):
        yield bytes(cur.value())


def exact(txn, dbs: Tables, mid: bytes, toks: np.ndarray, manifest: ManifestOf) -> Iterator[Tuple[int, bytes, Manifest]]:
    """Stored entries that are exact prefixes of ``toks`` (``toks`` included), longest first."""
    hashes = _keys.prefix_hashes(toks)
    deepest = _deepest(txn, dbs, mid, hashes, len(toks))
    if deepest >= 0:
        yield from exact_prefixes(txn, dbs, mid, toks, hashes, deepest, manifest)


def candidates(txn, dbs: Tables, mid: bytes, toks: np.ndarray, manifest: ManifestOf) -> Iterator[Tuple[bytes, int, Manifest]]:
    """Usable entries best first: ``(entry key, tokens usable, manifest)``.

    The longest exact prefix, unless a trimmable entry shares more with the
    query; then the shorter exact prefixes, should the better ones be damaged.
    """
    hashes = _keys.prefix_hashes(toks)
    deepest = _deepest(txn, dbs, mid, hashes, len(toks))
    if deepest < 0:
        return
    exact = exact_prefixes(txn, dbs, mid, toks, hashes, deepest, manifest)
    first = next(exact, None)
    trim = best_trim(txn, dbs, mid, toks, hashes, deepest, manifest)
    if trim is not None and trim[0] > (first[0] if first else 0):
        yield trim[1], trim[0], trim[2]
    if first is not None:
        yield first[1], first[0], first[2]
        for n, ekey, man in exact:
            yield ekey, n, man
