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

A large entry with both, a blob file and shared blocks, is read in one pass
(:func:`assemble` with ``blob``): its own arrays and its blocks together.

Every strategy checks every array's checksum; the arrays are copied into mlx
inside the read transaction, since LMDB buffers die with it.

A blob file can vanish between a reader's snapshot and its open (the entry was
deleted or replaced since): :meth:`Reader.again` runs a read again on a new
snapshot, and tells a deleted entry from a lost file.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar, cast

import mlx.core as mx
import numpy as np

from promptstore.errors import CorruptEntry, PromptStoreError, StoreError
from promptstore.format import _blank, _blobs, _blocks, _entry, _fill, _packs, _pages, _payload
from promptstore.store import _keys
from promptstore.store._env import Env
from promptstore.store._schema import PLACES, Tables, chunk_key, parse_pair

log = logging.getLogger("promptstore")
T = TypeVar("T")

_LOOKS = 8  # reads of an entry replaced every time give up after this many snapshots
_SMALL = 1 << 20  # shared arrays of fewer bytes are assembled in numpy, then copied into mlx


class Reader:
    """Reads manifests and payloads of one store."""

    def __init__(self, path: Path, env: Env, tables: Tables, blobs: _blobs.Blobs, packs: _packs.Packs):
        self.path = path
        self._env = env
        self._db = tables
        self._blobs = blobs
        self._packs = packs
        # Shared blocks a restore of this process found missing or damaged, as
        # its snapshot saw them: a put that references one checks the stored
        # copy and writes it again unless it is intact by then (EntryWriter).
        self.damaged: Set[bytes] = set()

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

    def restore(self, txn, ekey: bytes, man: _entry.Manifest, remembered: bool = True,
                lost: Collection[str] = ()) -> List[Any]:
        """The entry's cache, read, checked and decoded inside ``txn``.

        ``remembered=False`` (verify) always goes through LMDB, checking every
        chunk's presence and length. ``lost``: the files an earlier snapshot
        already missed (:meth:`again`); a pack file among them is lost, and
        its blocks are remembered as damaged.
        """
        where = f"{self.path} entry {man.entry_id}"
        man.check_readable(where)
        try:
            return self._restore(txn, ekey, man, where, remembered)
        except CorruptEntry as err:
            if isinstance(err, _blobs.Vanished) and (_packs.pack_of(err.blob) is None or err.blob not in lost):
                # A blob file, or a pack file at its first look: deleted, or
                # rewritten by a repack, since the snapshot; nothing damaged
                # (the read looks again on a newer one).
                raise
            # Which shared blocks, if any (a pack file missed at a second look
            # too: lost): a put of the same content checks them and writes
            # them again. Once one of the entry's is known, its later failed reads
            # (a lookup on every request of a server, say) are not checked again.
            if man.bounds and not self.known_damaged(man):
                self.damaged.update(self.damaged_blocks(txn, man))
            raise

    def _restore(self, txn, ekey: bytes, man: _entry.Manifest, where: str, remembered: bool) -> List[Any]:
        large = man.payload + man.shared_bytes >= _pages.MIN_PAYLOAD
        mode = _blank.mode()
        if large and man.blob is not None and _fill.available_128() and (mode == "staged" or (mode == "direct" and man.bounds)):
            # One pass: the blob's arrays and the blocks' read together (see assemble).
            arrays: List[Dict[str, Any]] = [{} for _ in man.layers]
            with self._blobs.opened(man, where) as blob:
                self._assemble(txn, man, arrays, where, large, blob)
            return _entry.decode_layers(man, arrays, where)
        arrays = self._payload(txn, ekey, man.payload_only(), where, remembered, large)
        if man.bounds:
            self._assemble(txn, man, arrays, where, large)
        return _entry.decode_layers(man, arrays, where)

    @contextlib.contextmanager
    def _finder(self, txn, where: str) -> Iterator[Callable[[bytes], Any]]:
        """``find(address)``: a block's LMDB value, its :class:`InFile` (pack
        files opened once, closed on leaving), or None (missing)."""
        db = self._db
        places = db.get(PLACES)
        fds: Dict[int, int] = {}

        def find(key: bytes) -> Any:
            place = parse_pair(txn.get(key, db=places)) if places is not None else None
            if place is None:
                return txn.get(key, db=db.blocks)
            pack, offset = place
            if pack not in fds:
                fds[pack] = self._packs.open(pack, where)
            return InFile(fds[pack], offset)

        try:
            yield find
        finally:
            for fd in fds.values():
                os.close(fd)

    def known_damaged(self, man: _entry.Manifest) -> bool:
        """Whether ``man`` names a block a read of this process found damaged."""
        return bool(self.damaged) and any(key in self.damaged for key, _ in man.blocks())

    def damaged_blocks(self, txn, man: _entry.Manifest) -> Set[bytes]:
        """The shared blocks of ``man`` that are missing, unreadable or do not
        hash to their address, each read and checked on its own (after a
        restore failed: what a put may write again)."""
        where = f"{self.path} entry {man.entry_id}"
        bad: Set[bytes] = set()
        seen: Set[bytes] = set()
        with self._finder(txn, where) as find:
            for li, rec in man.parted():
                layer, size = man.layers[li], _entry.DTYPES[rec.dtype].size
                for key, shape in man.parts(rec):
                    if key in seen:
                        continue
                    seen.add(key)
                    try:
                        raw = find(key)
                        if isinstance(raw, InFile):
                            raw = os.pread(raw.fd, math.prod(shape) * size, raw.offset)
                        if raw is None:
                            raise CorruptEntry(f"{where}: block {key.hex()} is missing")
                        _blocks.check(key, layer.kind, layer.version, rec.dtype, shape, size, raw, where)
                    except (CorruptEntry, StoreError, OSError):
                        bad.add(key)
        return bad

    def _assemble(self, txn, man: _entry.Manifest, arrays: List[Dict[str, Any]], where: str, large: bool, blob: Optional[int] = None) -> None:
        with self._finder(txn, where) as find:
            if not large:  # a few small blocks: copied out of the map here (threads, offsets and madvise cost more)
                assemble(find, man, arrays, where)
                return
            data = self._env.data_file()
            fd = data.fd if _fill.available_128() else None
            assemble(find, man, arrays, where, data.release, data.offset if fd is not None else None, fd, threads=True, blob=blob)

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


@dataclass(frozen=True)
class InFile:
    """Where a block stored outside LMDB is: a file and the offset of its bytes."""

    fd: int
    offset: int


def assemble(
    find_block: Callable[[bytes], Any],
    man: _entry.Manifest,
    arrays: List[Dict[str, Any]],
    where: str,
    release: Optional[Callable[[Any], None]] = None,
    offset: Optional[Callable[[Any], Optional[int]]] = None,
    fd: Optional[int] = None,
    threads: bool = False,
    blob: Optional[int] = None,
) -> None:
    """Fill in ``arrays`` (per layer, as the payload readers return them) the
    arrays ``man`` keeps in shared blocks: each block is checked against its
    address and copied once, into a fresh mlx buffer.

    ``find_block(address)`` says where a block is: an LMDB value, an
    :class:`InFile` (a pack file), or None (missing). Blocks in files are
    read with ``preadv`` straight into their rows of the destination and
    hashed as they are read; so are LMDB values when ``fd`` (the data file)
    and ``offset`` (a value's offset in it, None when unknown) are given.
    The rest are copied out of the map, and ``release(buf)`` drops their
    pages from the process's mapping (fetching a value maps all of its
    pages). ``threads``: read files on the fill threads.

    Where restores are staged (:func:`_blank.staged`: on the CUDA backend)
    each array is written inside mlx's loader, its blocks read on the
    loader's own thread. ``blob`` (a descriptor of the entry's blob file)
    adds the entry's own arrays to the same pass, each read from the file
    and checked against its checksum, where reading the payload first and
    then the blocks left each phase waiting on its slowest reader: staged,
    in the same loader call (on an H200 a 4K-token get of the
    Qwen3-Next-80B-shaped cache went from 0.65-0.69x mlx-lm's loader to
    1.13x with 4 loaders, docs/gpu.md); direct, in the same lanes of the
    fill threads, into one set of shared buffers (:func:`_one_pass`).

    Raises:
        CorruptEntry: a block is missing or damaged, or an own array is.
        StoreError: reading a file failed.
    """
    assert blob is None or not _blank.reads_ahead()
    parted = list(man.parted())
    # Every block is found and its size checked before anything is allocated:
    # a manifest (damaged, or crafted) may claim arrays of any size.
    found: List[List[Tuple[bytes, Tuple[int, ...], Any]]] = []  # per array: (address, shape, where) of each block
    for li, rec in parted:
        size = _entry.DTYPES[rec.dtype].size
        blocks = []
        for key, shape in man.parts(rec):
            raw = find_block(key)
            if raw is None:
                raise CorruptEntry(f"{where}: layer {li} array {rec.name!r}: block {key.hex()} is missing")
            if not isinstance(raw, InFile):  # a file's block is checked as it is read (size included)
                if len(raw) != math.prod(shape) * size:
                    raise CorruptEntry(f"{where}: block {key.hex()} has {len(raw)} bytes, expected shape {shape} {rec.dtype}")
                if release is not None:  # finding a value maps the pages around its first one: drop them at once
                    release(raw)
            blocks.append((key, shape, raw))
        found.append(blocks)
    small = blob is None and fd is None and sum(rec.nbytes for _, rec in parted) < _SMALL

    def blocks_of(i: int, whole: np.ndarray) -> List[_Block]:
        """Array ``i``'s blocks into ``whole`` (its bytes): those in the map
        copied here, those in files returned to be read."""
        li, rec = parted[i]
        layer = man.layers[li]
        size = _entry.DTYPES[rec.dtype].size
        rows = whole.reshape(-1, rec.shape[-2], rec.shape[-1] * size)
        from_files: List[_Block] = []
        start = 0
        for (key, shape, raw), end in zip(found[i], man.bounds):
            dest = rows[:, start:end, :]
            start = end
            at = offset(raw) if offset is not None and fd is not None and not isinstance(raw, InFile) else None
            if isinstance(raw, InFile) or at is not None:
                t = _Block(key, layer.kind, layer.version, rec.dtype, shape, size, raw, dest)
                t.file = raw if isinstance(raw, InFile) else InFile(fd, at)  # type: ignore[arg-type]
                from_files.append(t)
                continue
            _blocks.check(key, layer.kind, layer.version, rec.dtype, shape, size, raw, where)
            dest[...] = np.frombuffer(raw, dtype=np.uint8).reshape(dest.shape)
            if release is not None:
                release(raw)
        return from_files

    def read(indices: Sequence[int], hosts: List[np.ndarray]) -> None:
        """Arrays ``indices`` into ``hosts``: their blocks in files read at once."""
        groups = [(host, blocks_of(i, host)) for i, host in zip(indices, hosts)]
        if any(tasks for _, tasks in groups):
            _read_blocks([g for g in groups if g[1]], where, threads)

    if blob is not None and not _blank.staged():
        _one_pass(blob, man, parted, blocks_of, arrays, where)
        return
    sizes = [rec.nbytes for _, rec in parted]
    dests: List[Any]
    if not small and _blank.reads_ahead():  # read ahead of mlx's loader (see _blank.ahead)
        dests = _blank.ahead(sizes, read)
    elif not small and _blank.staged():  # each array written inside mlx's loader (see _blank)
        own = [] if blob is None else _own_arrays(man, arrays)

        def fill(i: int, view: memoryview) -> None:
            whole = np.frombuffer(view, dtype=np.uint8)
            if i < len(own):
                li, rec = own[i]
                _read_own(cast(int, blob), whole, li, rec, where)
                return
            tasks = blocks_of(i - len(own), whole)
            if tasks:  # on this (the loader's) thread: several loaders run at once
                _read_blocks([(whole, tasks)], where, False, populate=False)

        # The own arrays first: where both are damaged, theirs is the error reported (as when read first).
        dests = _blank.filled([rec.nbytes for _, rec in own] + sizes, fill)
        for (li, rec), dest in zip(own, dests):
            arrays[li][rec.name] = dest.view(_entry.DTYPES[rec.dtype]).reshape(rec.shape)
        dests = dests[len(own) :]
    else:
        # A small restore fills numpy buffers and copies them into mlx at the end:
        # mlx's loader (_blank) costs more than copying a few hundred kB again.
        dests = [np.empty(n, np.uint8) for n in sizes] if small else _blank.blank(sizes)
        read(range(len(dests)), [np.asarray(d) for d in dests])
    for (li, rec), dest in zip(parted, dests):
        arr = mx.array(dest) if small else dest
        arrays[li][rec.name] = arr.view(_entry.DTYPES[rec.dtype]).reshape(rec.shape)


def _own_arrays(man: _entry.Manifest, arrays: List[Dict[str, Any]]) -> List[Tuple[int, _entry.ArrayRecord]]:
    """The entry's own arrays (those not in shared blocks) that hold bytes,
    as (layer, record); the empty ones are put into ``arrays`` here (mlx's
    loader makes no empty tensors)."""
    own = []
    for li, layer in enumerate(man.layers):
        for rec in layer.arrays:
            if rec.parts is not None:
                continue
            if rec.nbytes:
                own.append((li, rec))
            else:
                arrays[li][rec.name] = _payload.empty(rec)
    return own


def _one_pass(
    blob: int,
    man: _entry.Manifest,
    parted: Sequence[Tuple[int, _entry.ArrayRecord]],
    blocks_of: Callable[[int, np.ndarray], List["_Block"]],
    arrays: List[Dict[str, Any]],
    where: str,
) -> None:
    """A direct restore of an entry with its own arrays in blob file
    ``blob`` and the ``parted`` ones in shared blocks, in one pass: every
    array gets its room in one set of shared buffers (as
    :func:`_payload.read_file` places a payload), and the fill threads
    read them all in one set of lanes balanced by bytes, each own array
    checked against its checksum and each block against its address.
    ``blocks_of(i, dest)`` gives parted array ``i``'s blocks to read from
    files (and copies those in the map into ``dest``). Reading the payload
    first and then the blocks paid a second allocation of buffers and left
    each phase waiting on its slower thread.

    Raises:
        CorruptEntry: an own array or a block is damaged (an own array's
            error first), or a file ends early.
        StoreError: reading a file failed.
    """
    own = _own_arrays(man, arrays)
    recs = own + list(parted)
    place, sizes = _payload.rooms([rec.nbytes for _, rec in recs])
    bufs = _blank.blank(sizes)
    hosts = [np.asarray(b) for b in bufs]
    fresh = [not _fill.resident(h) for h in hosts]  # mincore here, not on the threads
    starts = [_payload.aligned(hosts[b], base, rec.offset if k < len(own) else 0) for k, ((b, base), (_, rec)) in enumerate(zip(place, recs))]
    views = [hosts[b][start : start + rec.nbytes] for (b, _), start, (_, rec) in zip(place, starts, recs)]
    tasks = [blocks_of(i, views[len(own) + i]) for i in range(len(parted))]
    digests = [0] * len(own)

    def run(lane: Sequence[int]) -> Optional[str]:
        err: Optional[str] = None
        for k in lane:
            if fresh[place[k][0]]:
                _fill.populate(views[k])
            if k < len(own):
                digests[k] = _fill.read_summed(blob, views[k], own[k][1].offset)
                continue
            if err is None:
                err = _read_tasks(tasks[k - len(own)])
        return err

    try:
        errors = _fill.in_lanes(run, _fill.balance([v.nbytes for v in views]))
    except _fill.ShortRead as err:
        raise CorruptEntry(f"{where}: {err}") from err
    except OSError as err:
        raise StoreError(f"{where}: reading a file failed: {err}") from err
    for k, (li, rec) in enumerate(own):
        _payload.verify(digests[k], li, rec, where)
    for message in errors:
        if message is not None:
            raise CorruptEntry(f"{where}: {message}")
    for (li, rec), (b, _), start in zip(recs, place, starts):
        arrays[li][rec.name] = bufs[b][start : start + rec.nbytes].view(_entry.DTYPES[rec.dtype]).reshape(rec.shape)


def _read_own(fd: int, host: np.ndarray, li: int, rec: _entry.ArrayRecord, where: str) -> None:
    """Read array ``rec`` of layer ``li`` from the entry's blob file ``fd``
    into ``host`` and check it against its checksum."""
    try:
        digest = _fill.read_summed(fd, host, rec.offset)
    except _fill.ShortRead as err:
        raise CorruptEntry(f"{where}: {err}") from err
    except OSError as err:
        raise StoreError(f"{where}: reading the blob file failed: {err}") from err
    _payload.verify(digest, li, rec, where)


@dataclass
class _Block:
    """One block to read: its address, what it holds, where it is (a buffer
    in the map, or a file) and its rows of the destination."""

    key: bytes
    kind: str
    version: int
    dtype: str
    shape: Tuple[int, ...]
    itemsize: int
    raw: Any
    rows: np.ndarray  # [rows, tokens, width] bytes, each row contiguous
    file: Optional[InFile] = None


def _read_one(t: _Block) -> Optional[str]:
    """Read block ``t`` from its file into its rows and check it; an error message, or None."""
    assert t.file is not None
    views = [row.reshape(-1).data for row in t.rows]
    head = _blocks.header(t.kind, t.version, t.dtype, t.shape)
    try:
        if _fill.available_128():  # read and hash each piece while it is in the CPU cache
            digest = _fill.read_hashed(t.file.fd, views, t.file.offset, head)
        else:
            _fill.read_into(t.file.fd, views, t.file.offset)
            digest = _blocks.address(t.kind, t.version, t.dtype, t.shape, t.rows)
    except _fill.ShortRead:
        return f"the file ends inside block {t.key.hex()}"
    return _mismatch(t, digest)


def _mismatch(t: _Block, digest: bytes) -> Optional[str]:
    if digest != t.key:
        return f"block {t.key.hex()} does not match its address (its bytes are damaged)"
    return None


def _read_run(run: Sequence[_Block]) -> Optional[str]:
    """Read blocks stored back to back in one file (:func:`_runs`) with one
    read, then check each; an error message (the first block's), or None."""
    first = run[0]
    assert first.file is not None
    if len(run) == 1 or not _fill.available_128():
        return next(filter(None, map(_read_one, run)), None)
    try:
        digests = _fill.read_run(first.file.fd, first.file.offset, [(t.rows, _blocks.header(t.kind, t.version, t.dtype, t.shape)) for t in run])
    except _fill.ShortRead:  # the file ends inside the run: block by block, to name the block
        return next(filter(None, map(_read_one, run)), None)
    return next(filter(None, map(_mismatch, run, digests)), None)


def _read_tasks(tasks: Sequence[_Block]) -> Optional[str]:
    """Read and check ``tasks`` (one destination's blocks in files), run by
    run (:func:`_runs`); the first error message, or None. Stops at it."""
    return next(filter(None, map(_read_run, _runs(tasks))), None)


def _runs(tasks: Sequence[_Block]) -> List[List[_Block]]:
    """``tasks`` (in order) cut into runs of blocks that follow each other in
    one file, each of at most :data:`~promptstore.format._fill.RUN` bytes
    (or one block) and :data:`~promptstore.format._fill.RUN_VIEWS` rows.
    The blocks a put wrote together lie back to back in its pack file."""
    runs: List[List[_Block]] = []
    after: Optional[Tuple[int, int]] = None  # (file, offset) right after the last block
    size = views = 0
    for t in tasks:
        assert t.file is not None
        n, r = t.rows.nbytes, t.rows.shape[0]
        if (t.file.fd, t.file.offset) != after or size + n > _fill.RUN or views + r > _fill.RUN_VIEWS:
            runs.append([])
            size = views = 0
        runs[-1].append(t)
        size += n
        views += r
        after = (t.file.fd, t.file.offset + n)
    return runs


def _read_blocks(groups: Sequence[Tuple[np.ndarray, List[_Block]]], where: str, threads: bool, populate: bool = True) -> None:
    """Read each block from its file into its destination rows and check it
    against its address (runs of blocks that follow each other in a file
    with one read, ``_read_run``). ``groups``: each destination (its
    bytes) with its blocks read from files; a destination not yet resident
    is populated first, in one call (as ``_fill`` does for payloads), unless
    ``populate`` is False. With ``threads``, on the fill threads (one lane
    per thread, balanced by the bytes of the blocks)."""

    fresh = {id(dest) for dest, _ in groups if populate and threads and not _fill.resident(dest)}  # mincore here, not on the threads

    def run(lane: Sequence[Tuple[np.ndarray, List[_Block]]]) -> Optional[str]:
        for dest, tasks in lane:
            if id(dest) in fresh:
                _fill.populate(dest)
            err = _read_tasks(tasks)
            if err is not None:
                return err
        return None

    try:
        if not threads:
            errors = [run(groups)]
        else:
            lanes = _fill.balance([sum(t.rows.nbytes for t in tasks) for _, tasks in groups])
            errors = _fill.in_lanes(lambda lane: run([groups[k] for k in lane]), lanes)
    except OSError as exc:
        raise StoreError(f"{where}: reading a block failed: {exc}") from exc
    for err in errors:
        if err is not None:
            raise CorruptEntry(f"{where}: {err}")
