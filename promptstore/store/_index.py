"""The prefix index: which stored entries can serve a query, best first.

Three LMDB tables, all keyed under the model id, kept as tries over blocks
of ``BLOCK`` tokens, so that indexing an entry writes records only for the
blocks no stored entry has already indexed (and one count), however long
the entry is: a conversation stored turn by turn costs the index what the
turn added, not what the conversation holds.

* ``nodes``: one record per ``BLOCK``-token prefix of every entry
  (``k*BLOCK <= n``), key model id + hash of ``tokens[:k*BLOCK]`` + k, value
  how many child nodes and entry ends it has (a node goes with its last).
  Nodes are prefix-closed, so the deepest node a query reaches is found by
  binary search over k.
* ``ends`` (dupsort): under the node of an entry's last block, its length,
  prefix hash and key, sorted by length: the longest stored exact prefix of a
  query is one backwards cursor walk from the query's length.
* ``trims`` (trimmable entries only): under node k, each distinct block of
  tokens (big-endian u32, at most ``BLOCK``) that trimmable entries through
  the node continue with, value how many child segments and entry ends it
  has. Keys sort like token sequences, so within the query's deepest block
  the segment sharing the longest prefix with the query is a neighbour of
  the query's own segment; following first segments down from it reaches a
  trimmable entry that shares that prefix, to be trimmed.

A query costs one vectorised hash pass, O(log(L/BLOCK)) node probes, a cursor
walk and two neighbour reads (plus one read per block below the branch point
when a trimmed entry is best): it grows with the query, never with the number
of entries. Hashes only address; every candidate is checked token by token.

Stores written before ``trims`` (store format 1) kept, in ``segs``, one
record per block of every trimmable entry naming it; opened read-only they
are searched that way (:func:`_best_trim_segs`), and a writer rebuilds
their index once (see ``Env.check_format``).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from promptstore.format._entry import Manifest
from promptstore.store import _keys
from promptstore.store._schema import ENDS, NODES, SEGS, TRIMS, U32, U64, Tables, end_value, node_key, parse_end

BLOCK = 64
_COUNT = U32

ManifestOf = Callable[[bytes], Optional[Manifest]]  # entry key -> Manifest or None (damaged/missing)


def _seg(tokens: np.ndarray, k: int) -> bytes:
    return np.ascontiguousarray(tokens[k * BLOCK : (k + 1) * BLOCK], dtype=">u4").tobytes()


def _count(raw) -> int:
    if raw is None:
        return 0
    raw = bytes(raw)
    return _COUNT.unpack(raw)[0] if len(raw) == 4 else 1  # damaged: keep the record, it only guides


def _link(txn, db, keys: list) -> None:
    """Count one more end at ``keys[-1]``, the last of a chain of trie
    records from the root (``keys[0]``): records the chain lacks are
    created, from the deepest one the store has, which counts them as one
    new child (or, when the whole chain is there, one more end)."""
    for key in reversed(keys):
        raw = txn.get(key, db=db)
        if raw is not None:
            txn.put(key, _COUNT.pack(_count(raw) + 1), db=db)
            return
        txn.put(key, _COUNT.pack(1), db=db)


def _unlink(txn, db, keys: list) -> None:
    """Undo :func:`_link`: one end fewer at ``keys[-1]``; a record left with
    no child and no end goes, and counts one child fewer in its parent."""
    for key in reversed(keys):
        count = _count(txn.get(key, db=db)) - 1
        if count > 0:
            txn.put(key, _COUNT.pack(count), db=db)
            return
        txn.delete(key, db=db)


def _chain(mid: bytes, tokens: np.ndarray, hashes: np.ndarray, trims: bool) -> list:
    last = len(tokens) // BLOCK
    keys = [node_key(mid, hashes[k * BLOCK], k) for k in range(last + 1)]
    return [nk + _seg(tokens, k) for k, nk in enumerate(keys)] if trims else keys


def add(txn, dbs: Tables, mid: bytes, tokens: np.ndarray, hashes: np.ndarray, ekey: bytes, trimmable: bool) -> None:
    """Index an entry of ``tokens`` (``hashes = prefix_hashes(tokens)``)."""
    n = len(tokens)
    _link(txn, dbs.nodes, _chain(mid, tokens, hashes, False))
    if trimmable:
        _link(txn, dbs.trims, _chain(mid, tokens, hashes, True))
    last = n // BLOCK
    txn.put(node_key(mid, hashes[last * BLOCK], last), end_value(n, hashes[n], ekey), db=dbs.ends, dupdata=True)


def remove(txn, dbs: Tables, mid: bytes, tokens: np.ndarray, hashes: np.ndarray, ekey: bytes, trimmable: bool) -> None:
    """Undo :func:`add` for one entry."""
    n = len(tokens)
    _unlink(txn, dbs.nodes, _chain(mid, tokens, hashes, False))
    if trimmable:
        _unlink(txn, dbs.trims, _chain(mid, tokens, hashes, True))
    last = n // BLOCK
    txn.delete(node_key(mid, hashes[last * BLOCK], last), end_value(n, hashes[n], ekey), db=dbs.ends)


def clear(txn, dbs) -> None:
    for name in (NODES, ENDS, SEGS, TRIMS):
        if name in dbs:
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
    trimmable entry through a deeper node would have been found there. A node
    whose candidates turn out not to share its prefix with the query (a hash
    collision) is passed over.
    """
    if TRIMS not in dbs:
        return _best_trim_segs(txn, dbs, mid, toks, hashes, deepest, manifest)
    cur = txn.cursor(db=dbs.trims)
    for k in range(deepest, -1, -1):
        nk = node_key(mid, hashes[k * BLOCK], k)
        q = _seg(toks, k)
        segs = [seg for seg in _neighbour_keys(cur, nk, nk + q)]
        if not segs:
            continue
        best = None
        for seg in sorted(segs, key=lambda seg: -_common(seg, q)):
            found = _descend(txn, dbs, cur, mid, toks[: k * BLOCK], int(hashes[k * BLOCK]), k, seg, manifest)
            if found is None:
                continue
            man, ekey = found
            m = min(len(man.tokens), len(toks))
            same = man.tokens[:m] == toks[:m]
            common = m if same.all() else int(np.argmin(same))
            if best is None or common > best[0]:
                best = (common, ekey, man)
        if best is not None and best[0] >= k * BLOCK:
            return best
        # Node k's entries do not share its k*BLOCK tokens with the query: the
        # query reached it by a collision of the prefix hash (crafted input
        # does it). Go on to the nodes above, where a real match may be.
    return None


def _common(a: bytes, b: bytes) -> int:
    """Tokens two segments share from their start."""
    n = min(len(a), len(b)) // 4
    x = np.frombuffer(a[: 4 * n], dtype=">u4") == np.frombuffer(b[: 4 * n], dtype=">u4")
    return n if x.all() else int(np.argmin(x))


def _neighbour_keys(cur, nk: bytes, query: bytes) -> Iterator[bytes]:
    """The segments under ``nk`` just after and just before ``query``."""
    if cur.set_range(query):
        if bytes(cur.key()).startswith(nk):
            yield bytes(cur.key())[len(nk) :]
        if cur.prev() and bytes(cur.key()).startswith(nk):
            yield bytes(cur.key())[len(nk) :]
    elif cur.last() and bytes(cur.key()).startswith(nk):
        yield bytes(cur.key())[len(nk) :]


def _descend(txn, dbs: Tables, cur, mid: bytes, prefix: np.ndarray, h: int, k: int, seg: bytes, manifest: ManifestOf) -> Optional[Tuple[Manifest, bytes]]:
    """A trimmable entry whose tokens continue ``prefix`` (``k*BLOCK`` tokens,
    hash ``h``) with segment ``seg``: follow the first segment of each node
    down to one that ends an entry."""
    parts = [prefix]
    n = len(prefix)
    nk = node_key(mid, h, k)
    while True:
        block = np.frombuffer(seg, dtype=">u4").astype(np.uint32)
        parts.append(block)
        h = _keys.extend_hash(h, block)
        n += len(block)
        if len(block) < BLOCK:
            break
        k += 1
        nk = node_key(mid, h, k)
        if not (cur.set_range(nk) and bytes(cur.key()).startswith(nk)):
            return None  # the index is inconsistent here (verify --fix rebuilds it)
        seg = bytes(cur.key())[len(nk) :]
    tokens = np.concatenate(parts)
    ends = txn.cursor(db=dbs.ends)
    probe = U32.pack(n) + U64.pack(h)
    ok = ends.set_range_dup(nk, probe)
    while ok:
        value = bytes(ends.value())
        if value[:12] != probe:
            break
        ekey = value[12:]
        man = manifest(ekey)
        if man is not None and man.trimmable and len(man.tokens) == n and np.array_equal(man.tokens, tokens):
            return man, ekey
        ok = ends.next_dup()
    return None


def _best_trim_segs(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray, deepest: int, manifest: ManifestOf) -> Optional[Tuple[int, bytes, Manifest]]:
    """:func:`best_trim` over a store-format-1 index (``segs``: one record
    per block of each trimmable entry, naming it), opened read-only."""
    if SEGS not in dbs:
        return None
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
    """Entry keys of the format-1 segments under ``nk`` just after and just before ``query``."""
    if cur.set_range(query):
        if bytes(cur.key()).startswith(nk):
            yield bytes(cur.value())
        if cur.prev() and bytes(cur.key()).startswith(nk):
            yield bytes(cur.value())
    elif cur.last() and bytes(cur.key()).startswith(nk):
        yield bytes(cur.value())


def indexed_prefix(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray) -> int:
    """The longest prefix of ``toks`` (``hashes = prefix_hashes(toks)``), in
    whole ``BLOCK``s, that a stored entry of model ``mid`` starts with (0:
    none): the deepest node the query reaches. Nodes only count entries, so
    which entry is not known, and the hash is trusted (a collision only
    misplaces a block bound)."""
    return max(0, _deepest(txn, dbs, mid, hashes, len(toks))) * BLOCK


def exact(txn, dbs: Tables, mid: bytes, toks: np.ndarray, manifest: ManifestOf) -> Iterator[Tuple[int, bytes, Manifest]]:
    """Stored entries that are exact prefixes of ``toks`` (``toks`` included), longest first."""
    hashes = _keys.prefix_hashes(toks)
    deepest = _deepest(txn, dbs, mid, hashes, len(toks))
    if deepest >= 0:
        yield from exact_prefixes(txn, dbs, mid, toks, hashes, deepest, manifest)


def candidates(txn, dbs: Tables, mid: bytes, toks: np.ndarray, manifest: ManifestOf,
               hashes: Optional[np.ndarray] = None) -> Iterator[Tuple[bytes, int, Manifest]]:
    """Usable entries best first: ``(entry key, tokens usable, manifest)``.

    The longest exact prefix, unless a trimmable entry shares more with the
    query; then the shorter exact prefixes, should the better ones be damaged.
    ``hashes``: ``prefix_hashes(toks)``, when the caller has them.
    """
    if hashes is None:
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
