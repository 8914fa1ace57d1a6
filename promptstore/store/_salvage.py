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
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import lmdb

from promptstore._paths import store_path
from promptstore.errors import InvalidInput, PromptStoreError, StoreUnavailable, UnknownStorageKind, UnsupportedVersion
from promptstore.format import _blobs, _entry, _packs, _payload
from promptstore.store import _budget, _keys, _rawscan
from promptstore.store._env import Env, live_dir
from promptstore.store._faults import pages_needed
from promptstore.store._read import assemble
from promptstore.store._results import SalvageReport
from promptstore.store._schema import (
    BLOCKS, CHUNKS, DUPSORT, ENTRIES, ENTRY_KEY, IDS, PINS, PLACES, SIZES, TABLES, USED, Tables, chunk_key, owner_of_chunk,
    parse_pair,
)
from promptstore.store._usage import Usage
from promptstore.store._verify import is_newer
from promptstore.store._write import EntryWriter


def _data_dir(src: Path, data: Optional[Path]) -> Path:
    """The folder of the data file salvage reads: ``data`` (a snapshot) or the live generation's."""
    return data if data is not None else live_dir(src)[0]


def _open_source(src: Path, scratch: Path, data: Optional[Path] = None):
    where = _data_dir(src, data)
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
        if "already open in this process" in str(err):  # not damage: a PromptStore of this process holds it
            raise StoreUnavailable(
                f"{src} is open in this process (a PromptStore; LMDB opens a store once per process): "
                "call that PromptStore's salvage(dst), or close it first"
            ) from err
        raise StoreUnavailable(
            f"{where}/data.mdb cannot be opened ({err}); its header pages are damaged beyond what salvage "
            "can read: restore the directory from a backup or remove it"
        ) from err
    handles: Dict[bytes, Any] = {}
    for name in TABLES:
        try:
            handles[name] = env.open_db(name, create=False, dupsort=name in DUPSORT)
        except lmdb.Error:
            pass
    dbs = Tables(handles)
    if ENTRIES not in dbs or CHUNKS not in dbs:
        env.close()
        raise StoreUnavailable(f"{where}/data.mdb: its table directory is damaged; nothing can be salvaged")
    return env, dbs


def _open_raw(where: Path):
    return lmdb.open(str(where), readonly=True, lock=False, max_dbs=len(TABLES) + 1, subdir=True, create=False)


def _candidates(env, dbs) -> Tuple[List[bytes], List[str]]:
    found: Set[bytes] = set()
    broken: List[str] = []
    walks = {ENTRIES: lambda k, v: k, USED: lambda k, v: k, SIZES: lambda k, v: k,
             PINS: lambda k, v: k, IDS: lambda k, v: v, CHUNKS: lambda k, v: owner_of_chunk(k)}
    for name, pick in walks.items():
        if name not in dbs:
            continue
        try:
            with env.begin() as txn:
                for k, v in txn.cursor(db=dbs[name]):
                    key = bytes(pick(bytes(k), bytes(v)))
                    if len(key) == ENTRY_KEY:
                        found.add(key)
        except Exception:  # a damaged page ends this walk; the other tables may still list the rest
            broken.append(name.decode())
    return sorted(found), broken


def _read_entry(env, dbs, ekey: bytes, src: Path):
    """``(raw manifest, manifest, chunks, blocks, last used, pinned)`` of an intact entry
    (``blocks``: address -> bytes of each shared block it references)."""
    where = f"{src} entry {_keys.entry_id(ekey)}"
    with env.begin(buffers=True) as txn:
        raw = txn.get(ekey, db=dbs.entries)
        if raw is None:
            raise PromptStoreError("no manifest (never committed, or its page is lost)")
        raw = bytes(raw)
        man = _entry.unpack_manifest(raw, where)
        if man.entry_id != _keys.entry_id(ekey) or _keys.entry_key(_keys.model_id(man.model), man.tokens) != ekey:
            raise PromptStoreError("manifest does not match its key")
        own = man.payload_only()
        if man.blob is not None:
            arrays = _blobs.Blobs(src).read(own, where)
            chunks = []
        else:
            chunks = [txn.get(chunk_key(ekey, i), db=dbs.chunks) for i in range(man.chunks)]
            arrays = _payload.read_arrays(own, lambda i: chunks[i], where)
        blocks: Dict[bytes, bytes] = {}
        packs = _packs.Packs(src)
        sizes = dict(man.blocks())

        def block(key: bytes) -> Any:
            place = parse_pair(txn.get(key, db=dbs.places)) if PLACES in dbs else None
            if place is not None:  # a pack's block: read here, checked by assemble
                found: Any = packs.read(place[0], place[1], sizes[key], where)
            else:
                found = txn.get(key, db=dbs.blocks) if BLOCKS in dbs else None
            if found is not None:
                blocks[key] = bytes(found)
            return found

        assemble(block, man, arrays, where)
        _entry.decode_layers(man, arrays, where)
        if not man.intact:
            raise PromptStoreError("manifest checksum mismatch")
        chunks = [bytes(c) for c in chunks]
        used = txn.get(ekey, db=dbs.used) if USED in dbs else None
        pinned = PINS in dbs and txn.get(ekey, db=dbs.pins) is not None
    return raw, man, chunks, blocks, (bytes(used) if used is not None else None), pinned


def check_destination(src, dst) -> Tuple[Path, Path]:
    """``(src, dst)`` as paths, once ``dst`` is known to be a fresh folder outside ``src``.

    Raises:
        InvalidInput: either is not a path, or ``dst`` is a file, is not
            empty, or is inside ``src``.
    """
    src, dst = store_path(src, "the store to salvage"), store_path(dst, "the salvage destination")
    if dst.exists() and not dst.is_dir():
        raise InvalidInput(f"{dst} is a file; salvage writes into a fresh directory")
    if dst.exists() and any(dst.iterdir()):
        raise InvalidInput(f"{dst} exists and is not empty; salvage writes into a fresh directory")
    if dst.absolute().resolve().is_relative_to(src.absolute().resolve()):  # the source is only read: nothing is added to it
        raise InvalidInput(f"{dst} is inside the store {src}; salvage into a folder outside it")
    return src, dst


def salvage_held(env: Env, src: Path, dst) -> SalvageReport:
    """:func:`salvage` of the store at ``src``, which this process holds open
    through ``env``: LMDB opens a store once per process, so it reads a
    consistent copy of the data file (``Env.snapshot``), blob and pack files
    in place."""
    _, target = check_destination(src, dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.snapshot-", dir=target.parent) as snap:
        env.snapshot(Path(snap))
        return salvage(src, dst, data=Path(snap))


def salvage(src, dst, data: Optional[Path] = None) -> SalvageReport:
    """Copy every intact entry of the store at ``src`` into a new store at ``dst``
    (its data file read from the folder ``data``, a snapshot of it, when given).

    The source is only read. Damaged entries and anything unreadable are
    skipped and listed. The budget of the source, when readable, is set on
    the new store without evicting anything. Entries are written through the
    store's one write path (``_write.EntryWriter.add``), keeping their bytes,
    times and pins.

    Raises:
        InvalidInput: ``src`` or ``dst`` is not a path (not a str or
            pathlib.Path, empty, a NUL byte), ``dst`` exists and is not
            empty, or is inside ``src``.
        StoreUnavailable: the source cannot be opened at all (the message says why).
    """
    src, dst = check_destination(src, dst)
    scratch = dst.parent / f".{dst.name}.salvage-src"
    shutil.rmtree(scratch, ignore_errors=True)
    unopened: Optional[StoreUnavailable] = None
    try:
        env, dbs = _open_source(src, scratch, data)
    except StoreUnavailable as err:
        if "open in this process" in str(err) or not (_data_dir(src, data) / "data.mdb").exists():
            raise
        env, dbs, unopened = None, None, err  # its tree cannot be walked: the raw scan may still find entries
    copied: List[str] = []
    newer: Set[str] = set()  # intact entries of a newer promptstore: left behind, never scanned for
    skipped: List[Tuple[str, str]] = []
    raw_found: List[str] = []
    broken: List[str] = []
    try:
        out = Env(dst)
        try:
            out.check_format()
            blobs, src_blobs = _blobs.Blobs(dst), _blobs.Blobs(src)
            packs = _packs.Packs(dst)
            writer = EntryWriter(dst, out, out.db, blobs, packs, Usage(out.db, out.after_commit))

            def copy(ekey: bytes, raw: bytes, man, chunks, blocks, used, pinned) -> None:
                refs = [(key, blocks[key], size) for key, size in man.blocks()]
                packed: List[int] = []

                def write(txn) -> None:
                    for pack in packed:  # a retried transaction writes its pack again
                        packs.unlink(pack)
                    packed.clear()
                    if man.blob is not None and not blobs.path(man.blob).exists():
                        blobs.copy_in(src_blobs.path(man.blob), man.blob)  # under the writer lock, as a put
                    stamp = used if used is not None and len(used) == 8 else None
                    writer.add(txn, ekey, man.tokens, man.trimmable, raw, chunks, stamp, man.payload + len(raw), pinned, evict=False, blocks=refs, packs=packed)

                out.write(write)

            budget = None
            if env is not None:
                ekeys, broken = _candidates(env, dbs)
                try:
                    with env.begin() as txn:
                        budget = _budget.get_budget(txn, dbs)
                except Exception:
                    pass
                for ekey in ekeys:
                    eid = _keys.entry_id(ekey)
                    try:
                        raw, man, chunks, blocks, used, pinned = _read_entry(env, dbs, ekey, src)
                    except (UnsupportedVersion, UnknownStorageKind) as err:
                        if _newer(env, dbs, ekey, err):  # intact: never replaced by an older copy the scan finds
                            newer.add(eid)
                            skipped.append((eid, f"written by a newer promptstore, not copied (salvage it with that release): {err}"))
                        else:
                            skipped.append((eid, f"{type(err).__name__}: {err}"))
                        continue
                    except Exception as err:  # lmdb errors on damaged pages included: skip, keep going
                        skipped.append((eid, f"{type(err).__name__}: {err}"))
                        continue
                    copy(ekey, raw, man, chunks, blocks, used, pinned)
                    copied.append(eid)
            if env is None or broken or skipped:
                done = set(copied)
                # With the tables walked whole, the scan looks only for the
                # entries they name that could not be read: a manifest left
                # in freed pages is an entry deleted before, not one to
                # bring back. Past a broken tree every manifest found counts.
                only = {e for e, _ in skipped} - newer if env is not None and not broken else None
                for ekey, eid, outcome in _raw_pass(src, scratch, done | newer, only, data):
                    if isinstance(outcome, str):
                        if eid not in {e for e, _ in skipped}:
                            skipped.append((eid, outcome))
                        continue
                    used, pinned = _stamps(env, dbs, ekey) if env is not None else (None, False)
                    copy(ekey, outcome.raw, outcome.man, outcome.chunks, outcome.blocks, used, pinned)
                    copied.append(eid)
                    raw_found.append(eid)
                    skipped[:] = [(e, w) for e, w in skipped if e != eid]
            if env is None and not copied and unopened is not None:
                raise unopened
            if budget is not None:
                out.write(lambda txn: _budget.set_budget(txn, out.db, budget))
        finally:
            out.close()
    finally:
        if env is not None:
            env.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return SalvageReport(str(src), str(dst), tuple(copied), tuple(skipped), tuple(broken), tuple(raw_found))


def _newer(env, dbs, ekey: bytes, err: PromptStoreError) -> bool:
    """Whether ``err``, met reading the entry at ``ekey``, means a newer
    promptstore wrote it (its manifest intact) rather than damage."""
    try:
        with env.begin() as txn:
            raw = txn.get(ekey, db=dbs.entries)
            return is_newer(err, bytes(raw) if raw is not None else None)
    except Exception:  # lmdb errors on damaged pages included
        return False


def _stamps(env, dbs, ekey: bytes) -> Tuple[Optional[bytes], bool]:
    """The last use and pin of the entry at ``ekey`` as the source's tables
    hold them, for an entry the scan found: ``(None, False)`` when they
    cannot be read."""
    try:
        with env.begin() as txn:
            used = txn.get(ekey, db=dbs.used) if USED in dbs else None
            return (bytes(used) if used is not None else None), PINS in dbs and txn.get(ekey, db=dbs.pins) is not None
    except Exception:  # lmdb errors on damaged pages included
        return None, False


def _raw_pass(src: Path, scratch: Path, done: Set[str], only: Optional[Set[str]] = None,
              data_dir: Optional[Path] = None) -> Iterator[Tuple[bytes, str, Any]]:
    """Entries found by scanning the data file's bytes (``_rawscan``) that
    are not in ``done`` (and are in ``only``, unless it is None): ``(entry
    key, id, Found)`` when every part was found and checks, else ``(entry
    key, id, why not)``."""
    where = f"{src} (scanned)"
    data = _rawscan.DataFile(_data_dir(src, data_dir) / "data.mdb")
    try:
        in_packs = _rawscan.pack_blocks(src, where)
        src_packs = _packs.Packs(src)
        for ekey, found in data.manifests(where).items():
            eid = _keys.entry_id(ekey)
            if eid in done or (only is not None and eid not in only):
                continue
            why = _rawscan.complete(found, data, in_packs, src_packs, where)
            if why is None:
                try:
                    man = found.man
                    own = man.payload_only()
                    if man.blob is not None:
                        arrays = _blobs.Blobs(src).read(own, where)
                    else:
                        arrays = _payload.read_arrays(own, lambda i: found.chunks[i] if i < len(found.chunks) else None, where)
                    assemble(found.blocks.get, man, arrays, where)  # every block checked against its address
                    _entry.decode_layers(man, arrays, where)
                except PromptStoreError as err:
                    why = str(err)
            yield ekey, eid, (found if why is None else f"scan: {why}")
    finally:
        data.close()


__all__ = ["salvage", "SalvageReport"]
