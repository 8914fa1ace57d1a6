"""The highest page an LMDB data file's trees use, read from the file itself.

LMDB's newest meta page records ``last_pgno``, the highest page number the
environment has handed out, but a page handed out is not always written: a
transaction that allocates pages at the end of the file and frees them again
before it commits (an eviction that deletes many entries does) leaves them
free and unwritten, so the file may end before ``last_pgno`` while every page
its trees use is inside it. Opening must tell that apart from a file cut
short, which would kill the process with SIGBUS when LMDB touches a page past
its end. :func:`pages_in_use` walks the trees of one meta page (the free list's
and the main table's, every named table and every table of duplicates below
them, and the overflow pages of large values) with ``pread``, so a page past
the end is seen, never touched through the map.

Only the LMDB 0.9 layout on 64-bit machines is read (what py-lmdb bundles):
16-byte page headers, 48-byte table records, meta pages 0 and 1.

The store folder's generations live here too: ``CURRENT``, which names the
live one, and the file work of a compaction (copy, switch, removal of the
old ones), which ``Env.compact`` runs under the locks it holds
(``promptstore.store._env`` explains the scheme).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, List, Optional, Set, Tuple

from promptstore._paths import durable
from promptstore.errors import StoreUnavailable

_HEADER = 16  # pgno u64, pad u16, flags u16, lower/upper u16 (or overflow page count u32)
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_INVALID = (1 << 64) - 1  # the root of an empty table
_MAGIC = 0xBEEFC0DE
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
_META = 16  # the meta record's offset in its page
_FREE_DB, _MAIN_DB = _META + 24, _META + 24 + _DB.size
_TXNID = _MAIN_DB + _DB.size + 8  # after the two tables and last_pgno


class Damaged(Exception):
    """The file's pages do not read as LMDB trees (or reach past its end)."""


def _root(raw: bytes, at: int) -> Optional[int]:
    root = _DB.unpack_from(raw, at)[7]
    return None if root == _INVALID else root


def pages_in_use(path: os.PathLike, psize: int, txnid: int) -> Optional[int]:
    """How many pages the file at ``path`` must hold for the trees of its
    meta page of transaction ``txnid``: one more than the highest page they
    use; None when neither meta page is that transaction's any more (a writer
    committed twice since: look again). Raise :class:`Damaged` when a page
    they use is past the end of the file, or is not what its parent says.

    The caller holds a read transaction of ``txnid``, so that no writer
    reuses the pages being read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        pages = size // psize

        def page(pgno: int) -> bytes:
            if pgno >= pages:
                raise Damaged(f"page {pgno} is past the end of the file ({pages} pages)")
            raw = os.pread(fd, psize, pgno * psize)
            if len(raw) != psize:
                raise Damaged(f"page {pgno} reads short")
            return raw

        roots: List[int] = []
        for slot in (0, 1):
            meta = page(slot)
            if struct.unpack_from("<I", meta, _META)[0] == _MAGIC and struct.unpack_from("<Q", meta, _TXNID)[0] == txnid:
                roots = [r for r in (_root(meta, _FREE_DB), _root(meta, _MAIN_DB)) if r is not None]
                break
        else:
            return None
        highest = 1
        seen: Set[int] = set()
        todo = list(roots)
        while todo:
            pgno = todo.pop()
            if pgno < 2:
                raise Damaged(f"a tree points at meta page {pgno}")
            if pgno in seen:
                continue
            seen.add(pgno)
            if len(seen) > pages:
                raise Damaged("the trees have more pages than the file")
            raw = page(pgno)
            flags = struct.unpack_from("<H", raw, 10)[0]
            highest = max(highest, pgno)
            if flags & _P_LEAF2:
                continue  # fixed-size keys of a table of duplicates: nothing below
            lower = struct.unpack_from("<H", raw, 12)[0]
            if lower < _HEADER or lower > psize or not flags & (_P_BRANCH | _P_LEAF):
                raise Damaged(f"page {pgno} is not a branch or leaf page (flags {flags:#x})")
            for i in range((lower - _HEADER) // 2):
                node = struct.unpack_from("<H", raw, _HEADER + 2 * i)[0]
                if node + 8 > psize:
                    raise Damaged(f"page {pgno}: node {i} is outside the page")
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", raw, node)
                if flags & _P_BRANCH:
                    todo.append(lo | hi << 16 | nflags << 32)
                    continue
                data = node + 8 + ksize
                if nflags & _F_BIGDATA:
                    first = struct.unpack_from("<Q", raw, data)[0]
                    head = page(first)
                    if not struct.unpack_from("<H", head, 10)[0] & _P_OVERFLOW:
                        raise Damaged(f"page {first} is not an overflow page")
                    count = struct.unpack_from("<I", head, 12)[0]
                    last = first + max(count, 1) - 1
                    if last >= pages:
                        raise Damaged(f"overflow pages {first}-{last} reach past the end of the file ({pages} pages)")
                    highest = max(highest, last)
                elif nflags & _F_SUBDATA:  # a named table, or a table of one key's duplicates
                    if data + _DB.size > psize:
                        raise Damaged(f"page {pgno}: node {i} is outside the page")
                    root = _root(raw, data)
                    if root is not None:
                        todo.append(root)
                # else: the value is in the node (F_DUPDATA alone: a sub-page of duplicates, inside it)
        return highest + 1
    finally:
        os.close(fd)


CURRENT = "CURRENT"  # names the live generation's directory (``Env``, compaction)

# Compaction's file work (``Env.compact`` holds the locks): a generation is
# a directory ``gen-N`` holding ``data.mdb`` and ``lock.mdb`` (generation 0
# is the store folder's own two files), and ``CURRENT`` names the live one.


def make_store_dir(store: Path) -> None:
    """Create the store folder ``store`` (and its parents) if it is not there.

    Raises:
        StoreUnavailable: it cannot be made; a dangling symbolic link is named as one.
    """
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if store.is_symlink() and not store.exists():
            raise StoreUnavailable(
                f"{store}: a symbolic link to {os.readlink(store)}, which does not exist; create that folder or remove the link"
            ) from err
        raise StoreUnavailable(f"{store}: cannot create the store directory ({err}); check the path and permissions") from err


def copy_generation(env: Any, txn: Any, store: Path, n: int) -> Tuple[str, int]:
    """Copy the snapshot ``txn`` of the LMDB environment ``env`` compactly
    into generation ``n`` of the store folder ``store`` (a directory left
    there by an earlier, interrupted compaction is replaced), its data file
    synced; return the generation's name and its data file's size. Nothing
    reads it until :func:`switch_current` names it.

    Raises:
        OSError, lmdb.Error: the copy failed (the caller reports it).
    """
    name = f"gen-{n}"
    where = store / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    env.copy(str(where), compact=True, txn=txn)
    durable(where / "data.mdb")
    return name, (where / "data.mdb").stat().st_size


def switch_current(store: Path, name: str) -> None:
    """Make generation ``name`` the live one of the store folder ``store``,
    durably: ``CURRENT`` is written beside its old self under this
    process's name (``CURRENT.<pid>.tmp``, which :func:`sweep_pointers`
    removes once its process is dead), synced, renamed over it, and the
    folder synced."""
    tmp = store / f"{CURRENT}.{os.getpid()}.tmp"
    tmp.write_text(name + "\n")
    durable(tmp)
    os.replace(tmp, store / CURRENT)
    durable(store)


def remove_generations(store: Path, upto: int) -> None:
    """Unlink generation 0 and ``gen-1`` .. ``gen-<upto>`` of the store
    folder ``store``, and stray ``CURRENT`` files (mappings other processes
    hold stay valid until they follow ``CURRENT``)."""
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.unlink(store / name)
        except FileNotFoundError:
            pass
    for d in store.glob("gen-*"):
        suffix = d.name[4:]
        if suffix.isdigit() and int(suffix) <= upto and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    sweep_pointers(store)


def live_dir(path: Path) -> Tuple[Path, str]:
    """The directory of the live generation and its name ("." for generation 0)."""
    try:
        name = (path / CURRENT).read_text().strip()
    except FileNotFoundError:
        return path, "."
    except OSError as err:
        raise StoreUnavailable(f"{path}: cannot read {CURRENT} ({err}); check permissions") from err
    if name != "." and not (name.startswith("gen-") and name[4:].isdigit()):
        raise StoreUnavailable(
            f"{path}/{CURRENT} names {name!r}, not a generation; restore it (e.g. `echo gen-1 > {CURRENT}` "
            "naming the newest gen-N directory) or salvage with `promptstore salvage`"
        )
    return (path if name == "." else path / name), name


def live_data_size(store: Path) -> int:
    """Bytes of the live generation's ``data.mdb`` of the store at ``store``,
    followed through ``CURRENT`` (another process's compaction moves it).

    Raises:
        StoreUnavailable: it is not found, time after time.
    """
    for _ in range(8):
        try:
            return (live_dir(store)[0] / "data.mdb").stat().st_size
        except FileNotFoundError:  # CURRENT read just before a compaction moved on
            time.sleep(0.01)
    raise StoreUnavailable(f"{store}: the live generation's data file is not found; another process may be compacting the store")


def sweep_pointers(path: Path) -> None:
    """Unlink the ``CURRENT.<pid>.tmp`` files that compactions killed before
    their rename left in store folder ``path`` (those of live processes are
    theirs to rename)."""
    for tmp in path.glob(f"{CURRENT}.*.tmp"):
        pid = tmp.name[len(CURRENT) + 1 : -len(".tmp")]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # another user's live process
            continue
