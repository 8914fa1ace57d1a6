"""PromptStore's inspection methods: ids, info, load, listing, counters, verify.

A mixin so that ``store.py`` keeps the read and write paths.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from promptstore.format import _blobs, _entry
from promptstore.store import _index, _keys
from promptstore.errors import CorruptEntry, EntryNotFound, ModelMismatch, PromptStoreError, StoreClosed, StoreError

if TYPE_CHECKING:
    from promptstore.store import EntryInfo

log = logging.getLogger("promptstore")
_U64 = struct.Struct(">Q")


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :meth:`PromptStore.verify`."""

    checked: int
    problems: Tuple[Tuple[str, str], ...]  # (entry id, what is wrong)
    orphan_chunks: int
    fixed: bool
    orphan_blobs: int = 0  # blob files no entry names: leftovers of killed puts, not damage

    @property
    def ok(self) -> bool:
        return not self.problems and not self.orphan_chunks


class InspectMixin:
    """Everything that reads entries by id or walks the whole store."""


    def _resolve(self, txn, key: str) -> bytes:
        if not isinstance(key, str) or not key or len(key) > 16 or any(c not in "0123456789abcdef" for c in key.lower()):
            raise EntryNotFound(f"{key!r} is not an entry id (16 hex digits, or a unique prefix)")
        prefix = key.lower().encode()
        cur = txn.cursor(db=self._db[b"ids"])
        found = []
        if cur.set_range(prefix):
            for k, v in cur:
                if not bytes(k).startswith(prefix) or len(found) > 1:
                    break
                found.append(bytes(v))
        if not found:
            raise EntryNotFound(f"{self.path}: no entry {key!r}; `promptstore ls` lists the ids")
        if len(found) > 1:
            raise EntryNotFound(f"{self.path}: {key!r} is ambiguous; give more digits of the id")
        return found[0]

    def info(self, key: str) -> EntryInfo:
        """EntryInfo of the entry with id (or unique id prefix) ``key``."""
        with self.env.read() as txn:
            ekey = self._resolve(txn, key)
            man = self._manifest(txn, ekey)
            if man is None:
                raise EntryNotFound(f"{self.path}: entry {key!r} has vanished")
            return self._info(txn, ekey, man)

    def load(self, key: str, model: Optional[str] = None) -> Tuple[List[Any], EntryInfo, List[int]]:
        """Restore an entry by id: ``(cache, info, tokens)``.

        Raises:
            EntryNotFound: no such id.
            ModelMismatch: ``model`` is given and the entry belongs to another.
            CorruptEntry, UnknownStorageKind, UnsupportedVersion.
        """
        return _blobs.again(lambda lost: self._load_once(key, model))

    def _load_once(self, key: str, model: Optional[str]) -> Tuple[List[Any], EntryInfo, List[int]]:
        with self.env.read(buffers=True) as txn:
            ekey = self._resolve(txn, key)
            man = self._manifest(txn, ekey)
            if man is None:
                raise EntryNotFound(f"{self.path}: entry {key!r} has vanished")
            if model is not None and man.model != model:
                raise ModelMismatch(f"{self.path} entry {man.entry_id} belongs to model {man.model!r}, not {model!r}")
            cache = self._restore(txn, ekey, man)
            info = self._info(txn, ekey, man)
        self._touch(ekey)
        return cache, info, man.tokens.tolist()

    def entries(self, model: Optional[str] = None) -> Iterator[EntryInfo]:
        """EntryInfo of every readable entry (of ``model`` when given).

        Entries whose manifest is damaged are skipped with a warning; run
        :meth:`verify` to list them.
        """
        mid = _keys.model_id(model) if model is not None else None
        with self.env.read() as txn:
            cur = txn.cursor(db=self._db[b"entries"])
            found = []
            if mid is None:
                it = iter(cur) if cur.first() else iter(())
            else:
                it = iter(cur) if cur.set_range(mid) else iter(())
            for k, raw in it:
                k = bytes(k)
                if mid is not None and k[:16] != mid:
                    break
                try:
                    man = _entry.unpack_manifest(bytes(raw), f"{self.path} entry {_keys.entry_id(k)}")
                except PromptStoreError as err:
                    log.warning("promptstore: %s (run `promptstore verify`)", err)
                    continue
                found.append(self._info(txn, k, man))
        return iter(found)

    def tokens(self, key: str) -> List[int]:
        """The token ids of the entry with id (or unique prefix) ``key``."""
        with self.env.read() as txn:
            man = self._manifest(txn, self._resolve(txn, key))
            if man is None:
                raise EntryNotFound(f"{self.path}: entry {key!r} has vanished")
            return man.tokens.tolist()

    def counters(self) -> Dict[str, int]:
        """Hits and misses recorded by every process (after their flush)."""
        self.flush()
        out = {}
        with self.env.read() as txn:
            for what in ("hits", "misses"):
                raw = txn.get(b"stat:" + what.encode(), db=self._db[b"info"])
                out[what] = _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
        return out

    def file_size(self) -> int:
        """Bytes the store's files take: the LMDB data file (it never shrinks
        by itself) and the blob files of large entries."""
        return (self.env.dir / "data.mdb").stat().st_size + self._blobs.nbytes()

    def _stray_blobs(self, txn) -> List[str]:
        """The blob files that no manifest in ``txn`` names. A blob's name
        starts with its entry's id, so each file costs one manifest read. A
        file whose entry has a manifest this promptstore cannot read (damaged,
        or from a newer version) is kept: it may be that entry's."""
        stray = []
        for name in self._blobs.names():
            ekey = txn.get(name[:16].encode(), db=self._db[b"ids"])
            raw = txn.get(bytes(ekey), db=self._db[b"entries"]) if ekey is not None else None
            if raw is not None:
                try:
                    if _entry.unpack_manifest(bytes(raw), name[:16]).blob == name:
                        continue
                except PromptStoreError:
                    continue
            stray.append(name)
        return stray

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every manifest and checksum; with ``fix``, delete what is broken.

        Returns:
            A VerifyReport listing each damaged entry and orphaned chunks,
            and counting the blob files no entry names. Those are leftovers
            of puts killed before their commit, not damage: they do not make
            the report fail, and a put in flight may show as one; ``fix``
            (and :meth:`gc`) decide again under the writer lock and remove
            them.
        """
        problems: List[Tuple[str, str]] = []
        bad: Dict[bytes, Optional[bytes]] = {}  # entry key -> the manifest bytes found damaged
        # One snapshot for the entry list and the chunk list: a put commits its
        # chunks and manifest together, so only true orphans differ between them.
        with self.env.read() as txn:
            keys = [bytes(k) for k in txn.cursor(db=self._db[b"entries"]).iternext(keys=True, values=False)]
            known = set(keys)
            orphans = [
                bytes(k)
                for k in txn.cursor(db=self._db[b"chunks"]).iternext(keys=True, values=False)
                if bytes(k[:36]) not in known
            ]
            stray = self._stray_blobs(txn)
        checked = 0
        for ekey in keys:
            eid = _keys.entry_id(ekey)
            raw = None
            try:
                with self.env.read(buffers=True) as txn:  # one short transaction per entry
                    found = txn.get(ekey, db=self._db[b"entries"])
                    if found is None:
                        continue  # deleted since the snapshot
                    raw = bytes(found)
                    checked += 1
                    man = _entry.unpack_manifest(raw, f"{self.path} entry {eid}")
                    if man.entry_id != eid or _keys.model_id(man.model) != ekey[:16] or _keys.entry_key(ekey[:16], man.tokens) != ekey:
                        raise CorruptEntry(f"entry {eid}: manifest does not match its key")
                    self._restore(txn, ekey, man, remembered=False)
            except StoreClosed:
                raise  # closed by another thread: the rest was not checked, not found damaged
            except PromptStoreError as err:
                if isinstance(err, _blobs.Vanished) and not self._still(ekey, raw):
                    continue  # deleted or replaced since: its blob went with it
                problems.append((eid, str(err)))
                if not isinstance(err, StoreError):  # reading failed (permissions, I/O): not the entry's fault
                    bad[ekey] = raw
        if fix and (bad or orphans or stray):
            def write(txn) -> None:
                entries = self._db[b"entries"]
                for ekey, raw in bad.items():
                    now = txn.get(ekey, db=entries)
                    if now is not None and bytes(now) == raw:  # not replaced by a put since
                        self._unlink(txn, ekey, None)
                for k in orphans:
                    if txn.get(k[:36], db=entries) is None:  # still no entry owns them
                        txn.delete(k, db=self._db[b"chunks"])
                self._rebuild_index(txn)
                self._drop_stray_blobs(txn)

            self.env.write(write)
        return VerifyReport(checked, tuple(problems), len(orphans), fix, len(stray))

    def _still(self, ekey: bytes, raw: Optional[bytes]) -> bool:
        """Whether the entry at ``ekey`` still has the manifest ``raw`` (a new snapshot)."""
        with self.env.read() as txn:
            now = txn.get(ekey, db=self._db[b"entries"])
        return now is not None and now == raw

    def _drop_stray_blobs(self, txn) -> int:
        """Unlink, once ``txn`` commits, the blob files no manifest in it names.
        Only in a write transaction: under the writer lock no put is between
        writing its file and committing it (see :mod:`promptstore.format._blobs`)."""
        stray = self._stray_blobs(txn)
        if stray:
            self.env.after_commit(lambda: [self._blobs.unlink(n) for n in stray])
        return len(stray)

    def _rebuild_index(self, txn) -> None:
        """Rebuild the prefix index from the intact manifests."""
        _index.clear(txn, self._db)
        for k, raw in list(txn.cursor(db=self._db[b"entries"])):
            k = bytes(k)
            try:
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(k))
            except PromptStoreError:
                continue
            _index.add(txn, self._db, k[:16], man.tokens, _keys.prefix_hashes(man.tokens), k, man.trimmable)
