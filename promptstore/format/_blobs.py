"""Blob files: the payloads of large entries, beside the LMDB environment.

LMDB without ``writemap`` copies a value twice on its way to disk: into a
malloc'd dirty page at ``put`` (every page a fresh page fault, as glibc hands
such blocks back to the kernel after the commit) and into the page cache at
commit. A plain file write copies once, and the first copy's page faults
made a large durable put through LMDB much slower than a file write and
fsync of the same bytes (measured in docs/performance.md). So a payload of
at least :data:`MIN_PAYLOAD` bytes is written to a file of its own in
``<store>/blobs/`` and the entry's manifest (format 2), still in LMDB,
names it; smaller entries stay in LMDB.

The rules that keep this as safe as an entry inside LMDB:

- A blob file is created, written and fsynced (and the directory with it)
  inside the write transaction that commits its manifest, so while the
  writer lock is held. A crash before the commit leaves an unreferenced file
  and nothing visible; ``gc`` and ``verify --fix`` remove such files, also
  under the writer lock, so never the file of a put in flight. A name, once
  unreferenced, never is again: a put whose transaction is retried writes
  a new file.
- A blob file is unlinked only after the transaction that dropped its
  manifest has committed (``Env.after_commit``); a crash in between leaves
  an unreferenced file, removed the same way.
- Names are never reused (entry id plus 64 random bits), so a reader that
  found a manifest either opens that entry's bytes or finds no file
  (:class:`Vanished`: the entry was deleted or replaced since its snapshot).
- The manifest keeps the per-array xxh3 checksums and the payload size, so
  flipped and truncated bytes in a blob file are detected like those in
  LMDB. Chunk ``i`` of the payload is at offset ``i * CHUNK`` of the file.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence

from promptstore._paths import durable
from promptstore.format import _entry, _fill, _pages, _payload
from promptstore.errors import CorruptEntry, StoreError, StoreFull

log = logging.getLogger("promptstore")

MIN_PAYLOAD = 1 << 20  # a payload this large goes to a blob file
DIRNAME = "blobs"
WRITEBACK = 4 << 20  # start writing back every this many bytes written
_SYNC_FILE_RANGE_WRITE = 2


class Vanished(CorruptEntry):
    """A manifest's blob file is not there: the entry was deleted or replaced
    after the reader's snapshot was taken, or the file was lost. A second
    look, at a snapshot taken after the first one failed, tells which: a
    blob is unlinked only after the commit that dropped its manifest, so a
    newer snapshot that still names it means the file is lost. Callers that
    do not look again report it as the CorruptEntry it then is."""

    def __init__(self, message: str, blob: str):
        super().__init__(message)
        self.blob = blob


def new_name(entry_id: str) -> str:
    return f"{entry_id}-{secrets.token_hex(8)}{_entry.BLOB_SUFFIX}"


_IOV_MAX = 1024  # iovecs per writev (Linux's IOV_MAX)


def _write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` back to back, with ``writev`` (many small views, such
    as the rows of a file's blocks, in one call), starting the disk write of
    every :data:`WRITEBACK` bytes as soon as they are in the page cache
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux; it does not wait),
    so the device writes while later bytes are still being copied and the
    final fsync waits only for the tail. The fsync stays what makes the file
    durable; what early writeback saves is in docs/performance.md."""
    start = _pages._sync_file_range
    done = flushed = 0
    for batch in _batches(views):
        while batch:
            wrote = os.writev(fd, batch)
            done += wrote
            batch = _skip(batch, wrote)
        if start is not None and done - flushed >= WRITEBACK:
            start(fd, flushed, done - flushed, _SYNC_FILE_RANGE_WRITE)  # a hint: errors show at fsync
            flushed = done


def _batches(views: Sequence[memoryview]) -> Iterator[List[memoryview]]:
    """``views`` cut and grouped into runs of at most :data:`WRITEBACK`
    bytes and :data:`_IOV_MAX` pieces, in order."""
    batch: List[memoryview] = []
    size = 0
    for view in views:
        view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        pos = 0
        while pos < view.nbytes:
            take = min(view.nbytes - pos, WRITEBACK - size)
            batch.append(view[pos : pos + take])
            size += take
            pos += take
            if size == WRITEBACK or len(batch) == _IOV_MAX:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _skip(batch: List[memoryview], n: int) -> List[memoryview]:
    """What is left of ``batch`` once its first ``n`` bytes are written."""
    while batch and n >= batch[0].nbytes:
        n -= batch[0].nbytes
        batch = batch[1:]
    if batch and n:
        batch = [batch[0][n:]] + batch[1:]
    return batch


class Blobs:
    """The blob files of one store (``<store>/blobs``); with other arguments,
    another directory of files written the same way (``format._packs``)."""

    def __init__(self, root: Path, dirname: str = DIRNAME, is_name: Callable[[str], bool] = _entry._blob_name, what: str = "blob file"):
        self.root = root
        self.dir = root / dirname
        self._is_name = is_name
        self.what = what

    def path(self, name: str) -> Path:
        return self.dir / name

    def _ensure_dir(self) -> None:
        if self.dir.is_dir():
            return
        self.dir.mkdir(exist_ok=True)
        durable(self.root)

    def write(self, name: str, views: Sequence[memoryview]) -> None:
        """Write the payload ``views`` (back to back) to a new blob file and
        make it durable: file and directory are fsynced on return.

        Raises:
            StoreFull: the disk is full (the partial file is removed).
            StoreError: anything else failed (likewise).
        """
        path = self.path(name)
        try:
            self._ensure_dir()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise self._error(err, "create") from err
        try:
            try:
                _write_all(fd, views)
                os.fsync(fd)
            finally:
                os.close(fd)
            durable(self.dir)
        except BaseException as err:
            self.unlink(name)
            if isinstance(err, OSError):
                raise self._error(err, "write") from err
            raise

    def _error(self, err: OSError, what: str) -> StoreError:
        if err.errno == errno.EFBIG:
            why = "the file is over the process file-size limit (ulimit -f) or the filesystem's"
        elif err.errno == errno.EDQUOT:
            why = "disk quota exceeded"
        elif err.errno == errno.ENOSPC:
            why = "no room left on the disk"
        else:
            return StoreError(f"{self.dir}: cannot {what} a {self.what} ({err}); nothing was written")
        return StoreFull(f"{self.dir}: cannot {what} a {self.what}: {why}; nothing was written; free space or run `promptstore gc`")

    def copy_in(self, src: Path, name: str) -> None:
        """Copy the blob file ``src`` (of another store) in as ``name``, durably."""
        try:
            with open(src, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
        except OSError as err:
            raise StoreError(f"{src}: cannot read blob file ({err})") from err
        try:
            view = memoryview(mm) if mm is not None else memoryview(b"")
            try:
                self.write(name, [view])
            finally:
                view.release()
        finally:
            if mm is not None:
                mm.close()

    def unlink(self, name: str) -> None:
        """Remove a blob file, best effort: one that cannot be removed stays
        for ``gc`` (logged)."""
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("promptstore: cannot remove %s %s (%s); `promptstore gc` retries", self.what, self.path(name), err)

    def names(self) -> List[str]:
        """The files present. Raises StoreError when the directory cannot be
        listed (never an empty answer then: gc must not take it for empty)."""
        try:
            return [n for n in os.listdir(self.dir) if self._is_name(n)]
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StoreError(f"{self.dir}: cannot list {self.what}s ({err}); check that it is a directory this user can read") from err

    def sizes(self) -> Dict[str, int]:
        """Each file present and its size (a file unlinked meanwhile is left out)."""
        out: Dict[str, int] = {}
        for name in self.names():
            try:
                out[name] = os.stat(self.path(name)).st_size
            except FileNotFoundError:
                pass
        return out

    def nbytes(self) -> int:
        """Bytes the files take (their sizes)."""
        return sum(self.sizes().values())

    def read(self, man: _entry.Manifest, where: str) -> List[Dict[str, Any]]:
        """The payload arrays of ``man``'s blob, checked against the manifest.

        Raises:
            Vanished: no such file.
            CorruptEntry: wrong size or a checksum mismatch.
            StoreError: reading failed.
        """
        with self.opened(man, where) as fd:
            if _fill.available():
                return _payload.read_file(man, fd, [i * _entry.CHUNK for i in range(man.chunks)], where)
            return self._read_mapped(man, fd, where)

    @contextmanager
    def opened(self, man: _entry.Manifest, where: str) -> Iterator[int]:
        """A read-only descriptor of ``man``'s blob file, of the size the
        manifest says (the payload lies in it back to back, from offset 0).

        Raises:
            Vanished: no such file.
            CorruptEntry: wrong size.
            StoreError: it cannot be opened.
        """
        assert man.blob is not None
        try:
            fd = os.open(self.path(man.blob), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as err:
            raise Vanished(f"{where}: blob file {man.blob} is missing", man.blob) from err
        except OSError as err:
            raise StoreError(f"{where}: cannot open blob file {man.blob} ({err})") from err
        try:
            size = os.fstat(fd).st_size
            if size != man.payload:
                raise CorruptEntry(f"{where}: blob file {man.blob} has {size} bytes, the manifest says {man.payload}")
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _read_mapped(man: _entry.Manifest, fd: int, where: str) -> List[Dict[str, Any]]:
        if man.payload == 0:
            return _payload.read_mapped(man, [], where)
        mm = mmap.mmap(fd, man.payload, prot=mmap.PROT_READ)
        try:
            whole = memoryview(mm)
            bufs = [whole[i * _entry.CHUNK : (i + 1) * _entry.CHUNK] for i in range(man.chunks)]
            try:
                return _payload.read_mapped(man, bufs, where)
            finally:
                for b in bufs:
                    b.release()
                whole.release()
        finally:
            mm.close()
