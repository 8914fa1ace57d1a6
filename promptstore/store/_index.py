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
  has. Keys sort like token sequences, so within a block of the query the
  segments sharing the longest prefix with the query are the neighbours of
  the query's own segment, and the further from it, the less they share;
  following first segments down from one reaches a trimmable entry that
  shares that prefix, to be trimmed, and walking on reaches the others.

A query costs one vectorised hash pass, O(log(L/BLOCK)) node probes, a cursor
walk and two neighbour reads (plus one read per block below the branch point
when a trimmed entry is best): it grows with the query, never with the number
of entries. Should the best candidates fail (damaged, or a chunked window that
cannot be trimmed so far), the next ones are read on demand, at most
``TRIM_READS`` trimmable ones. Hashes only address; every candidate is
checked token by token.

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
TRIM_READS = 16  # trimmable entries' manifests one query reads at most
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


def trimmed(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray, deepest: int,
            manifest: ManifestOf) -> Iterator[Tuple[int, Optional[bytes], Optional[Manifest]]]:
    """Trimmable entries that share a prefix with ``toks`` but are not
    prefixes of it (:func:`exact_prefixes` finds those), most tokens shared
    first: ``(common, key, manifest)``. Before the entries of each node and
    of each of its segments, a bound ``(most, None, None)``: no entry after
    it shares more than ``most`` tokens, so a caller that has a candidate as
    good stops there, before anything below is read.

    From the deepest node up, every entry through node k shares ``k*BLOCK``
    tokens with the query and what its segment there shares with the
    query's: in key order, segments share less the further they lie from
    the query's own, so both directions from it are merged. Below a
    segment, its entries follow in key order (an entry before those that
    continue it). A segment that is the query's own full block leads to the
    nodes already walked; one that ends inside the query's block ends exact
    prefixes: both passed over unread. An entry that does not carry the
    query's ``k*BLOCK`` tokens (node k reached by a collision of the prefix
    hash) is passed over. At most ``TRIM_READS`` manifests are read (or index
    dead ends met): the cost stays bounded by the query however many entries
    share a prefix with it and fail.
    """
    if TRIMS not in dbs:
        best = _best_trim_segs(txn, dbs, mid, toks, hashes, deepest, manifest)
        if best is not None and 0 < best[0] < len(best[2].tokens):
            yield best
        return
    right, left, down, ends = (txn.cursor(db=db) for db in (dbs.trims, dbs.trims, dbs.trims, dbs.ends))
    reads = 0
    for k in range(deepest, -1, -1):
        yield min(len(toks), (k + 1) * BLOCK - 1), None, None
        nk = node_key(mid, hashes[k * BLOCK], k)
        q = _seg(toks, k)
        for seg, c in _by_common(right, left, nk, q):
            if k * BLOCK + c == 0:
                return  # nothing shared, from here on
            if c == len(seg) // 4:
                continue
            yield k * BLOCK + c, None, None
            for ekey, man in _below(down, ends, mid, toks[: k * BLOCK], int(hashes[k * BLOCK]), k, seg, manifest):
                if man is not None:
                    yield k * BLOCK + c, ekey, man
                reads += 1
                if reads >= TRIM_READS:
                    return


def _common(a: bytes, b: bytes) -> int:
    """Tokens two segments share from their start."""
    n = min(len(a), len(b)) // 4
    x = np.frombuffer(a[: 4 * n], dtype=">u4") == np.frombuffer(b[: 4 * n], dtype=">u4")
    return n if x.all() else int(np.argmin(x))


def _by_common(right, left, nk: bytes, q: bytes) -> Iterator[Tuple[bytes, int]]:
    """The segments under ``nk``, each with the tokens it shares with ``q``,
    most first (ties: the one after ``q`` first): walked out from ``q``'s
    place in both directions."""

    def seg(cur, ok: bool) -> Optional[bytes]:
        key = bytes(cur.key()) if ok else b""
        return key[len(nk) :] if key.startswith(nk) else None

    if right.set_range(nk + q):
        after = seg(right, True)
        before = seg(left, left.set_range(nk + q) and left.prev())
    else:
        after, before = None, seg(left, left.last())
    while after is not None or before is not None:
        a = _common(after, q) if after is not None else -1
        b = _common(before, q) if before is not None else -1
        if after is not None and a >= b:
            yield after, a
            after = seg(right, right.next())
        elif before is not None:
            yield before, b
            before = seg(left, left.prev())


def _below(cur, ends, mid: bytes, prefix: np.ndarray, h: int, k: int, seg: bytes,
           manifest: ManifestOf) -> Iterator[Tuple[Optional[bytes], Optional[Manifest]]]:
    """The trimmable entries whose tokens continue ``prefix`` (``k*BLOCK``
    tokens, hash ``h``) with segment ``seg``, in key order: ``(key,
    manifest)`` for each manifest read, the manifest None when it is not
    such an entry; ``(None, None)`` where the index leads nowhere (it is
    inconsistent there: ``verify --fix`` rebuilds it)."""
    nks, segs, hs = [node_key(mid, h, k)], [seg], [h]
    while True:
        block = np.frombuffer(segs[-1], dtype=">u4").astype(np.uint32)
        after = _keys.extend_hash(hs[-1], block)
        if len(block) < BLOCK:  # an entry ends here
            n = (k + len(segs) - 1) * BLOCK + len(block)
            tokens = np.concatenate([prefix] + [np.frombuffer(s, dtype=">u4") for s in segs]).astype(np.uint32)
            found = False
            for ekey in _ends_at(ends, nks[-1], n, after):
                found = True
                man = manifest(ekey)
                ok = man is not None and man.trimmable and len(man.tokens) == n and np.array_equal(man.tokens, tokens)
                yield ekey, man if ok else None
            if not found:
                yield None, None
        else:
            child = node_key(mid, after, k + len(segs))
            if cur.set_range(child) and bytes(cur.key()).startswith(child):
                nks.append(child)
                segs.append(bytes(cur.key())[len(child) :])
                hs.append(after)
                continue
            yield None, None
        # On to the next segment of this node, else of a node above (not above the first).
        while len(segs) > 1:
            if cur.set_range(nks[-1] + segs[-1]) and cur.next() and bytes(cur.key()).startswith(nks[-1]):
                segs[-1] = bytes(cur.key())[len(nks[-1]) :]
                break
            nks.pop()
            segs.pop()
            hs.pop()
        else:
            return


def _ends_at(ends, nk: bytes, n: int, h: int) -> Iterator[bytes]:
    """The keys of the entries of ``n`` tokens of prefix hash ``h`` ending under node ``nk``."""
    probe = U32.pack(n) + U64.pack(h)
    ok = ends.set_range_dup(nk, probe)
    while ok:
        value = bytes(ends.value())
        if value[:12] != probe:
            break
        yield value[12:]
        ok = ends.next_dup()


def _best_trim_segs(txn, dbs: Tables, mid: bytes, toks: np.ndarray, hashes: np.ndarray, deepest: int, manifest: ManifestOf) -> Optional[Tuple[int, bytes, Manifest]]:
    """The best of :func:`trimmed` over a store-format-1 index (``segs``: one record
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

    Exact prefixes and trimmable entries merged by the tokens they share
    with the query (an exact prefix first among equals: nothing to trim),
    each read only when the caller asks for the next, should the better
    ones be damaged or unable to serve.
    ``hashes``: ``prefix_hashes(toks)``, when the caller has them.
    """
    if hashes is None:
        hashes = _keys.prefix_hashes(toks)
    deepest = _deepest(txn, dbs, mid, hashes, len(toks))
    if deepest < 0:
        return
    exact = exact_prefixes(txn, dbs, mid, toks, hashes, deepest, manifest)
    trims = trimmed(txn, dbs, mid, toks, hashes, deepest, manifest)
    e, t = next(exact, None), next(trims, None)
    while e is not None or t is not None:
        if t is not None and (e is None or t[0] > e[0]):
            common, ekey, man = t
            if ekey is not None and man is not None:  # else a bound: read on
                yield ekey, common, man
            t = next(trims, None)
        elif e is not None:
            yield e[1], e[0], e[2]
            e = next(exact, None)
