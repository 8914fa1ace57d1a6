"""Maintenance that walks the whole store: verify, the index rebuild, stray blob files."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, List, Optional, Set, Tuple

from promptstore.errors import CorruptEntry, PromptStoreError, StoreClosed, StoreError, UnknownStorageKind, UnsupportedVersion
from promptstore.format import _blobs, _blocks, _entry, _packs
from promptstore.store import _budget, _index, _keys, _packing, _refcount
from promptstore.store._env import Env
from promptstore.store._read import _LOOKS, Reader
from promptstore.store._results import VerifyReport
from promptstore.store._schema import PACKS, PLACES, REFS, Tables, model_of, owner_of_chunk
from promptstore.store._walk import walk_tables
from promptstore.store._write import EntryWriter


class Maintenance:
    """Checks and repairs of one store."""

    def __init__(self, path: Path, env: Env, tables: Tables, blobs: _blobs.Blobs, packs: _packs.Packs, reader: Reader, writer: EntryWriter):
        self.path = path
        self._env = env
        self._db = tables
        self._blobs = blobs
        self._packs = packs
        self._reader = reader
        self._writer = writer

    def verify(self, fix: bool = False) -> VerifyReport:
        """See :meth:`PromptStore.verify`."""
        problems: List[Tuple[str, str]] = []
        newer: List[Tuple[str, str]] = []  # intact entries written by a newer promptstore: kept
        bad: Dict[bytes, Tuple[Optional[bytes], str]] = {}  # entry key -> (the manifest bytes found damaged, in generation)
        db = self._db
        walk_tables(self._env.dir)  # where LMDB would abort this process: raises
        before = 0  # with fix: the wrong records found before restoring lost ``places`` records
        if fix:
            with self._env.read() as txn:
                lost = self.lost_places(txn)
                before = self._wrong_records(txn, lost) if lost else 0
            if lost:  # first: the entries using those blocks are then checked intact, not removed
                self._env.write(self.restore_places)
        # One snapshot for the entry list and the chunk list: a put commits its
        # chunks and manifest together, so only true orphans differ between them.
        with self._env.read() as txn:
            keys = [bytes(k) for k in txn.cursor(db=db.entries).iternext(keys=True, values=False)]
            known = set(keys)
            orphans = [
                bytes(k) for k in txn.cursor(db=db.chunks).iternext(keys=True, values=False) if owner_of_chunk(bytes(k)) not in known
            ]
            stray = self.stray_blobs(txn)
            stray_packs = self.stray_packs(txn)
            counts = self._counts(txn)
            accounting = _budget.wrong_accounting(txn, db)
            records = self._wrong_records(txn, self.lost_places(txn))
        checked = 0
        for ekey in keys:
            eid = _keys.entry_id(ekey)
            raw, err, gen = self._look(ekey, eid)
            if raw is not None:
                checked += 1
            gone: Set[str] = set()  # files found missing, each looked for again on a newer snapshot
            while isinstance(err, _blobs.Vanished) and err.blob not in gone and len(gone) < _LOOKS:
                gone.add(err.blob)
                raw, err, gen = self._look(ekey, eid, gone)
            if err is None:
                continue  # intact, or deleted since the snapshot
            if isinstance(err, _blobs.Vanished) and err.blob not in gone:
                continue  # replaced or repacked at every look: not found damaged
            if is_newer(err, raw):
                newer.append((eid, str(err)))  # fail closed means refuse to read it, never delete it
                continue
            problems.append((eid, str(err)))
            if not isinstance(err, StoreError):  # reading failed (permissions, I/O): not the entry's fault
                bad[ekey] = (raw, gen)
        removed: Tuple[str, ...] = ()
        if fix and (bad or orphans or stray or stray_packs or counts.wrong or counts.orphans or accounting or records):
            def write(txn) -> Tuple[str, ...]:
                gone = []
                for ekey, (raw, gen) in bad.items():
                    now = txn.get(ekey, db=db.entries)
                    # Not replaced by a put since, and found damaged in this generation: a
                    # compaction since may have been followed by a repack no manifest shows.
                    if now is not None and bytes(now) == raw and gen == self._env.generation:
                        self._writer.unlink(txn, ekey, None)
                        gone.append(_keys.entry_id(ekey))
                for k in orphans:
                    if txn.get(owner_of_chunk(k), db=db.entries) is None:  # still no entry owns them
                        txn.delete(k, db=db.chunks)
                self.rebuild_index(txn)
                self.rebuild_ids(txn)
                self._writer.recount(txn)  # rebuilds the pack records too: a pack ``places`` names is recorded before the sweep
                self.sweep_blobs(txn)
                _budget.rebuild_lru(txn, db)
                return tuple(gone)

            removed = self._env.write(write)
        return VerifyReport(
            checked, tuple(problems), len(orphans), fix, len(stray), len(counts.wrong), len(counts.orphans), tuple(newer),
            orphan_packs=len(stray_packs), bad_accounting=accounting, bad_records=max(records, before), removed=removed,
        )

    def _counts(self, txn) -> "_Counts":
        """How the stored reference counts differ from the references the manifests make."""
        db = self._db
        if REFS not in db:  # a store older than shared blocks, opened read-only: none is stored or counted
            return _Counts([], [])
        want, unreadable = _refcount.references(txn, db)
        have = {bytes(k): _budget.ref_count(v) for k, v in txn.cursor(db=db.refs)}
        stored = _refcount.stored(txn, db)
        # While a manifest cannot be read (damaged, or a newer promptstore's
        # entry, kept) its references are unknown: only a count below what
        # the readable ones make is wrong.
        wrong = sorted(k for k in set(want) | set(have)
                       if (want.get(k, 0) > have.get(k, 0)) or (not unreadable and want.get(k, 0) != have.get(k, 0)))
        orphans = sorted(k for k in stored if k not in want) if not unreadable else []
        return _Counts(wrong, orphans)

    def _wrong_records(self, txn, lost: Dict[bytes, Tuple[int, int]]) -> int:
        """How many index records differ from the tables they index: the
        entry ids from ``entries``, the pack records from ``places``, and
        the ``places`` records ``lost`` (:meth:`lost_places`)."""
        want = {eid.encode(): ekey for eid, ekey in self._entry_ids(txn).items()}
        have = {bytes(k): bytes(v) for k, v in txn.cursor(db=self._db.ids)}
        wrong = sum(1 for k in set(want) | set(have) if want.get(k) != have.get(k))
        return wrong + _packing.wrong_records(txn, self._db, lambda key: _budget.ref_size(txn.get(key, db=self._db.refs)), lost)

    def lost_places(self, txn) -> Dict[bytes, Tuple[int, int]]:
        """The blocks readable manifests reference that are stored nowhere (no
        ``blocks`` value, no ``places`` record) but lie intact in a pack file,
        each with where: ``(pack, offset)``. Their ``places`` record was lost;
        the pack's member record or footer still says where they are
        (``_packing.find_lost``), and their bytes hash to their address."""
        db = self._db
        if PLACES not in db or PACKS not in db:
            return {}
        have = _refcount.stored(txn, db)
        heads: Dict[bytes, Tuple[str, int, str, Tuple[int, ...]]] = {}
        for k, raw in txn.cursor(db=db.entries):
            try:
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(bytes(k)))
            except PromptStoreError:
                continue
            for li, rec in man.parted():
                layer = man.layers[li]
                for key, shape in man.parts(rec):
                    if key not in have:
                        heads.setdefault(key, (layer.kind, layer.version, rec.dtype, shape))
        if not heads:
            return {}
        where = f"{self.path}: verify"
        sizes = {key: math.prod(shape) * _entry.DTYPES[dtype].size for key, (_, _, dtype, shape) in heads.items()}

        def intact(key: bytes, data: bytes) -> bool:
            kind, version, dtype, shape = heads[key]
            try:
                _blocks.check(key, kind, version, dtype, shape, _entry.DTYPES[dtype].size, data, where)
            except PromptStoreError:
                return False
            return True

        return _packing.find_lost(txn, db, self._packs, sizes, intact, where)

    def restore_places(self, txn) -> int:
        """Restore the ``places`` records of the blocks :meth:`lost_places`
        finds (in a write transaction, under the writer lock: no pack is
        rewritten or unlinked meanwhile); returns how many."""
        lost = self.lost_places(txn)
        for key, (pack, offset) in lost.items():
            _packing.restore(txn, self._db, self._packs, key, pack, offset)
        return len(lost)

    def _entry_ids(self, txn) -> Dict[str, bytes]:
        """Every entry's key by its id, from the entries table (``ids`` is its index)."""
        return {_keys.entry_id(bytes(k)): bytes(k) for k in txn.cursor(db=self._db.entries).iternext(keys=True, values=False)}

    def rebuild_ids(self, txn) -> None:
        """Rebuild ``ids`` from the entries table."""
        ids = self._entry_ids(txn)
        txn.drop(self._db.ids, delete=False)
        for eid, ekey in ids.items():
            txn.put(eid.encode(), ekey, db=self._db.ids)

    def _look(self, ekey: bytes, eid: str, gone: Collection[str] = ()) -> Tuple[Optional[bytes], Optional[PromptStoreError], str]:
        """Check the entry at ``ekey`` in a new snapshot: its manifest there
        (None: no entry), what reading it met (None: intact) and the
        generation the snapshot was of.

        A file the snapshot names can be gone by the time it is opened
        (:class:`~promptstore.format._blobs.Vanished`) without any damage: a
        put or delete dropped the entry's blob or last block in a pack since,
        or a repack (``_packing``) moved its blocks to a new pack and changed
        no manifest. Only the same file missing again, from a snapshot taken
        after the first look failed, is lost (``verify`` looks again)."""
        raw, gen = None, ""
        try:
            with self._env.read(buffers=True) as txn:  # one short transaction per look
                gen = self._env.generation  # fixed while a transaction is open (Env._follow)
                found = txn.get(ekey, db=self._db.entries)
                if found is None:
                    return None, None, gen
                raw = bytes(found)
                man = _entry.unpack_manifest(raw, f"{self.path} entry {eid}")
                mid = model_of(ekey)
                if man.entry_id != eid or _keys.model_id(man.model) != mid or _keys.entry_key(mid, man.tokens) != ekey:
                    raise CorruptEntry(f"entry {eid}: manifest does not match its key")
                self._reader.restore(txn, ekey, man, remembered=False, lost=gone)
        except StoreClosed:
            raise  # closed by another thread: the rest was not checked, not found damaged
        except PromptStoreError as err:
            return raw, err, gen
        return raw, None, gen

    def upgrade_format(self, txn, fmt: int) -> None:
        """Bring a store of format ``fmt`` to this one's layout (``Env.check_format``):
        format 1 kept a per-entry prefix index (rebuilt as the trie), and
        formats before 3 had no ``lru`` order (built from the last uses)."""
        if fmt < 2:
            self.rebuild_index(txn)
        if fmt < 3:
            _budget.rebuild_lru(txn, self._db)

    def rebuild_index(self, txn) -> None:
        """Rebuild the prefix index from the intact manifests, and from those
        of a newer promptstore's entries, kept, whose token ids match their
        entry key (so the release that reads them still finds them)."""
        _index.clear(txn, self._db)
        for k, raw in list(txn.cursor(db=self._db.entries)):
            k = bytes(k)
            try:
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(k))
                tokens, trimmable = man.tokens, man.trimmable
            except PromptStoreError as err:
                newer = _entry.newer_tokens(bytes(raw)) if is_newer(err, bytes(raw)) else None
                if newer is None or _keys.entry_key(model_of(k), newer[0]) != k:
                    continue
                tokens, trimmable = newer
            _index.add(txn, self._db, model_of(k), tokens, _keys.prefix_hashes(tokens), k, trimmable)

    def stray_blobs(self, txn) -> List[str]:
        """The blob files that no manifest in ``txn`` names. A blob's name
        starts with its entry's id, so each file costs one manifest read (the
        entry found from the entries table: not through ``ids``, an index
        whose record may be lost). A file whose entry has a manifest this
        promptstore cannot read (damaged, or from a newer version) is kept:
        it may be that entry's."""
        stray: List[str] = []
        names = self._blobs.names()
        by_id = self._entry_ids(txn) if names else {}
        for name in names:
            ekey = by_id.get(name[:16])
            raw = txn.get(ekey, db=self._db.entries) if ekey is not None else None
            if raw is not None:
                try:
                    if _entry.unpack_manifest(bytes(raw), name[:16]).blob == name:
                        continue
                except PromptStoreError:
                    continue
            stray.append(name)
        return stray

    def stray_packs(self, txn) -> List[int]:
        """The pack files the store does not record (left by a put killed
        before its commit). A file that ``places`` names holds live blocks
        whatever its own record says (lost: verify reports it, --fix rebuilds it)."""
        if PACKS not in self._db:
            return []
        numbers = [p for p in self._packs.numbers() if not _packing.has_pack(txn, self._db, p)]
        placed = _packing.placed_packs(txn, self._db) if numbers else set()
        return [p for p in numbers if p not in placed]

    def sweep_blobs(self, txn) -> int:
        """Unlink, once ``txn`` commits, the blob files no manifest in it names
        and the pack files it does not record. Only in a write transaction:
        under the writer lock no put is between writing its file and
        committing it (see ``format._blobs``)."""
        stray = self.stray_blobs(txn)
        packs = self.stray_packs(txn)
        if stray or packs:
            def unlink() -> None:
                for name in stray:
                    self._blobs.unlink(name)
                for pack in packs:
                    self._packs.unlink(pack)

            self._env.after_commit(unlink)
        return len(stray) + len(packs)


def is_newer(err: PromptStoreError, raw: Optional[bytes]) -> bool:
    """Whether ``err``, met reading the manifest ``raw``, means the entry was
    written by a newer promptstore (an entry format, storage kind or codec
    version this one does not know, in a manifest whose checksum holds)
    rather than damaged."""
    return isinstance(err, (UnsupportedVersion, UnknownStorageKind)) and raw is not None and _entry.checksum_holds(raw)


@dataclass(frozen=True)
class _Counts:
    wrong: List[bytes]  # blocks whose stored count is not the number of references
    orphans: List[bytes]  # stored blocks nothing references
