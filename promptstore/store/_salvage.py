"""Salvage: copy every intact entry of a (possibly damaged) store into a fresh one.

The source is opened read-only without its lock file (a damaged store may
have a damaged lock file too, and salvage must never write to it). Entry keys
are gathered from every table that names them, each table read on its own, so
a broken B-tree in one table does not hide entries that another still lists.
Every candidate is fully checked (manifest, key, checksums, decode) before its
raw records are copied; the copy keeps the entry's bytes, times and pin as
they were.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import List, Set, Tuple

import lmdb

from promptstore.format import _blobs, _entry
from promptstore.store import _budget, _keys
from promptstore.store._env import DBS, live_dir, pages_needed
from promptstore.errors import InvalidInput, PromptStoreError, StoreUnavailable


@dataclass(frozen=True)
class SalvageReport:
    """Outcome of :func:`salvage`."""

    src: str
    dst: str
    copied: Tuple[str, ...]  # entry ids copied intact
    skipped: Tuple[Tuple[str, str], ...]  # (entry id, why) left behind
    unreadable_tables: Tuple[str, ...]  # tables whose walk failed part way


def _open_source(src: Path, scratch: Path):
    where, _ = live_dir(src)
    if not (where / "data.mdb").exists():
        raise StoreUnavailable(f"{src}: no data.mdb in {where}; nothing to salvage")
    try:
        env = _open_raw(where)
        if (where / "data.mdb").stat().st_size < pages_needed(env):
            # Truncated: reading past the end would kill us with SIGBUS. Read a
            # copy padded with zero pages instead (LMDB reports those as corrupt).
            env.close()
            scratch.mkdir(parents=True)
            shutil.copyfile(where / "data.mdb", scratch / "data.mdb")
            env = _open_raw(scratch)
            need = pages_needed(env)
            env.close()
            os.truncate(scratch / "data.mdb", need)
            env = _open_raw(scratch)
    except lmdb.Error as err:
        raise StoreUnavailable(
            f"{where}/data.mdb cannot be opened ({err}); its header pages are damaged beyond what salvage "
            "can read: restore the directory from a backup or remove it"
        ) from err
    env_dbs = {}
    for name in DBS:
        try:
            env_dbs[name] = env.open_db(name, create=False, dupsort=name == b"ends")
        except lmdb.Error:
            pass
    dbs = env_dbs
    if b"entries" not in dbs or b"chunks" not in dbs:
        env.close()
        raise StoreUnavailable(f"{where}/data.mdb: its table directory is damaged; nothing can be salvaged")
    return env, dbs


def _open_raw(where: Path):
    return lmdb.open(str(where), readonly=True, lock=False, max_dbs=len(DBS) + 1, subdir=True, create=False)


def _candidates(env, dbs) -> Tuple[List[bytes], List[str]]:
    found: Set[bytes] = set()
    broken: List[str] = []
    walks = {b"entries": lambda k, v: k, b"used": lambda k, v: k, b"sizes": lambda k, v: k,
             b"pins": lambda k, v: k, b"ids": lambda k, v: v, b"chunks": lambda k, v: k[:36]}
    for name, pick in walks.items():
        if name not in dbs:
            continue
        try:
            with env.begin() as txn:
                for k, v in txn.cursor(db=dbs[name]):
                    key = bytes(pick(bytes(k), bytes(v)))
                    if len(key) == 36:
                        found.add(key)
        except Exception:  # a damaged page ends this walk; the other tables may still list the rest
            broken.append(name.decode())
    return sorted(found), broken


def _read_entry(env, dbs, ekey: bytes, src: Path):
    """``(raw manifest, chunks, last used, pinned)`` of an intact entry."""
    where = f"{src} entry {_keys.entry_id(ekey)}"
    with env.begin(buffers=True) as txn:
        raw = txn.get(ekey, db=dbs[b"entries"])
        if raw is None:
            raise PromptStoreError("no manifest (never committed, or its page is lost)")
        raw = bytes(raw)
        man = _entry.unpack_manifest(raw, where)
        if man.entry_id != _keys.entry_id(ekey) or _keys.entry_key(_keys.model_id(man.model), man.tokens) != ekey:
            raise PromptStoreError("manifest does not match its key")
        if man.blob is not None:
            arrays = _blobs.Blobs(src).read(man, where)
            chunks = []
        else:
            chunks = [txn.get(ekey + _keys.u32(i), db=dbs[b"chunks"]) for i in range(man.chunks)]
            arrays = _entry.read_arrays(man, lambda i: chunks[i], where)
        _entry.decode_layers(man, arrays, where)
        if not man.intact:
            raise PromptStoreError("manifest checksum mismatch")
        chunks = [bytes(c) for c in chunks]
        used = txn.get(ekey, db=dbs[b"used"]) if b"used" in dbs else None
        pinned = b"pins" in dbs and txn.get(ekey, db=dbs[b"pins"]) is not None
    return raw, man, chunks, (bytes(used) if used is not None else None), pinned


def salvage(src, dst) -> SalvageReport:
    """Copy every intact entry of the store at ``src`` into a new store at ``dst``.

    The source is only read. Damaged entries and anything unreadable are
    skipped and listed. The budget of the source, when readable, is set on
    the new store without evicting anything.

    Raises:
        InvalidInput: ``dst`` exists and is not empty.
        StoreUnavailable: the source cannot be opened at all (the message says why).
    """
    from promptstore.store import PromptStore

    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if dst.exists() and any(dst.iterdir()):
        raise InvalidInput(f"{dst} exists and is not empty; salvage writes into a fresh directory")
    scratch = dst.parent / f".{dst.name}.salvage-src"
    shutil.rmtree(scratch, ignore_errors=True)
    env, dbs = _open_source(src, scratch)
    copied: List[str] = []
    skipped: List[Tuple[str, str]] = []
    try:
        ekeys, broken = _candidates(env, dbs)
        budget = None
        try:
            with env.begin() as txn:
                budget = _budget.get_budget(txn, dbs)
        except Exception:
            pass
        with PromptStore(dst) as out:
            for ekey in ekeys:
                eid = _keys.entry_id(ekey)
                try:
                    raw, man, chunks, used, pinned = _read_entry(env, dbs, ekey, src)
                except Exception as err:  # lmdb errors on damaged pages included: skip, keep going
                    skipped.append((eid, f"{type(err).__name__}: {err}"))
                    continue
                out.env.write(lambda txn: _copy_in(out, txn, ekey, raw, man, chunks, used, pinned, src))
                copied.append(eid)
            if budget is not None:
                out.env.write(lambda txn: txn.put(_budget.BUDGET, _budget._U64.pack(budget), db=out._db[b"info"]))
    finally:
        env.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return SalvageReport(str(src), str(dst), tuple(copied), tuple(skipped), tuple(broken))


def _copy_in(out, txn, ekey, raw, man, chunks, used, pinned, src: Path) -> None:
    db = out._db
    if man.blob is not None and not out._blobs.path(man.blob).exists():
        out._blobs.copy_in(_blobs.Blobs(src).path(man.blob), man.blob)  # under the writer lock, as a put
    for i, c in enumerate(chunks):
        txn.put(ekey + _keys.u32(i), c, db=db[b"chunks"])
    hashes = _keys.prefix_hashes(man.tokens)
    if hasattr(out, "_index_add"):
        out._index_add(txn, ekey[:16], hashes, len(man.tokens), ekey, man.trimmable)
    else:  # the prefix index moved to promptstore.store._index
        from promptstore.store import _index

        _index.add(txn, db, ekey[:16], man.tokens, hashes, ekey, man.trimmable)
    if used is not None and len(used) == 8:
        txn.put(ekey, used, db=db[b"used"])
    txn.put(_keys.entry_id(ekey).encode(), ekey, db=db[b"ids"])
    txn.put(ekey, _budget._U64.pack(man.payload + len(raw)), db=db[b"sizes"])
    txn.put(_budget.USAGE, _budget._U64.pack(_budget.usage(txn, db) + man.payload + len(raw)), db=db[b"info"])
    if pinned:
        txn.put(ekey, b"", db=db[b"pins"])
    txn.put(ekey, raw, db=db[b"entries"])


__all__ = ["salvage", "SalvageReport"]
