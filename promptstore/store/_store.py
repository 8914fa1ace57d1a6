"""PromptStore: prompt caches in LMDB, keyed by model identity and exact tokens."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import lmdb
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from promptstore.format import _blobs, _entry, _fill, _pages
from promptstore.store import _budget, _index, _keys
from promptstore.store._capacity import CapacityMixin
from promptstore.store._inspect import InspectMixin, VerifyReport
from promptstore.store._env import DEFAULT_MAP_SIZE, Env
from promptstore.store._gate import CLOSE_TIMEOUT, closed_error
from promptstore.codecs import codec_for_layer, encode_layer, storage_kind
from promptstore.errors import (
    CorruptEntry,
    CoverageMismatch,
    EntryNotFound,
    InvalidInput,
    ModelMismatch,
    PromptStoreError,
    UnsupportedVersion,
)
from promptstore.identity import model_name_of

__all__ = ["PromptStore", "EntryInfo", "Hit", "VerifyReport", "default_path"]

log = logging.getLogger("promptstore")

STORE_FORMAT = 1
_F64 = struct.Struct(">d")
_U64 = struct.Struct(">Q")


def default_path() -> Path:
    """``$PROMPTSTORE_DIR``, else ``~/.cache/promptstore``."""
    env = os.environ.get("PROMPTSTORE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "promptstore"


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


@dataclass(frozen=True)
class EntryInfo:
    """What the store knows of one entry, without its arrays."""

    id: str
    model: str
    model_name: str
    n_tokens: int
    kinds: Tuple[str, ...]
    nbytes: int
    created: datetime
    last_used: datetime
    trimmable: bool
    meta: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    """A lookup result: a ready cache covering ``matched`` tokens of the query.

    ``trimmed`` is how many tokens were cut from a longer stored entry.
    """

    cache: List[Any]
    matched: int
    info: EntryInfo
    trimmed: int = 0


class PromptStore(CapacityMixin, InspectMixin):
    """Prompt caches in an LMDB environment.

    Args:
        path: the store directory; None means ``$PROMPTSTORE_DIR``, else
            ``~/.cache/promptstore``. Created when missing.
        map_size: initial LMDB map (address space only; it grows on demand).
        readonly: open without write access.
        budget: a byte budget to set and remember in the store (see
            :meth:`set_budget`); None keeps the stored one.

    One instance serves any number of threads; other processes may open the
    same path at the same time. Never use an instance across ``fork()``.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False, budget: Optional[int] = None):
        self.path = Path(path).expanduser() if path is not None else default_path()
        self._env = Env(self.path, map_size=map_size, readonly=readonly)
        self._db = self._env.db
        self._blobs = _blobs.Blobs(self.path)
        self._lock = threading.Lock()
        self._touched: Dict[bytes, float] = {}
        self._counts: Counter = Counter()
        self._check_format(readonly)
        if budget is not None:
            self.set_budget(budget)

    # -- lifecycle -----------------------------------------------------------

    def _check_format(self, readonly: bool) -> None:
        with self._env.read() as txn:
            raw = txn.get(b"format", db=self._db[b"info"])
        if raw is None:
            if not readonly:
                self._env.write(lambda t: t.put(b"format", _U64.pack(STORE_FORMAT), db=self._db[b"info"]))
            return
        fmt = _U64.unpack(raw)[0] if len(raw) == 8 else -1
        if fmt != STORE_FORMAT:
            self._env.close()
            if fmt > STORE_FORMAT:
                raise UnsupportedVersion(f"{self.path}: store format {fmt} is newer than this promptstore ({STORE_FORMAT}); upgrade")
            raise CorruptEntry(f"{self.path}: store format record is damaged")

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush recorded usage and close the store; safe while other threads use it.

        New operations raise StoreClosed from the call on; those in flight in
        other threads finish, then usage is flushed and the files close
        (the rules: :meth:`promptstore.store._gate.Gate.close`). An operation of
        several transactions (``verify``, ``gc``) cut by it raises StoreClosed.
        In a forked child it only drops this object's reference.

        Raises:
            StoreUnavailable: called inside an operation of this thread, or
                operations in flight outlast ``timeout`` seconds; the files
                then close when the last of them ends (usage not flushed).
        """
        env = self._env
        if env is None:
            return
        try:
            env.close(timeout, last=self.flush if os.getpid() == env.pid else None)
        finally:
            if env.closed or os.getpid() != env.pid:
                self._env = None

    def __enter__(self) -> "PromptStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; explicit close() is the contract
        # Never waits: with transactions still open (on an Env someone kept),
        # the last of them closes the files.
        try:
            env = getattr(self, "_env", None)
            if env is not None:
                env.close(timeout=0)
        except Exception:
            pass

    @property
    def env(self) -> Env:
        if self._env is None:
            raise closed_error(self.path)
        return self._env

    # -- usage bookkeeping (kept off the read path) ----------------------------

    def _touch(self, ekey: bytes) -> None:
        with self._lock:
            self._touched[ekey] = time.time()

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _flush_in(self, txn: lmdb.Transaction) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
            counts, self._counts = self._counts, Counter()
        for ekey, ts in touched.items():
            if txn.get(ekey, db=self._db[b"entries"]) is not None:
                txn.put(ekey, _F64.pack(ts), db=self._db[b"used"])
        for what, n in counts.items():
            key = b"stat:" + what.encode()
            raw = txn.get(key, db=self._db[b"info"])
            old = _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
            txn.put(key, _U64.pack(old + n), db=self._db[b"info"])

    def flush(self) -> None:
        """Write recorded last-use times and hit counters (done on every put and
        on close; a store opened read-only keeps them to itself)."""
        if self.env.readonly:
            return
        if self._touched or self._counts:
            self.env.write(self._flush_in)

    # -- writing -------------------------------------------------------------

    def put(self, model: str, tokens: Sequence[int], cache: Sequence[Any], meta: Optional[Dict[str, Any]] = None) -> EntryInfo:
        """Store ``cache`` as the prompt cache of ``tokens`` under ``model``.

        Args:
            model: the model identity, normally ``fingerprint(...)``; any
                non-empty string is accepted.
            tokens: the token ids the cache covers, exactly.
            cache: the per-layer cache objects (``make_prompt_cache(model)``).
            meta: optional user metadata (msgpack-serialisable values).

        Returns:
            The stored entry's EntryInfo. An existing entry for the same model
            and tokens is replaced.

        Raises:
            CoverageMismatch: a layer covers another number of tokens.
            UnknownStorageKind: a layer's class has no codec.
            InvalidInput: bad model id, tokens or meta.
            StoreFull: disk or map full; nothing was written.
        """
        mid = _keys.model_id(model)
        toks = _keys.as_tokens(tokens)
        layers = list(cache)
        if not layers:
            raise InvalidInput("cache has no layers")
        n = len(toks)
        for i, layer in enumerate(layers):
            cov = codec_for_layer(layer).coverage(layer)
            if cov is not None and cov != n:
                raise CoverageMismatch(
                    f"layer {i} ({storage_kind(layer)}) covers {cov} tokens but {n} tokens were given; "
                    "pass exactly the tokens the cache has absorbed"
                )
        if meta is not None and not isinstance(meta, dict):
            raise InvalidInput("meta must be a dict")
        encoded = [encode_layer(layer) for layer in layers]
        records, views, payload = _entry.prepare(encoded)
        blob = payload >= _blobs.MIN_PAYLOAD
        # A blob entry's checksums are computed while its file is written.
        hashing = _fill.submit(_entry.add_checksums, records, views) if blob else None
        if not blob:
            _entry.add_checksums(records, views)
        trimmable = all(getattr(layer, "is_trimmable", lambda: False)() for layer in layers)
        ekey = _keys.entry_key(mid, toks)
        eid = _keys.entry_id(ekey)
        now = time.time()
        hashes = _keys.prefix_hashes(toks)
        written: List[str] = []  # blob files this put wrote (one per attempt)

        def pack(blob_name: Optional[str]) -> bytes:
            return _entry.pack_manifest(
                model=model,
                model_name=model_name_of(model),
                tokens=toks,
                layers=records,
                payload=payload,
                created=now,
                trimmable=trimmable,
                meta=dict(meta or {}),
                entry_id=eid,
                blob=blob_name,
            )

        manifest = pack(None)  # bad meta fails here, before any write (a blob entry's is packed again)

        def write(txn: lmdb.Transaction) -> None:
            nonlocal manifest
            old = txn.get(ekey, db=self._db[b"entries"])
            if old is not None:
                self._unlink(txn, ekey, old)
            if blob:
                # Written under the writer lock (see _blobs); a retried
                # transaction drops its earlier file and writes a new one.
                for name in written:
                    self._blobs.unlink(name)
                name = _blobs.new_name(eid)
                written.append(name)
                self._blobs.write(name, views)
                hashing.result()
                manifest = pack(name)
            else:
                for i, chunk in enumerate(_entry.iter_chunks(views, payload)):
                    txn.put(ekey + _keys.u32(i), chunk, db=self._db[b"chunks"])
            _index.add(txn, self._db, mid, toks, hashes, ekey, trimmable)
            txn.put(ekey, _F64.pack(now), db=self._db[b"used"])
            txn.put(eid.encode(), ekey, db=self._db[b"ids"])
            self._flush_in(txn)
            # Budget: account this entry and evict LRU ones in this same transaction.
            _budget.admit(txn, self._db, ekey, payload + len(manifest), self._unlink, str(self.path))
            # The manifest goes last: an entry is visible whole or not at all.
            txn.put(ekey, manifest, db=self._db[b"entries"])

        try:
            self.env.write(write)
        except BaseException:
            # An interrupt can land after the commit (a signal is handled at the
            # next bytecode): the file the committed manifest names stays.
            for name in written:
                if not self._names_blob(ekey, name):
                    self._blobs.unlink(name)
            raise
        return EntryInfo(
            id=eid,
            model=model,
            model_name=model_name_of(model),
            n_tokens=n,
            kinds=tuple(r["kind"] for r in records),
            nbytes=payload,
            created=_utc(now),
            last_used=_utc(now),
            trimmable=trimmable,
            meta=dict(meta or {}),
        )

    def put_row(self, model: str, tokens: Sequence[int], batch_cache: Sequence[Any], row: int, meta: Optional[Dict[str, Any]] = None) -> EntryInfo:
        """Store row ``row`` of a running batch as a serial entry; the batch is untouched.

        See :func:`promptstore.rows.put_row` (Args, Returns, Raises): the row is
        extracted compactly, refused with CoverageMismatch unless it covers
        exactly ``tokens``; a row index out of range raises InvalidInput.
        """
        from promptstore import rows

        return rows.put_row(self, model, tokens, batch_cache, row, meta)

    def _names_blob(self, ekey: bytes, name: str) -> bool:
        """Whether the committed entry at ``ekey`` names blob file ``name``
        (True when that cannot be read: then the file stays, for gc)."""
        try:
            with self.env.read() as txn:
                man = self._manifest(txn, ekey)
        except BaseException:
            return True
        return man is not None and man.blob == name

    def _unlink(self, txn, ekey: bytes, raw_manifest: Optional[bytes]) -> None:
        """Remove an entry's chunks, index records and bookkeeping."""
        cur = txn.cursor(db=self._db[b"chunks"])
        if cur.set_range(ekey):
            while cur.key()[:36] == ekey:
                if not cur.delete():
                    break
        if raw_manifest is not None:
            try:
                man = _entry.unpack_manifest(bytes(raw_manifest), _keys.entry_id(ekey))
                _index.remove(txn, self._db, ekey[:16], man.tokens, _keys.prefix_hashes(man.tokens), ekey)
            except PromptStoreError:
                pass  # damaged manifest: its index records become harmless dead ends (its blob, a leftover)
            else:
                if man.blob is not None and man.blob.startswith(_keys.entry_id(ekey) + "-"):
                    blob = man.blob
                    self.env.after_commit(lambda: self._blobs.unlink(blob))
        txn.delete(ekey, db=self._db[b"used"])
        txn.delete(_keys.entry_id(ekey).encode(), db=self._db[b"ids"])
        _budget.forget(txn, self._db, ekey)
        txn.delete(ekey, db=self._db[b"entries"])

    def delete(self, model: str, tokens: Sequence[int]) -> bool:
        """Delete the entry of exactly ``tokens``; True when one existed."""
        ekey = _keys.entry_key(_keys.model_id(model), _keys.as_tokens(tokens))
        return self._delete_keys([ekey]) == 1

    def remove(self, key: str) -> EntryInfo:
        """Delete an entry by id (or unique id prefix) and return what it was.

        Raises:
            EntryNotFound: no entry, or the prefix is ambiguous.
        """
        def write(txn) -> Tuple[EntryInfo, bytes]:  # resolve and delete in one transaction
            ekey = self._resolve(txn, key)
            man = self._manifest(txn, ekey)
            if man is None:
                raise EntryNotFound(f"{self.path}: entry {key!r} has vanished")
            info = self._info(txn, ekey, man)
            self._unlink(txn, ekey, txn.get(ekey, db=self._db[b"entries"]))
            txn.delete(ekey, db=self._db[b"pins"])
            return info, ekey

        info, ekey = self.env.write(write)
        with self._lock:
            self._touched.pop(ekey, None)
        return info

    def _delete_keys(self, ekeys: Sequence[bytes]) -> int:
        def write(txn) -> int:
            done = 0
            for ekey in ekeys:
                raw = txn.get(ekey, db=self._db[b"entries"])
                if raw is None:
                    continue
                self._unlink(txn, ekey, raw)
                txn.delete(ekey, db=self._db[b"pins"])
                done += 1
            return done

        with self._lock:
            for ekey in ekeys:
                self._touched.pop(ekey, None)
        return self.env.write(write)

    # -- reading ---------------------------------------------------------------

    def _manifest(self, txn, ekey: bytes) -> Optional[_entry.Manifest]:
        raw = txn.get(ekey, db=self._db[b"entries"])
        if raw is None:
            return None
        return _entry.unpack_manifest(bytes(raw), f"{self.path} entry {_keys.entry_id(ekey)}")

    def _restore(self, txn, ekey: bytes, man: _entry.Manifest, remembered: bool = True) -> List[Any]:
        """The entry's cache, read and checked inside ``txn``. ``remembered=False``
        (verify) always goes through LMDB, checking every chunk's presence and length."""
        where = f"{self.path} entry {man.entry_id}"
        chunks = self._db[b"chunks"]

        def get_chunk(i: int) -> Any:
            return txn.get(ekey + _keys.u32(i), db=chunks)

        if man.blob is not None:
            arrays = self._blobs.read(man, where)
        elif man.payload < _pages.MIN_PAYLOAD:
            arrays = _entry.read_arrays(man, get_chunk, where)
        else:
            arrays = self._read_large(self.env.data_file(), ekey, man, get_chunk, where, remembered)
        return _entry.decode_layers(man, arrays, where)

    def _read_large(
        self, data: _pages.DataFile, ekey: bytes, man: _entry.Manifest, get_chunk, where: str, remembered: bool = True
    ) -> List[Any]:
        """A large payload, read with ``pread`` where possible.

        Fetching a chunk through py-lmdb maps all of its pages (it preloads
        values), only for them to be dropped again. So the file offsets of an
        entry's chunks are remembered, keyed by the entry and its manifest's
        creation time and size, and a later get of the same entry reads them
        directly. Only overflow pages are remembered (every chunk at least a
        page long): LMDB never moves those while their value stands, whereas
        a small value lives in a leaf page that any later write may copy. The
        offsets are stale only if the entry was rewritten since, at the same
        key, with the same creation time; then the checksums fail and the
        restore is redone through LMDB, which also reports real damage. A
        failure on offsets just computed is checked again by copying out of
        the map, so a wrong offset can never make a healthy entry look
        damaged.
        """
        fd = data.fd if _fill.available() else None
        key = (ekey, man.created, man.payload, man.chunks)
        offsets = data.located.get(key) if fd is not None and remembered else None
        if offsets is not None:
            try:
                return _entry.read_file(man, fd, offsets, where)
            except CorruptEntry:
                data.forget(key)
        bufs = _entry.chunk_buffers(man, get_chunk, where, data.release)
        found = [data.offset(b) for b in bufs]
        if fd is None or any(o is None for o in found):
            return _entry.read_mapped(man, bufs, where, data.release)
        try:
            arrays = _entry.read_file(man, fd, found, where)  # type: ignore[arg-type]
        except CorruptEntry:
            data.refresh()
            return _entry.read_mapped(man, bufs, where, data.release)
        if min(len(b) for b in bufs) >= _pages._PAGE:
            data.remember(key, found)  # type: ignore[arg-type]
        return arrays

    def _info(self, txn, ekey: bytes, man: _entry.Manifest) -> EntryInfo:
        raw = txn.get(ekey, db=self._db[b"used"])
        used = _F64.unpack(bytes(raw))[0] if raw is not None and len(raw) == 8 else man.created
        return EntryInfo(
            id=man.entry_id,
            model=man.model,
            model_name=man.model_name,
            n_tokens=len(man.tokens),
            kinds=man.kinds,
            nbytes=man.payload,
            created=_utc(man.created),
            last_used=_utc(max(used, self._touched.get(ekey, 0.0))),
            trimmable=man.trimmable,
            meta=man.meta,
        )

    def exists(self, model: str, tokens: Sequence[int]) -> bool:
        """True when an entry of exactly ``tokens`` under ``model`` is stored.

        Cheap: reads the manifest only, no arrays, and counts no hit or miss.
        An entry whose manifest is damaged or does not match counts as absent,
        so a caller that re-puts it replaces it.
        """
        toks = _keys.as_tokens(tokens)
        ekey = _keys.entry_key(_keys.model_id(model), toks)
        with self.env.read() as txn:
            try:
                man = self._manifest(txn, ekey)
            except PromptStoreError:
                return False
        return man is not None and man.intact and man.model == model and np.array_equal(man.tokens, toks)

    def get(self, model: str, tokens: Sequence[int]) -> Optional[List[Any]]:
        """The stored cache of exactly ``tokens``, or None.

        Raises:
            CorruptEntry: the entry is damaged (nothing is returned).
            UnknownStorageKind, UnsupportedVersion: written by a newer promptstore.
            ModelMismatch: the entry's recorded identity is not ``model``.
        """
        hit = self._get_exact(model, _keys.as_tokens(tokens))
        return None if hit is None else hit.cache

    def _get_exact(self, model: str, toks: np.ndarray) -> Optional[Hit]:
        return _blobs.again(lambda lost: self._get_exact_once(model, toks))

    def _get_exact_once(self, model: str, toks: np.ndarray) -> Optional[Hit]:
        ekey = _keys.entry_key(_keys.model_id(model), toks)
        with self.env.read(buffers=True) as txn:
            man = self._manifest(txn, ekey)
            if man is None:
                self._count("misses")
                return None
            self._check_entry(man, model, toks, len(toks))
            cache = self._restore(txn, ekey, man)
            info = self._info(txn, ekey, man)
        self._touch(ekey)
        self._count("hits")
        return Hit(cache, len(toks), info)

    def _check_entry(self, man: _entry.Manifest, model: str, toks: np.ndarray, n: int) -> None:
        if man.model != model:
            raise ModelMismatch(f"{self.path} entry {man.entry_id} belongs to model {man.model!r}, not {model!r}")
        if len(man.tokens) != n or not np.array_equal(man.tokens, toks[:n]):
            raise CorruptEntry(f"{self.path} entry {man.entry_id}: stored tokens do not match its key")

    def peek(self, model: str, tokens: Sequence[int]) -> int:
        """How many tokens of ``tokens`` :meth:`lookup` would cover, reading
        manifests only (no arrays), so a caller can skip a restore that would
        not beat what it holds. 0 when nothing matches.
        """
        mid = _keys.model_id(model)
        toks = _keys.as_tokens(tokens)
        with self.env.read() as txn:
            manifest = lambda ekey: self._safe_manifest(txn, ekey)  # noqa: E731
            for _ekey, matched, man in _index.candidates(txn, self._db, mid, toks, manifest):
                if man.model == model:
                    return matched
        return 0

    def lookup(self, model: str, tokens: Sequence[int]) -> Optional[Hit]:
        """The longest usable stored prefix of ``tokens``, restored.

        An entry whose tokens are a prefix of the query is usable as is; a
        longer entry whose layers are all trimmable is trimmed down to the
        common prefix. Recurrent entries match only at their exact length.
        Damaged candidates are logged and skipped.

        Returns:
            A Hit (``matched`` tokens are covered by ``hit.cache``; the
            caller prefills ``tokens[hit.matched:]``), or None.
        """
        mid = _keys.model_id(model)
        toks = _keys.as_tokens(tokens)
        return _blobs.again(lambda lost: self._lookup_once(model, mid, toks, lost))

    def _lookup_once(self, model: str, mid: bytes, toks: np.ndarray, lost: Set[str]) -> Optional[Hit]:
        with self.env.read(buffers=True) as txn:
            manifest = lambda ekey: self._safe_manifest(txn, ekey)  # noqa: E731
            for ekey, matched, man in _index.candidates(txn, self._db, mid, toks, manifest):
                try:
                    if man.model != model:
                        raise ModelMismatch(f"entry {man.entry_id} belongs to {man.model!r}, not {model!r}")
                    cache = self._restore(txn, ekey, man)
                except _blobs.Vanished as err:
                    if err.blob not in lost:
                        raise  # deleted since this snapshot, or lost: look again
                    log.warning("promptstore: skipping entry %s: %s (run `promptstore verify --fix`)", man.entry_id, err)
                    continue
                except PromptStoreError as err:
                    log.warning("promptstore: skipping entry %s: %s (run `promptstore verify --fix`)", man.entry_id, err)
                    continue
                trimmed = len(man.tokens) - matched
                if trimmed:
                    _trim(cache, trimmed)
                info = self._info(txn, ekey, man)
                self._touch(ekey)
                self._count("hits")
                return Hit(cache, matched, info, trimmed)
        self._count("misses")
        return None

    def _safe_manifest(self, txn, ekey: bytes) -> Optional[_entry.Manifest]:
        try:
            return self._manifest(txn, ekey)
        except PromptStoreError as err:
            log.warning("promptstore: skipping entry %s: %s", _keys.entry_id(ekey), err)
            return None


def _trim(cache: List[Any], n: int) -> None:
    """Trim every layer by ``n`` tokens; plain KV layers also drop the trimmed
    positions so their memory is not kept alive."""
    for layer in cache:
        layer.trim(n)
        if type(layer) is KVCache and layer.keys is not None:
            layer.keys = layer.keys[..., : layer.offset, :]
            layer.values = layer.values[..., : layer.offset, :]
        elif type(layer) is QuantizedKVCache and layer.keys is not None:
            layer.keys = tuple(x[..., : layer.offset, :] for x in layer.keys)
            layer.values = tuple(x[..., : layer.offset, :] for x in layer.values)
