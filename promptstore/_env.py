"""The LMDB environment: opening, transactions, map growth, error translation.

Facts this module encodes (measured, see DESIGN.md):
* ``map_size`` is only address space: it starts large; on ``MapFullError``
  the map doubles and the write is retried; other processes then see
  ``MapResizedError`` on their next transaction and adopt the new size with
  ``set_mapsize(0)``.
* ``reader_check()`` on open clears reader slots of dead processes, whose
  stale snapshots would otherwise block page reuse forever.
* An environment must never cross ``fork()``: every call checks the pid.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import lmdb

from promptstore.errors import StoreError, StoreFull, StoreUnavailable

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; grows on demand
MAX_MAP_SIZE = 1 << 46
DBS = (b"entries", b"chunks", b"nodes", b"ends", b"used", b"ids", b"info")
_DUPSORT = {b"ends"}


class Env:
    """One open LMDB environment with the promptstore tables."""

    def __init__(self, path: Path, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False):
        self.path = path
        self.pid = os.getpid()
        try:
            if not readonly:
                path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=len(DBS) + 1,
                max_readers=1024,
                readonly=readonly,
                create=not readonly,
                subdir=True,
                max_spare_txns=4,
            )
        except lmdb.Error as err:
            raise translate(err, path, "open") from err
        except OSError as err:
            raise StoreUnavailable(f"{path}: cannot open store ({err}); check the path and permissions") from err
        try:
            self.env.reader_check()
            self.db = {}
            with self.begin(write=not readonly) as txn:
                for name in DBS:
                    self.db[name] = self.env.open_db(
                        name, txn=txn, create=not readonly, dupsort=name in _DUPSORT
                    )
        except lmdb.Error as err:
            self.env.close()
            raise translate(err, path, "open") from err

    def check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise StoreUnavailable(
                f"{self.path}: this PromptStore was opened in process {self.pid} and is used in "
                f"{os.getpid()}; LMDB environments cannot cross fork(): open a new PromptStore in the child"
            )

    def begin(self, write: bool = False, buffers: bool = False) -> lmdb.Transaction:
        self.check_pid()
        for _ in range(3):
            try:
                return self.env.begin(write=write, buffers=buffers)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)  # another process grew the map: adopt its size
            except lmdb.Error as err:
                raise translate(err, self.path, "begin transaction") from err
        raise StoreUnavailable(f"{self.path}: the map kept being resized by other processes; retry")

    @contextmanager
    def read(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A short read transaction. Buffers from it die with it."""
        txn = self.begin(buffers=buffers)
        try:
            yield txn
        except lmdb.Error as err:
            raise translate(err, self.path, "read") from err
        finally:
            txn.abort()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn(txn)`` in a write transaction and commit; grow the map and
        retry when it is full. All or nothing: on error nothing is written."""
        while True:
            txn = self.begin(write=True)
            try:
                result = fn(txn)
                txn.commit()
                return result
            except lmdb.MapFullError as err:
                txn.abort()
                size = self.env.info()["map_size"]
                if size * 2 > MAX_MAP_SIZE:
                    raise StoreFull(
                        f"{self.path}: LMDB map of {size} bytes is full; delete entries or run "
                        "`promptstore gc`"
                    ) from err
                self.env.set_mapsize(size * 2)
            except lmdb.Error as err:
                txn.abort()
                raise translate(err, self.path, "write") from err
            except BaseException:
                txn.abort()
                raise

    def close(self) -> None:
        if os.getpid() == self.pid:
            self.env.close()


def translate(err: lmdb.Error, path: Path, stage: str) -> StoreError:
    """Turn an lmdb error into a promptstore StoreError with a hint."""
    code = getattr(err, "errno", None)
    text = str(err)
    if isinstance(err, lmdb.MapFullError):
        return StoreFull(f"{path}: {stage}: LMDB map is full; delete entries or run `promptstore gc`")
    if code == errno.ENOSPC or "No space left" in text or isinstance(err, lmdb.DiskError):
        return StoreFull(f"{path}: {stage}: the disk is full ({text}); free space or lower the budget")
    if isinstance(err, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)):
        return StoreUnavailable(
            f"{path}: {stage}: the store file is damaged ({text}); salvage intact entries with "
            "`promptstore salvage` or remove the directory"
        )
    if isinstance(err, lmdb.ReadonlyError):
        return StoreUnavailable(f"{path}: {stage}: the store is read-only ({text})")
    return StoreError(f"{path}: {stage}: {type(err).__name__}: {text}")
