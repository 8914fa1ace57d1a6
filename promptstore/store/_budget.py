"""Capacity: the byte budget, entry sizes, pins and LRU eviction.

Everything here runs inside a write transaction of the store, so a put and
the evictions it causes commit together: no process ever sees the store over
budget by more than the entry being written.

Tables (in the store's LMDB environment):

* ``info[budget]``  u64 byte budget; absent means unlimited.
* ``info[usage]``   u64 running sum of ``sizes`` plus every shared block once.
* ``sizes[ekey]``      u64 bytes an entry accounts for itself: payload + manifest.
* ``refs[address]``    u64 reference count + u64 size of a shared block.
* ``pins[ekey]``       present when the entry is pinned (never evicted).
* ``used[ekey]``       f64 last use (written by the store; reads are recorded
  in memory and flushed in the next write transaction, within
  ``_usage.FLUSH_EVERY`` seconds, or on close).
* ``lru[used + ekey]`` the same, ordered: eviction walks it from the oldest,
  so its cost grows with what it evicts (and the pinned entries it passes),
  not with the number of entries.

An entry's size is what it adds to the data: its payload plus its manifest.
LMDB's own page overhead and free pages are not counted; the data file may be
larger than the budget until ``compact`` (the file never shrinks by itself).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from promptstore.errors import InvalidInput, PromptStoreError, StoreFull
from promptstore.format._entry import unpack_manifest
from promptstore.store._keys import entry_id
from promptstore.store._schema import BUDGET_KEY, F64, LRU, PINS, REFS, SIZES, U64, USAGE_KEY, Tables, f64_or, u64_or

Unlink = Callable[[Any, bytes, Optional[bytes]], bool]  # False: the entry's manifest could not be read, its blocks stay counted


MAX_BUDGET = (1 << 64) - 1  # what ``info[budget]`` (u64) holds


def check_budget(budget) -> Optional[int]:
    """``budget`` when it is None or a byte count the store can hold.

    Raises:
        InvalidInput: anything else.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_BUDGET:
        # repr() of a huge int itself fails (Python's int-to-str digit limit)
        got = f"an int of {budget.bit_length()} bits" if isinstance(budget, int) and budget.bit_length() > 256 else repr(budget)
        raise InvalidInput(f"budget must be a byte count from 0 to {MAX_BUDGET} (2**64 - 1), or None; got {got}")
    return budget


def get_budget(txn, db: Tables) -> Optional[int]:
    raw = txn.get(BUDGET_KEY, db=db.info)
    return u64_or(raw) if raw is not None else None


def usage(txn, db: Tables) -> int:
    return u64_or(txn.get(USAGE_KEY, db=db.info))


def _set_usage(txn, db: Tables, n: int) -> None:
    txn.put(USAGE_KEY, U64.pack(max(0, n)), db=db.info)


def size_of(txn, db: Tables, ekey: bytes) -> int:
    return u64_or(txn.get(ekey, db=db.sizes))


def is_pinned(txn, db: Tables, ekey: bytes) -> bool:
    return txn.get(ekey, db=db.pins) is not None


def pinned_bytes(txn, db: Tables, also: bytes = b"", also_blocks: Optional[Dict[bytes, int]] = None) -> int:
    """Bytes the pinned entries (and ``also``, an entry about to be pinned)
    hold: their own sizes plus every shared block they reference, once.
    ``also_blocks``: the blocks ``also`` references (address -> bytes) when
    its manifest is not written yet."""
    keys = {bytes(k) for k in txn.cursor(db=db.pins).iternext(keys=True, values=False)}
    if also:
        keys.add(also)
    total = 0
    blocks: Dict[bytes, int] = dict(also_blocks or {})
    for k in keys:
        total += size_of(txn, db, k)
        raw = txn.get(k, db=db.entries)
        try:
            man = unpack_manifest(bytes(raw), entry_id(k)) if raw is not None else None
        except PromptStoreError:
            continue  # unreadable: its blocks are not known (verify reports it)
        for key, size in man.blocks() if man is not None else ():
            blocks[key] = size
    return total + sum(blocks.values())


def set_used(txn, db: Tables, ekey: bytes, used: bytes) -> None:
    """Record an entry's last use (``used``: f64 bytes), in ``used`` and in the ``lru`` order."""
    drop_used(txn, db, ekey)
    txn.put(ekey, used, db=db.used)
    txn.put(_lru_key(used, ekey), b"", db=db.lru)


def drop_used(txn, db: Tables, ekey: bytes) -> None:
    old = txn.get(ekey, db=db.used)
    if old is not None:
        txn.delete(_lru_key(bytes(old), ekey), db=db.lru)
        txn.delete(ekey, db=db.used)


def _lru_key(used: bytes, ekey: bytes) -> bytes:
    # Big-endian IEEE doubles >= 0 sort as their values; a damaged or negative one sorts first.
    t = f64_or(used, 0.0)
    return F64.pack(t if t >= 0.0 else 0.0) + ekey


def oldest_first(txn, db: Tables) -> Iterator[bytes]:
    """Entry keys, least recently used first: the ``lru`` order; in a store
    older than that table (format 1 or 2, opened read-only, so not
    upgraded), the same order built from ``used`` as the upgrade builds it."""
    if LRU in db:
        return (bytes(k)[F64.size :] for k in txn.cursor(db=db.lru).iternext(keys=True, values=False))
    order = []
    for k in txn.cursor(db=db.entries).iternext(keys=True, values=False):
        used = txn.get(bytes(k), db=db.used)
        order.append(_lru_key(bytes(used) if used is not None else F64.pack(0.0), bytes(k)))
    return (k[F64.size :] for k in sorted(order))


def rebuild_lru(txn, db: Tables) -> None:
    """Rebuild the ``lru`` order from ``used``; an entry without a last use counts as oldest."""
    txn.drop(db.lru, delete=False)
    for k, raw in txn.cursor(db=db.entries):
        k = bytes(k)
        used = txn.get(k, db=db.used)
        if used is None:
            used = F64.pack(0.0)
            txn.put(k, used, db=db.used)
        txn.put(_lru_key(bytes(used), k), b"", db=db.lru)


def forget(txn, db: Tables, ekey: bytes) -> None:
    """Drop an entry's size from the accounting (it is being unlinked)."""
    raw = txn.get(ekey, db=db.sizes)
    if raw is not None:
        _set_usage(txn, db, usage(txn, db) - u64_or(raw))
        txn.delete(ekey, db=db.sizes)


def set_budget(txn, db: Tables, budget: Optional[int]) -> None:
    """Remember ``budget`` (None: no budget) in the store."""
    if budget is None:
        txn.delete(BUDGET_KEY, db=db.info)
    else:
        txn.put(BUDGET_KEY, U64.pack(budget), db=db.info)


def account(txn, db: Tables, ekey: bytes, size: int) -> None:
    """Count an entry of ``size`` bytes (replacing what it counted before)."""
    forget(txn, db, ekey)
    txn.put(ekey, U64.pack(size), db=db.sizes)
    _set_usage(txn, db, usage(txn, db) + size)


def admit(
    txn, db: Tables, ekey: bytes, size: int, unlink: Unlink, where: str, freed: Optional[Freed] = None, footprint: int = 0,
    pinned: Optional[Dict[bytes, int]] = None,
) -> Tuple[List[bytes], bool]:
    """Account a new entry of ``size`` bytes of its own and evict LRU entries
    until usage fits the budget. ``footprint``: what the entry needs stored
    alone, its shared blocks included. ``pinned``: the entry stays pinned (it
    replaces a pinned one), with these shared blocks (address -> bytes).
    Returns what :func:`evict` returns.

    Raises:
        StoreFull: the entry alone is larger than the budget, or, pinned, it
            would make the pinned entries take more than the budget (nothing
            is written).
    """
    budget = get_budget(txn, db)
    need = max(size, footprint)
    if budget is not None and need > budget:
        raise StoreFull(
            f"{where}: an entry of {need} bytes cannot fit the store's budget of {budget} bytes; "
            "raise it with `promptstore gc --budget BYTES` or store a shorter prompt"
        )
    account(txn, db, ekey, size)
    if budget is None:
        return [], False
    if pinned is not None:
        total = pinned_bytes(txn, db, also=ekey, also_blocks=pinned)
        if total > budget:
            raise StoreFull(
                f"{where}: this put replaces a pinned entry, and pinned entries would then take {total} bytes, "
                f"more than the budget of {budget}; unpin it first or raise the budget (`promptstore gc --budget BYTES`)"
            )
    return evict(txn, db, budget, {ekey}, unlink, freed)


def add_usage(txn, db: Tables, delta: int) -> None:
    """Count ``delta`` more (or, negative, fewer) stored bytes: shared blocks."""
    _set_usage(txn, db, usage(txn, db) + delta)


class Release:
    """What evicting entries frees, their shared blocks included: a block
    counts with the last of its referrers removed. Calling it with an entry
    key plans that entry's removal after those planned before and returns
    what it frees; :meth:`loss` and :meth:`spare` take one back.

    ``blocks(ekey)``: the block addresses the entry's manifest references,
    once per reference (none when it cannot be read: only its own size is
    counted as freed, and its blocks are freed, if at all, only when the
    gc or put that evicts it recounts them: ``EntryWriter.recount``).
    """

    def __init__(self, txn, db: Tables, blocks: Callable[[bytes], Sequence[bytes]]):
        self._txn = txn
        self._db = db
        self._blocks = blocks
        self._of: Dict[bytes, Sequence[bytes]] = {}
        self._dropped: Dict[bytes, int] = {}
        self.held = False  # an entry planned left a block held (by an entry planned later, or one kept)

    def _refs(self, ekey: bytes) -> Sequence[bytes]:
        if ekey not in self._of:
            self._of[ekey] = self._blocks(ekey)
        return self._of[ekey]

    def __call__(self, ekey: bytes) -> int:
        total = size_of(self._txn, self._db, ekey)
        for key in self._refs(ekey):
            self._dropped[key] = self._dropped.get(key, 0) + 1
            ref = self._txn.get(key, db=self._db.refs)
            if ref_count(ref) == self._dropped[key]:
                total += ref_size(ref)
            else:
                self.held = True
        return total

    def loss(self, ekey: bytes) -> int:
        """What keeping a planned entry after all would leave stored: its own
        size and the blocks its removal was the last to free."""
        total = size_of(self._txn, self._db, ekey)
        for key in set(self._refs(ekey)):
            ref = self._txn.get(key, db=self._db.refs)
            if ref_count(ref) == self._dropped.get(key, 0):
                total += ref_size(ref)
        return total

    def spare(self, ekey: bytes) -> None:
        """Take a planned entry back out of the plan."""
        for key in self._refs(ekey):
            self._dropped[key] -= 1

    def replay(self, ekeys: Sequence[bytes]) -> List[int]:
        """Plan exactly ``ekeys``, in order, from nothing: what each frees."""
        self._dropped = {}
        return [self(k) for k in ekeys]


Freed = Callable[[bytes], int]  # entry key -> bytes its removal frees (given the removals before it)


def plan(txn, db: Tables, budget: int, keep: Set[bytes], freed: Union[None, Freed, Release] = None) -> Tuple[List[Tuple[bytes, int]], int]:
    """Entries to evict to reach ``budget``, least recently used first, and
    the usage after evicting them. Pinned entries and ``keep`` are spared.

    ``freed(ekey)`` says what removing an entry frees, its shared blocks
    included, after the entries planned before it (without it: the entry's
    own size)."""
    now = usage(txn, db)
    if now <= budget:
        return [], now
    victims = []
    for k in oldest_first(txn, db):
        if now <= budget:
            break
        if k in keep or is_pinned(txn, db, k):
            continue
        gain = freed(k) if freed is not None else size_of(txn, db, k)
        victims.append((k, gain))
        now -= gain
    if isinstance(freed, Release) and freed.held and len(victims) > 1 and now <= budget:
        # An entry whose blocks a later victim still held freed little when it
        # was planned (its own size); once that later victim goes, it may not
        # be needed at all: keep back every victim, the most recently used
        # first, that the budget can still hold.
        room = budget - now
        kept: Set[bytes] = set()
        for k, _ in reversed(victims):
            if size_of(txn, db, k) > room:
                continue  # its own bytes alone do not fit back
            loss = freed.loss(k)
            if loss <= room:
                freed.spare(k)
                kept.add(k)
                room -= loss
        if kept:
            left = [k for k, _ in victims if k not in kept]
            victims = list(zip(left, freed.replay(left)))
            now = budget - room
    return victims, now


def evict(txn, db: Tables, budget: int, keep: Set[bytes], unlink: Unlink, freed: Optional[Freed] = None) -> Tuple[List[bytes], bool]:
    """Evict the entries :func:`plan` names: their keys, and whether one's
    manifest could not be read (its blocks stayed counted: the caller recounts)."""
    victims, _ = plan(txn, db, budget, keep, freed)
    entries = db.entries
    unknown = False
    for k, _ in victims:
        released = unlink(txn, k, txn.get(k, db=entries))
        unknown = unknown or not released
    return [k for k, _ in victims], unknown


def accounting(txn, db: Tables) -> Tuple[Dict[bytes, int], int]:
    """What ``sizes`` and ``usage`` should hold: each entry's own bytes
    (payload plus manifest, as a put counts them; an entry whose manifest
    cannot be read keeps its size record, else its manifest's length), and
    their sum plus every shared block once."""
    live: Dict[bytes, int] = {}
    for k, raw in txn.cursor(db=db.entries):
        k = bytes(k)
        own = _own_size(k, bytes(raw))
        if own is None:
            have = txn.get(k, db=db.sizes) if SIZES in db else None
            own = u64_or(have) if have is not None else len(raw)
        live[k] = own
    return live, sum(live.values()) + block_bytes(txn, db)


def wrong_accounting(txn, db: Tables) -> int:
    """How many of the size records and the usage counter differ from
    :func:`accounting` (a missing or stray size record counts as wrong)."""
    if SIZES not in db:  # a store older than the table, opened read-only: nothing to compare
        return 0
    live, total = accounting(txn, db)
    have = {bytes(k): u64_or(v, -1) for k, v in txn.cursor(db=db.sizes)}
    wrong = sum(1 for k in set(live) | set(have) if live.get(k) != have.get(k))
    return wrong + (usage(txn, db) != total)


def recount(txn, db: Tables) -> int:
    """Rebuild ``sizes`` and ``usage`` from the entries table and the shared
    blocks (:func:`accounting`); drop stale pins."""
    live, total = accounting(txn, db)
    sizes = db.sizes
    for k, own in live.items():
        if u64_or(txn.get(k, db=sizes), -1) != own:
            txn.put(k, U64.pack(own), db=sizes)
    for table in (SIZES, PINS):
        stale = [bytes(k) for k in txn.cursor(db=db[table]).iternext(keys=True, values=False) if bytes(k) not in live]
        for k in stale:
            txn.delete(k, db=db[table])
    _set_usage(txn, db, total)
    return total


def block_bytes(txn, db: Tables) -> int:
    """Bytes of every stored shared block, each once."""
    if REFS not in db:
        return 0
    return sum(ref_size(raw) for raw in txn.cursor(db=db.refs).iternext(keys=False, values=True))


def ref_count(raw: Any) -> int:
    """The reference count of a ``refs`` record (0 when absent or damaged)."""
    return U64.unpack(bytes(raw[:8]))[0] if raw is not None and len(raw) == 16 else 0


def ref_size(raw: Any) -> int:
    """The block size a ``refs`` record holds."""
    return U64.unpack(bytes(raw[8:16]))[0] if raw is not None and len(raw) == 16 else 0


def ref_value(count: int, size: int) -> bytes:
    return U64.pack(count) + U64.pack(size)


def _own_size(ekey: bytes, raw: bytes) -> Optional[int]:
    """An entry's own bytes (payload plus manifest); None when its manifest cannot be read."""
    try:
        return unpack_manifest(raw, entry_id(ekey)).payload + len(raw)
    except PromptStoreError:
        return None
