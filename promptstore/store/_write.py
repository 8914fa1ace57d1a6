"""The one write path: adding and removing an entry inside a write transaction.

Every writer of entries goes through :class:`EntryWriter`: ``put`` (and so
``put_row``, ``import``, warm-up and the serving cache) and ``salvage``.
:meth:`EntryWriter.add` writes an entry's records in a fixed order and its
manifest last, so an entry is visible whole or not at all;
:meth:`EntryWriter.unlink` undoes every record ``add`` wrote.

Records of one entry (tables in ``_schema``): payload chunks (or a blob file
that the manifest names), prefix index, last use, id, size accounting, pin,
and the manifest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from promptstore.errors import PromptStoreError
from promptstore.format import _blobs, _entry, _fill
from promptstore.store import _budget, _index, _keys
from promptstore.store._env import Env
from promptstore.store._schema import F64, Tables, chunk_key, model_of, owner_of_chunk
from promptstore.store._usage import Usage


@dataclass(frozen=True)
class Written:
    """What :meth:`EntryWriter.put` committed."""

    entry_id: str
    created: float
    payload: int


class EntryWriter:
    """Adds and removes entries of one store."""

    def __init__(self, path: Path, env: Env, tables: Tables, blobs: _blobs.Blobs, usage: Usage):
        self.path = path
        self._env = env
        self._db = tables
        self._blobs = blobs
        self._usage = usage

    # -- inside a write transaction ---------------------------------------------

    def add(
        self,
        txn,
        ekey: bytes,
        tokens: np.ndarray,
        trimmable: bool,
        manifest: bytes,
        chunks: Iterable[Any] = (),
        used: Optional[bytes] = None,
        size: Optional[int] = None,
        pinned: bool = False,
        evict: bool = True,
    ) -> None:
        """Write one entry: ``chunks`` (empty when a blob file holds the
        payload), its index records, last use (``used``, f64 bytes; None writes none), id, size
        (``size``, else the manifest's payload plus its own length), pin, and
        the manifest last. An entry at ``ekey`` is replaced (its pin kept).
        With ``evict``, least-recently-used entries go to make room within the
        budget, in this same transaction.

        Raises:
            StoreFull: the entry alone is larger than the budget.
        """
        db = self._db
        old = txn.get(ekey, db=db.entries)
        if old is not None:
            self.unlink(txn, ekey, bytes(old))
        for i, chunk in enumerate(chunks):
            txn.put(chunk_key(ekey, i), chunk, db=db.chunks)
        _index.add(txn, db, model_of(ekey), tokens, _keys.prefix_hashes(tokens), ekey, trimmable)
        if used is not None:
            txn.put(ekey, used, db=db.used)
        txn.put(_keys.entry_id(ekey).encode(), ekey, db=db.ids)
        self._usage.flush_in(txn)
        nbytes = size if size is not None else len(manifest)
        if evict:
            _budget.admit(txn, db, ekey, nbytes, self.unlink, str(self.path))
        else:
            _budget.account(txn, db, ekey, nbytes)
        if pinned:
            txn.put(ekey, b"", db=db.pins)
        txn.put(ekey, manifest, db=db.entries)  # last: the entry is visible whole or not at all

    def unlink(self, txn, ekey: bytes, raw_manifest: Optional[bytes]) -> None:
        """Remove every record of an entry but its pin (a replaced entry keeps it).
        Its blob file is unlinked once ``txn`` commits."""
        db = self._db
        cur = txn.cursor(db=db.chunks)
        if cur.set_range(ekey):
            while owner_of_chunk(cur.key()) == ekey:
                if not cur.delete():
                    break
        eid = _keys.entry_id(ekey)
        if raw_manifest is not None:
            try:
                man = _entry.unpack_manifest(bytes(raw_manifest), eid)
                _index.remove(txn, db, model_of(ekey), man.tokens, _keys.prefix_hashes(man.tokens), ekey)
            except PromptStoreError:
                pass  # damaged manifest: its index records become harmless dead ends (its blob, a leftover)
            else:
                if man.blob is not None and man.blob.startswith(eid + "-"):
                    blob = man.blob
                    self._env.after_commit(lambda: self._blobs.unlink(blob))
        txn.delete(ekey, db=db.used)
        txn.delete(eid.encode(), db=db.ids)
        _budget.forget(txn, db, ekey)
        txn.delete(ekey, db=db.entries)

    def drop(self, txn, ekey: bytes) -> bool:
        """Delete the entry at ``ekey`` and its pin; False when there is none."""
        raw = txn.get(ekey, db=self._db.entries)
        if raw is None:
            return False
        self.unlink(txn, ekey, bytes(raw))
        txn.delete(ekey, db=self._db.pins)
        return True

    # -- a put: its own transaction ---------------------------------------------

    def put(
        self,
        model: str,
        model_name: str,
        toks: np.ndarray,
        encoded: Sequence[Any],
        trimmable: bool,
        meta: Dict[str, Any],
    ) -> Written:
        """Write an entry of ``encoded`` layers in one write transaction.

        A payload of at least ``_blobs.MIN_PAYLOAD`` bytes goes to a blob
        file, written and fsynced under the writer lock inside the
        transaction that commits its manifest (see ``format._blobs``).

        Raises:
            InvalidInput: ``meta`` cannot be serialised (before any write).
            StoreFull: no room (nothing was written).
        """
        records, views, payload = _entry.prepare(encoded)
        blob = payload >= _blobs.MIN_PAYLOAD
        # A blob entry's checksums are computed while its file is written.
        hashing = _fill.submit(_entry.add_checksums, records, views) if blob else None
        if not blob:
            _entry.add_checksums(records, views)
        ekey = _keys.entry_key(_keys.model_id(model), toks)
        eid = _keys.entry_id(ekey)
        now = time.time()
        written: List[str] = []  # blob files this put wrote (one per attempt)

        def pack(blob_name: Optional[str]) -> bytes:
            return _entry.pack_manifest(
                model=model, model_name=model_name, tokens=toks, layers=records, payload=payload,
                created=now, trimmable=trimmable, meta=meta, entry_id=eid, blob=blob_name,
            )

        manifest = pack(None)  # bad meta fails here, before any write (a blob entry's is packed again)

        def write(txn) -> None:
            chunks: Iterable[Any] = ()
            man = manifest
            if hashing is not None:
                # Written under the writer lock; a retried transaction drops
                # its earlier file and writes a new one.
                for name in written:
                    self._blobs.unlink(name)
                name = _blobs.new_name(eid)
                written.append(name)
                self._blobs.write(name, views)
                hashing.result()
                man = pack(name)
            else:
                chunks = _entry.iter_chunks(views, payload)
            self.add(txn, ekey, toks, trimmable, man, chunks, F64.pack(now), payload + len(man))

        try:
            self._env.write(write)
        except BaseException:
            # An interrupt can land after the commit (a signal is handled at the
            # next bytecode): the file the committed manifest names stays.
            for name in written:
                if not self._names_blob(ekey, name):
                    self._blobs.unlink(name)
            raise
        return Written(eid, now, payload)

    def _names_blob(self, ekey: bytes, name: str) -> bool:
        """Whether the committed entry at ``ekey`` names blob file ``name``
        (True when that cannot be read: then the file stays, for gc)."""
        try:
            with self._env.read() as txn:
                raw = txn.get(ekey, db=self._db.entries)
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(ekey)) if raw is not None else None
        except BaseException:
            return True
        return man is not None and man.blob == name
