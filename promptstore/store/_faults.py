"""LMDB's failures turned into the store's typed errors, with what to do.

A full disk (ENOSPC) and a file-size limit (EFBIG) both reach Python as
``mdb_txn_commit: Input/output error``; a failed commit is probed to tell
them from a real I/O error (reproduced when this was written), and both
become :class:`StoreFull`. A damaged or truncated file becomes
:class:`StoreUnavailable` naming ``promptstore salvage``.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path
from typing import Any, Dict, Optional

import lmdb

from promptstore.errors import StoreError, StoreFull, StoreUnavailable
from promptstore.store import _lmdbfile
from promptstore.store._schema import DUPSORT, OPTIONAL, TABLES

_PROBE = 8 << 20  # bytes a failed commit's probe tries to reserve


def pages_needed(env: lmdb.Environment) -> int:
    """Bytes data.mdb must have for every page the newest meta page uses."""
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def check_size(env: lmdb.Environment, where: Path) -> None:
    """Refuse a truncated data.mdb: LMDB would touch pages past its end and
    the process would die of SIGBUS (reproduced on LMDB 0.9.x).

    A file shorter than LMDB's last page number is not always cut short:
    pages a transaction took at the end and freed again are never written.
    So a short file is read page by page (``_lmdbfile``), and refused only
    when a page its trees use is past its end."""
    need = pages_needed(env)  # first: a commit since only grows the file, never shrinks it
    data = where / "data.mdb"
    try:
        have = data.stat().st_size
    except OSError:
        return
    if have >= need:
        return
    psize = env.stat()["psize"]
    why = f"its pages reach {need}"
    for _ in range(8):
        with env.begin() as txn:  # holds the snapshot's pages while they are read
            try:
                used = _lmdbfile.pages_in_use(data, psize, txn.id())
            except (_lmdbfile.Damaged, OSError) as err:
                why = f"{err}"
                break
        if used is not None:
            return  # the pages past the end are free ones LMDB never wrote
    raise StoreUnavailable(
        f"{data} is truncated: {have} bytes, but {why}; copy the intact "
        f"entries out with `promptstore salvage {where} NEW_DIR`, or restore the file from a backup"
    )


def check_tables(env: lmdb.Environment, where: Path) -> None:
    """Refuse an LMDB database of something else: a data file whose main
    table holds names but none of the store's tables. Left alone, a read
    would fail on a missing table with LMDB's "MDB_NOTFOUND", and a write
    would add the store's tables to the other program's file."""
    with env.begin() as txn:
        names = [bytes(key) for key in txn.cursor().iternext(keys=True, values=False)]
    if names and not set(names) & set(TABLES):
        shown = ", ".join(repr(n.decode("utf-8", "replace")) for n in names[:5]) + (", ..." if len(names) > 5 else "")
        raise StoreUnavailable(
            f"{where / 'data.mdb'} is an LMDB database, but not a promptstore store (its keys: {shown}); "
            "check the --store path"
        )


def _disk_full(where: Path) -> Optional[str]:
    """Why a failed commit in ``where`` was (probably) out of space, or None."""
    try:
        st = os.statvfs(where)
        free = min(st.f_bavail, st.f_bfree) * st.f_frsize
        if free < _PROBE:
            return f"only {free} bytes free on the disk"
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        data = where / "data.mdb"
        if soft != resource.RLIM_INFINITY and data.exists() and data.stat().st_size + _PROBE > soft:
            return f"the process file-size limit (ulimit -f) of {soft} bytes is reached"
        probe = where / f".space-probe.{os.getpid()}"
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, _PROBE)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                return f"no room for {_PROBE} more bytes ({os.strerror(err.errno)})"
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError:
        return None
    return None


def translate(err: lmdb.Error, path: Path, stage: str) -> StoreError:
    """Turn an lmdb error into a promptstore StoreError with a hint."""
    code = getattr(err, "errno", None)
    text = str(err)
    if isinstance(err, lmdb.MapFullError):
        return StoreFull(f"{path}: {stage}: LMDB map is full; delete entries or run `promptstore gc`")
    if code in (errno.ENOSPC, errno.EFBIG) or "No space left" in text or "too large" in text or isinstance(err, lmdb.DiskError):
        return StoreFull(f"{path}: {stage}: the disk is full ({text}); free space or lower the budget")
    if "Input/output error" in text:
        why = _disk_full(path)
        if why is not None:
            return StoreFull(
                f"{path}: {stage}: {why}; nothing of this write was kept. Free disk space, "
                "lower the budget (`promptstore gc --budget`) or `promptstore compact`"
            )
    if isinstance(err, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)):
        return StoreUnavailable(
            f"{path}: {stage}: the store file is damaged ({text}); salvage intact entries with "
            "`promptstore salvage` or remove the directory"
        )
    if isinstance(err, lmdb.ReadonlyError):
        return StoreUnavailable(f"{path}: {stage}: the store is read-only ({text})")
    return StoreError(f"{path}: {stage}: {type(err).__name__}: {text}")


def open_tables(env: lmdb.Environment, where: Path, readonly: bool) -> Dict[bytes, Any]:
    """Check a freshly opened environment and open its tables."""
    check_size(env, where)
    env.reader_check()
    check_tables(env, where)
    db = {}
    if readonly:
        # py-lmdb ends a read transaction by aborting it, which would leave
        # handles opened in it invalid: let open_db run its own transaction.
        for dbname in TABLES:
            try:
                db[dbname] = env.open_db(dbname, create=False, dupsort=dbname in DUPSORT)
            except lmdb.NotFoundError:
                if dbname in OPTIONAL:  # a store older than these tables
                    continue
                raise
    else:
        with env.begin(write=True) as txn:
            for dbname in TABLES:
                db[dbname] = env.open_db(dbname, txn=txn, create=True, dupsort=dbname in DUPSORT)
    return db
