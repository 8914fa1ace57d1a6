"""The bookkeeping of pack files (``format._packs``), inside write transactions.

Records (``packs`` table, two key spaces, and ``info``):

* ``p`` + u64 pack          u64 bytes of its blocks still referenced (live), u64 file bytes
* ``m`` + u64 pack + u64 offset   the address of the live block at that offset
* ``places[address]``       u64 pack, u64 offset (in ``_schema``)
* ``info[dead]``            u64 bytes of packs no entry references any more

A pack's dead bytes stay on disk while any of its blocks is live. When the
dead bytes pass :data:`DEAD_SHARE` of the live ones (and :data:`DEAD_MIN`),
the sparsest packs are rewritten: their live blocks go to a new pack, written and fsynced inside the same transaction,
and the old file is unlinked after the commit. So the pack files never hold
much more than what entries reference (issue 23: disk use bounded by the
budget); the cost is paid by the put that crosses the threshold, and is
proportional to the live bytes it moves.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from promptstore.errors import CorruptEntry, PromptStoreError, StoreError
from promptstore.format import _packs
from promptstore.store._schema import PACKS, PLACES, U64, Tables, pair, parse_pair, u64_or

log = logging.getLogger("promptstore")

DEAD_KEY = b"dead"
DEAD_SHARE = 0.10  # rewrite packs once their dead bytes pass this share of the live ones
DEAD_MIN = 4 << 20  # ... and this many bytes
_P, _M = b"p", b"m"


def pack_key(pack: int) -> bytes:
    return _P + U64.pack(pack)


def member_key(pack: int, offset: int) -> bytes:
    return _M + U64.pack(pack) + U64.pack(offset)


def dead(txn, db: Tables) -> int:
    return u64_or(txn.get(DEAD_KEY, db=db.info))


def _add_dead(txn, db: Tables, delta: int) -> None:
    txn.put(DEAD_KEY, U64.pack(max(0, dead(txn, db) + delta)), db=db.info)


def has_pack(txn, db: Tables, pack: int) -> bool:
    return txn.get(pack_key(pack), db=db.packs) is not None


def record(txn, db: Tables, pack: int, blocks: Sequence[Tuple[bytes, int]]) -> int:
    """Record a new pack holding ``blocks`` (address, size) back to back, then
    its footer; returns the live bytes."""
    offset = 0
    for key, size in blocks:
        txn.put(key, pair(pack, offset), db=db.places)
        txn.put(member_key(pack, offset), key, db=db.packs)
        offset += size
    file_size = offset + len(_packs.footer(blocks))
    txn.put(pack_key(pack), pair(offset, file_size), db=db.packs)
    _add_dead(txn, db, file_size - offset)
    return offset


def place(txn, db: Tables, key: bytes) -> Optional[Tuple[int, int]]:
    """``(pack, offset)`` of a block kept in a pack, or None."""
    return parse_pair(txn.get(key, db=db.places)) if PLACES in db else None


def free(txn, db: Tables, key: bytes, where: Tuple[int, int], size: int) -> Optional[int]:
    """Drop a block kept in a pack; returns the pack when none of it is
    referenced any more (the caller unlinks it once the transaction commits)."""
    pack, offset = where
    txn.delete(key, db=db.places)
    txn.delete(member_key(pack, offset), db=db.packs)
    rec = parse_pair(txn.get(pack_key(pack), db=db.packs))
    if rec is not None and rec[0] > size:
        txn.put(pack_key(pack), pair(rec[0] - size, rec[1]), db=db.packs)
        _add_dead(txn, db, size)
        return None
    if rec is None:
        return None  # no record (damaged): the file stays; verify --fix rebuilds the records
    txn.delete(pack_key(pack), db=db.packs)
    _add_dead(txn, db, -(rec[1] - rec[0]))
    return pack


def _under(txn, db: Tables, head: bytes) -> Iterator[Tuple[bytes, bytes]]:
    """``(key, value)`` of the ``packs`` records whose key starts with ``head``, in order."""
    cur = txn.cursor(db=db.packs)
    ok = cur.set_range(head)
    while ok:
        k = bytes(cur.key())
        if not k.startswith(head):
            return
        yield k, bytes(cur.value())
        ok = cur.next()


def packs(txn, db: Tables) -> List[Tuple[int, int, int]]:
    """``(pack, live bytes, file bytes)`` of every recorded pack."""
    out = []
    for k, v in _under(txn, db, _P):
        rec = parse_pair(v)
        if len(k) == 9 and rec is not None:
            out.append((U64.unpack(k[1:])[0], rec[0], rec[1]))
    return out


def members(txn, db: Tables, pack: int) -> List[Tuple[int, bytes]]:
    """``(offset, address)`` of a pack's live blocks, in file order."""
    return [(U64.unpack(k[9:17])[0], v) for k, v in _under(txn, db, _M + U64.pack(pack))]


def rebuild(txn, db: Tables, size_of: Callable[[bytes], int]) -> List[int]:
    """Rebuild the member records, live bytes and ``dead`` from ``places``
    (``size_of(address)``: a block's size); returns the packs none of whose
    blocks is placed any more (dropped: the caller unlinks them)."""
    live, want = _from_places(txn, db, size_of)
    recorded = {p: f for p, _, f in packs(txn, db)}
    txn.drop(db.packs, delete=False)
    for mkey, key in want.items():
        txn.put(mkey, key, db=db.packs)
    total_dead = 0
    for pack, n in live.items():
        size = max(recorded.get(pack, n), n)
        txn.put(pack_key(pack), pair(n, size), db=db.packs)
        total_dead += size - n
    txn.put(DEAD_KEY, U64.pack(total_dead), db=db.info)
    return [p for p in recorded if p not in live]


def _from_places(txn, db: Tables, size_of: Callable[[bytes], int],
                 lost: Optional[Dict[bytes, Tuple[int, int]]] = None) -> Tuple[Dict[int, int], Dict[bytes, bytes]]:
    """What ``places`` (and the blocks ``lost``, as if placed) make of the pack
    records: live bytes by pack, and member key -> address."""
    live: Dict[int, int] = {}
    want: Dict[bytes, bytes] = {}
    placed = [(bytes(k), parse_pair(raw)) for k, raw in txn.cursor(db=db.places)]
    for key, where in placed + list((lost or {}).items()):
        if where is not None:
            live[where[0]] = live.get(where[0], 0) + size_of(key)
            want[member_key(*where)] = key
    return live, want


def placed_packs(txn, db: Tables) -> Set[int]:
    """The packs ``places`` names: those holding a live block, recorded or not."""
    if PLACES not in db:
        return set()
    return {where[0] for where in map(parse_pair, txn.cursor(db=db.places).iternext(keys=False, values=True)) if where is not None}


def wrong_records(txn, db: Tables, size_of: Callable[[bytes], int], lost: Optional[Dict[bytes, Tuple[int, int]]] = None) -> int:
    """How many pack records (``p`` live bytes, ``m`` members) differ from
    what :func:`rebuild` makes of ``places`` (a missing or stray one counts),
    and the ``places`` records ``lost`` (address -> where :func:`find_lost`
    found the block), each counted once (the records of its pack are compared
    as if it were there)."""
    if PACKS not in db or PLACES not in db:
        return 0
    live, want = _from_places(txn, db, size_of, lost)
    have = dict(_under(txn, db, _M))
    recorded = {p: n for p, n, _ in packs(txn, db)}
    return (len(lost or {}) + sum(1 for k in set(want) | set(have) if want.get(k) != have.get(k))
            + sum(1 for p in set(live) | set(recorded) if live.get(p) != recorded.get(p)))


def find_lost(txn, db: Tables, files: _packs.Packs, sizes: Dict[bytes, int], intact: Callable[[bytes, bytes], bool],
              where: str) -> Dict[bytes, Tuple[int, int]]:
    """Where the blocks ``sizes`` names (address -> bytes), placed nowhere
    (their ``places`` record lost), lie in the pack files: ``(pack, offset)``
    of each found, looked for where its member record says, then where a
    pack's footer does, and found only where ``intact(address, bytes)``."""
    found: Dict[bytes, Tuple[int, int]] = {}

    def look(key: bytes, pack: int, offset: int) -> None:
        try:
            data = files.read(pack, offset, sizes[key], where)
        except PromptStoreError:
            return
        if key not in found and intact(key, data):
            found[key] = (pack, offset)

    for k, key in _under(txn, db, _M):
        if key in sizes and key not in found and len(k) == 17:
            look(key, U64.unpack(k[1:9])[0], U64.unpack(k[9:17])[0])
    if len(found) < len(sizes):
        for pack, key, offset, size in files.footers(where):
            if key in sizes and key not in found and size == sizes[key]:
                look(key, pack, offset)
    return found


def restore(txn, db: Tables, files: _packs.Packs, key: bytes, pack: int, offset: int) -> None:
    """Record again a block found in ``pack`` at ``offset`` (:func:`find_lost`):
    its place and member record, and a record of the pack if it has none (its
    live bytes are rebuilt from ``places`` by :func:`rebuild`)."""
    txn.put(key, pair(pack, offset), db=db.places)
    txn.put(member_key(pack, offset), key, db=db.packs)
    if not has_pack(txn, db, pack):
        try:
            size = os.path.getsize(files.files.path(_packs.name(pack)))
        except OSError:
            size = 0
        txn.put(pack_key(pack), pair(0, size), db=db.packs)


def repack_due(txn, db: Tables) -> bool:
    waste = dead(txn, db)
    if waste < DEAD_MIN:
        return False
    return waste > DEAD_SHARE * sum(n for _, n, _ in packs(txn, db))


def repack(txn, db: Tables, files: _packs.Packs, fresh: List[int], unlink_later: Callable[[int], None], where: str,
           share: float = DEAD_SHARE / 2) -> int:
    """Rewrite the sparsest packs until their dead bytes are at most
    ``share`` of the live ones (by default half of :data:`DEAD_SHARE`; 0:
    every pack with dead bytes beyond its footer); returns the bytes moved. A pack
    whose blocks cannot all be read back intact is left as it is (``verify``
    reports the entries that use it). New pack numbers are appended to
    ``fresh`` (a retried transaction unlinks them)."""
    table = sorted(packs(txn, db), key=lambda p: p[1] / max(1, p[2]))
    live_total = sum(n for _, n, _ in table)
    moved = 0
    for pack, n, size in table:
        if dead(txn, db) <= share * live_total:
            break
        live = members(txn, db, pack)
        if size - n <= len(_packs.footer([(b"", 0)] * len(live))):
            continue  # nothing dead but its footer
        if not _whole(txn, db, pack, n, live):
            log.warning("promptstore: pack file %s not rewritten: its member records are not the blocks placed in it "
                        "(`promptstore verify --fix` rebuilds them)", _packs.name(pack))
            continue
        try:
            blocks = _read_live(files, pack, live, txn, db, where)
        except PromptStoreError as err:
            log.warning("promptstore: pack file %s not rewritten: %s", _packs.name(pack), err)
            continue
        new = files.new_number()
        while has_pack(txn, db, new):
            new = files.new_number()
        fresh.append(new)
        files.write(new, [memoryview(data) for _, data in blocks], [(key, len(data)) for key, data in blocks])
        for offset, key in live:
            txn.delete(member_key(pack, offset), db=db.packs)
        txn.delete(pack_key(pack), db=db.packs)
        _add_dead(txn, db, -(size - n))
        record(txn, db, new, [(key, len(data)) for key, data in blocks])
        unlink_later(pack)
        moved += n
    return moved


def _whole(txn, db: Tables, pack: int, n: int, live: Sequence[Tuple[int, bytes]]) -> bool:
    """Whether the member records ``live`` of ``pack`` are all its live
    blocks: each placed there (``places`` is authoritative), and their sizes
    adding up to its live bytes ``n`` (a lost member record leaves them
    short). A pack rewritten from fewer would lose blocks entries use."""
    return sum(_size(txn, db, key) for _, key in live) == n and all(place(txn, db, key) == (pack, offset) for offset, key in live)


def _read_live(files: _packs.Packs, pack: int, live: Sequence[Tuple[int, bytes]], txn, db: Tables, where: str) -> List[Tuple[bytes, bytes]]:
    """The live blocks of ``pack``, as they are: they are not hashed here (the
    header a block's address covers is in the manifests that name it), and
    need not be: every read checks a block against its address, so a damaged
    block copied stays detectably damaged.

    Raises:
        PromptStoreError: the file is missing, unreadable or too short.
    """
    out = []
    fd = files.open(pack, where)
    try:
        for offset, key in live:
            size = _size(txn, db, key)
            try:
                data = os.pread(fd, size, offset)
            except OSError as err:
                raise StoreError(f"{where}: cannot read pack file {_packs.name(pack)} ({err})") from err
            if len(data) != size:
                raise CorruptEntry(f"{where}: pack file {_packs.name(pack)} ends inside block {key.hex()}")
            out.append((key, data))
    finally:
        os.close(fd)
    return out


def _size(txn, db: Tables, key: bytes) -> int:
    raw = txn.get(key, db=db.refs)
    return U64.unpack(bytes(raw[8:16]))[0] if raw is not None and len(raw) == 16 else 0


