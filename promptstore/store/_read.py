"""Reading entries: manifests, and the one place that picks how a payload is read.

An entry's arrays in shared blocks (format 3) are assembled from their blocks,
each verified against its address, straight into fresh mlx buffers (one
copy); a prefix restore reads only the blocks the prefix needs. The rest of
an entry, its own payload, is read in one of three ways, chosen by
:meth:`Reader.restore`:

* a blob file (``format._blobs``), for entries whose manifest names one;
* LMDB chunks copied out of the map, for small payloads;
* ``pread`` from the data file at the chunks' file offsets (Linux), for large
  payloads kept in LMDB: py-lmdb maps every page of a value it returns, only
  for them to be dropped again, so the offsets are found once and remembered
  (see :meth:`Reader._read_large`).

Every strategy checks every array's checksum; the arrays are copied into mlx
inside the read transaction, since LMDB buffers die with it.

A blob file can vanish between a reader's snapshot and its open (the entry was
deleted or replaced since): :meth:`Reader.again` runs a read again on a new
snapshot, and tells a deleted entry from a lost file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, TypeVar

import numpy as np

from promptstore.errors import CorruptEntry, PromptStoreError
from promptstore.format import _blank, _blobs, _blocks, _entry, _fill, _pages, _payload
from promptstore.store import _keys
from promptstore.store._env import Env
from promptstore.store._schema import Tables, chunk_key

log = logging.getLogger("promptstore")
T = TypeVar("T")

_LOOKS = 8  # reads of an entry replaced every time give up after this many snapshots


class Reader:
    """Reads manifests and payloads of one store."""

    def __init__(self, path: Path, env: Env, tables: Tables, blobs: _blobs.Blobs):
        self.path = path
        self._env = env
        self._db = tables
        self._blobs = blobs

    def manifest(self, txn, ekey: bytes) -> Optional[_entry.Manifest]:
        """The manifest at ``ekey``, or None.

        Raises:
            CorruptEntry, UnsupportedVersion: damaged, or written by a newer promptstore.
        """
        raw = txn.get(ekey, db=self._db.entries)
        if raw is None:
            return None
        return _entry.unpack_manifest(bytes(raw), f"{self.path} entry {_keys.entry_id(ekey)}")

    def safe_manifest(self, txn, ekey: bytes) -> Optional[_entry.Manifest]:
        """The manifest at ``ekey``, or None when missing or unreadable (logged)."""
        try:
            return self.manifest(txn, ekey)
        except PromptStoreError as err:
            log.warning("promptstore: skipping entry %s: %s", _keys.entry_id(ekey), err)
            return None

    @staticmethod
    def again(read: Callable[[Set[str]], T]) -> T:
        """``read(lost)``, run again on a new snapshot while it meets a blob
        file that vanished (:class:`~promptstore.format._blobs.Vanished`).

        A blob is unlinked only after the commit that dropped its manifest, so
        a blob missing at a second snapshot (taken after the first look failed)
        that still names it is lost. ``lost`` holds such blobs: lookup skips
        their entries; other reads raise the second Vanished, a CorruptEntry.
        After ``_LOOKS`` looks at an entry replaced every time, the last error
        is raised.
        """
        seen: Set[str] = set()
        for attempt in range(_LOOKS):
            try:
                return read(seen)
            except _blobs.Vanished as err:
                if err.blob in seen or attempt == _LOOKS - 1:
                    raise
                seen.add(err.blob)
        raise AssertionError("unreachable")

    def restore(self, txn, ekey: bytes, man: _entry.Manifest, remembered: bool = True) -> List[Any]:
        """The entry's cache, read, checked and decoded inside ``txn``.

        ``remembered=False`` (verify) always goes through LMDB, checking every
        chunk's presence and length.
        """
        where = f"{self.path} entry {man.entry_id}"
        large = man.payload + man.shared_bytes >= _pages.MIN_PAYLOAD
        arrays = self._payload(txn, ekey, man.payload_only(), where, remembered, large)
        if man.bounds:
            self._assemble(txn, man, arrays, where)
        return _entry.decode_layers(man, arrays, where)

    def _assemble(self, txn, man: _entry.Manifest, arrays: List[Dict[str, Any]], where: str) -> None:
        blocks = self._db.blocks
        assemble(lambda key: txn.get(key, db=blocks), man, arrays, where, self._env.data_file().release)

    def _payload(self, txn, ekey: bytes, man: _entry.Manifest, where: str, remembered: bool, large: bool) -> List[Dict[str, Any]]:
        if man.blob is not None:
            return self._blobs.read(man, where)
        chunks = self._db.chunks

        def get_chunk(i: int) -> Any:
            return txn.get(chunk_key(ekey, i), db=chunks)

        if not large or not man.chunks:  # a small restore: the map scan, fd and threads are not worth it
            return _payload.read_arrays(man, get_chunk, where)
        return self._read_large(ekey, man, get_chunk, where, remembered)

    def _read_large(self, ekey: bytes, man: _entry.Manifest, get_chunk: Callable[[int], Any], where: str, remembered: bool) -> List[Dict[str, Any]]:
        """A large payload kept in LMDB, read with ``pread`` where possible.

        The file offsets of an entry's chunks are remembered, keyed by the
        entry and its manifest's creation time and size, so a later get of the
        same entry reads them directly. Only overflow pages are remembered
        (every chunk at least a page long): LMDB never moves those while their
        value stands, whereas a small value lives in a leaf page that any later
        write may copy. The offsets are stale only if the entry was rewritten
        since, at the same key, with the same creation time; then the
        checksums fail and the restore is redone through LMDB, which also
        reports real damage. A failure on offsets just computed is checked
        again by copying out of the map, so a wrong offset can never make a
        healthy entry look damaged.
        """
        data = self._env.data_file()
        fd = data.fd if _fill.available() else None
        key = (ekey, man.created, man.payload, man.chunks)
        offsets = data.located.get(key) if fd is not None and remembered else None
        if fd is not None and offsets is not None:
            try:
                return _payload.read_file(man, fd, offsets, where)
            except CorruptEntry:
                data.forget(key)
        bufs = _payload.chunk_buffers(man, get_chunk, where, data.release)
        found = [data.offset(b) for b in bufs]
        if fd is None or any(o is None for o in found):
            return _payload.read_mapped(man, bufs, where, data.release)
        located = [o for o in found if o is not None]
        try:
            arrays = _payload.read_file(man, fd, located, where)
        except CorruptEntry:
            data.refresh()
            return _payload.read_mapped(man, bufs, where, data.release)
        if min(len(b) for b in bufs) >= _pages._PAGE:
            data.remember(key, located)
        return arrays


def assemble(
    get_block: Callable[[bytes], Any],
    man: _entry.Manifest,
    arrays: List[Dict[str, Any]],
    where: str,
    release: Optional[Callable[[Any], None]] = None,
) -> None:
    """Fill in ``arrays`` (per layer, as the payload readers return them) the
    arrays ``man`` keeps in shared blocks: each block, from ``get_block(address)``
    (None: missing), is checked against its address and copied once, into a
    fresh mlx buffer. ``release(buf)`` drops a block's pages from the process's
    mapping once it is copied (fetching a value maps all of its pages).

    Raises:
        CorruptEntry: a block is missing or damaged.
    """
    parted = list(man.parted())
    dests = _blank.blank([rec.nbytes for _, rec in parted])
    for (li, rec), dest in zip(parted, dests):
        layer = man.layers[li]
        size = _entry.DTYPES[rec.dtype].size
        rows = np.asarray(dest).reshape(-1, rec.shape[-2], rec.shape[-1] * size)
        start = 0
        for key, end in zip(rec.parts or (), man.bounds):
            raw = get_block(key)
            if raw is None:
                raise CorruptEntry(f"{where}: layer {li} array {rec.name!r}: block {key.hex()} is missing")
            shape = _blocks.block_shape(rec.shape, start, end)
            _blocks.check(key, layer.kind, layer.version, rec.dtype, shape, size, raw, where)
            rows[:, start:end, :] = np.frombuffer(raw, dtype=np.uint8).reshape(rows.shape[0], end - start, rows.shape[2])
            if release is not None:
                release(raw)
            start = end
        arrays[li][rec.name] = dest.view(_entry.DTYPES[rec.dtype]).reshape(rec.shape)
