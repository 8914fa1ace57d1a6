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
import math
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

import mlx.core as mx
import numpy as np

from promptstore.codecs import readable_codec
from promptstore.errors import CorruptEntry, PromptStoreError, StoreError
from promptstore.format import _blank, _blobs, _blocks, _entry, _fill, _pages, _payload
from promptstore.store import _keys
from promptstore.store._env import Env
from promptstore.store._schema import Tables, chunk_key

log = logging.getLogger("promptstore")
T = TypeVar("T")

_LOOKS = 8  # reads of an entry replaced every time give up after this many snapshots
_SMALL = 1 << 20  # shared arrays of fewer bytes are assembled in numpy, then copied into mlx


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
        for li, layer in enumerate(man.layers):  # an entry of a newer promptstore: refused before any byte is read
            try:
                readable_codec(layer.kind, layer.version)
            except PromptStoreError as err:
                raise type(err)(f"{where} layer {li}: {err}") from err
        large = man.payload + man.shared_bytes >= _pages.MIN_PAYLOAD
        arrays = self._payload(txn, ekey, man.payload_only(), where, remembered, large)
        if man.bounds:
            self._assemble(txn, man, arrays, where, large)
        return _entry.decode_layers(man, arrays, where)

    def _assemble(self, txn, man: _entry.Manifest, arrays: List[Dict[str, Any]], where: str, large: bool) -> None:
        blocks = self._db.blocks
        if not large:  # a few small blocks: copied out of the map here (threads, offsets and madvise cost more)
            assemble(lambda key: txn.get(key, db=blocks), man, arrays, where)
            return
        data = self._env.data_file()
        fd = data.fd if _fill.available_128() else None
        assemble(lambda key: txn.get(key, db=blocks), man, arrays, where, data.release, data.offset if fd is not None else None, fd)

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
    offset: Optional[Callable[[Any], Optional[int]]] = None,
    fd: Optional[int] = None,
) -> None:
    """Fill in ``arrays`` (per layer, as the payload readers return them) the
    arrays ``man`` keeps in shared blocks: each block, from ``get_block(address)``
    (None: missing), is checked against its address and copied once, into a
    fresh mlx buffer.

    With ``fd`` and ``offset`` (a block buffer's offset in that file, None
    when unknown), blocks are read with ``preadv`` straight into their rows of
    the destination on the fill threads, and checked there, without touching
    the mapping (as ``_Reader._read_large`` reads large payloads); otherwise
    each is copied out of the map and ``release(buf)`` drops its pages from
    the process's mapping (fetching a value maps all of its pages).

    Raises:
        CorruptEntry: a block is missing or damaged.
    """
    parted = list(man.parted())
    # Every block is found and its size checked before anything is allocated:
    # a manifest (damaged, or crafted) may claim arrays of any size.
    found: List[List[Any]] = []
    for li, rec in parted:
        size = _entry.DTYPES[rec.dtype].size
        raws, start = [], 0
        for key, end in zip(rec.parts or (), man.bounds):
            raw = get_block(key)
            if raw is None:
                raise CorruptEntry(f"{where}: layer {li} array {rec.name!r}: block {key.hex()} is missing")
            shape = _blocks.block_shape(rec.shape, start, end)
            if len(raw) != math.prod(shape) * size:
                raise CorruptEntry(f"{where}: block {key.hex()} has {len(raw)} bytes, expected shape {shape} {rec.dtype}")
            if release is not None:  # finding a value maps the pages around its first one: drop them at once
                release(raw)
            raws.append(raw)
            start = end
        found.append(raws)
    small = fd is None and sum(rec.nbytes for _, rec in parted) < _SMALL
    # A small restore fills numpy buffers and copies them into mlx at the end:
    # mlx's loader (_blank) costs more than copying a few hundred kB again.
    dests: List[Any] = [np.empty(rec.nbytes, np.uint8) for _, rec in parted] if small else _blank.blank([rec.nbytes for _, rec in parted])
    tasks: List[_Block] = []
    for i, ((li, rec), raws) in enumerate(zip(parted, found)):
        layer = man.layers[li]
        size = _entry.DTYPES[rec.dtype].size
        rows = np.asarray(dests[i]).reshape(-1, rec.shape[-2], rec.shape[-1] * size)
        start = 0
        for key, end, raw in zip(rec.parts or (), man.bounds, raws):
            shape = _blocks.block_shape(rec.shape, start, end)
            tasks.append(_Block(key, layer.kind, layer.version, rec.dtype, shape, size, raw, rows[:, start:end, :]))
            start = end
    located = [offset(t.raw) for t in tasks] if offset is not None and fd is not None else None
    if fd is not None and located is not None and all(o is not None for o in located):
        _read_blocks(fd, tasks, [o for o in located if o is not None], where)
    else:
        for t in tasks:
            _blocks.check(t.key, t.kind, t.version, t.dtype, t.shape, t.itemsize, t.raw, where)
            t.rows[...] = np.frombuffer(t.raw, dtype=np.uint8).reshape(t.rows.shape)
            if release is not None:
                release(t.raw)
    for (li, rec), dest in zip(parted, dests):
        arr = mx.array(dest) if small else dest
        arrays[li][rec.name] = arr.view(_entry.DTYPES[rec.dtype]).reshape(rec.shape)


@dataclass
class _Block:
    """One block to read: its address, what it holds, its buffer in the map
    (not touched on the file path) and its rows of the destination."""

    key: bytes
    kind: str
    version: int
    dtype: str
    shape: Tuple[int, ...]
    itemsize: int
    raw: Any
    rows: np.ndarray  # [rows, tokens, width] bytes, each row contiguous


def _read_blocks(fd: int, tasks: Sequence[_Block], offsets: Sequence[int], where: str) -> None:
    """Read each block into its destination rows, hashing it a piece at a
    time as it is read (``_fill.read_hashed``), and check it against its
    address, on the fill threads (two lanes balanced by bytes)."""
    lanes: List[List[int]] = [[], []]
    loads = [0, 0]
    for k in sorted(range(len(tasks)), key=lambda k: -tasks[k].rows.nbytes):
        light = loads.index(min(loads))
        lanes[light].append(k)
        loads[light] += tasks[k].rows.nbytes

    def run(lane: List[int]) -> Optional[str]:
        for k in lane:
            t, off = tasks[k], offsets[k]
            views = [row.reshape(-1).data for row in t.rows]
            try:  # read and hash each piece while it is in the CPU cache
                digest = _fill.read_hashed(fd, views, off, _blocks.header(t.kind, t.version, t.dtype, t.shape))
            except _fill.ShortRead:
                return f"the data file ends inside block {t.key.hex()}"
            if digest != t.key:
                return f"block {t.key.hex()} does not match its address (its bytes are damaged)"
        return None

    futures = [_fill.submit(run, lane) for lane in lanes if lane]
    wait(futures)  # no thread may still write into the destination when this returns or raises
    errors = []
    for f in futures:
        try:
            err = f.result()
        except OSError as exc:
            raise StoreError(f"{where}: reading the data file failed: {exc}") from exc
        if err is not None:
            errors.append(err)
    if errors:
        raise CorruptEntry(f"{where}: {errors[0]}")
