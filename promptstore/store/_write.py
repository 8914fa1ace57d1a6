"""The one write path: adding and removing an entry inside a write transaction.

Every writer of entries goes through :class:`EntryWriter`: ``put`` (and so
``put_row``, ``import``, warm-up and the serving cache) and ``salvage``.
:meth:`EntryWriter.add` writes an entry's records in a fixed order and its
manifest last, so an entry is visible whole or not at all;
:meth:`EntryWriter.unlink` undoes every record ``add`` wrote.

Records of one entry (tables in ``_schema``): payload chunks (or a blob file
that the manifest names), references to shared blocks (a block the store
lacks is written, one it has only counted), prefix index, last use, id, size
accounting, pin, and the manifest.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar

import numpy as np

from promptstore.codecs import Encoded, check_encoded, codec_for_kind, codec_for_layer, storage_kind
from promptstore.errors import CoverageMismatch, InvalidInput, PromptStoreError
from promptstore.format import _blobs, _blocks, _entry, _fill, _packs, _payload
from promptstore.format._entry import Manifest
from promptstore.store import _budget, _index, _keys, _packing, _refcount
from promptstore.store._env import Env
from promptstore.store._schema import F64, Tables, chunk_key, model_of, owner_of_chunk
from promptstore.store._usage import Usage

T = TypeVar("T")
Block = Tuple[bytes, Any, int]  # address, its bytes (bytes-like, or a [rows, tokens, width] view), size


@dataclass(frozen=True)
class Written:
    """What :meth:`EntryWriter.put` committed."""

    entry_id: str
    created: float
    payload: int  # the entry's own array bytes
    shared: int = 0  # array bytes in shared blocks
    written: int = 0  # bytes of the blocks this put added (the rest were stored already)
    manifest: int = 0  # bytes of its manifest (the entry's own size is payload + manifest)


_GATED = "ssm.gated_delta"


class Changed(PromptStoreError):
    """A rewrite found the entry changed since it was read (nothing was written)."""


class EntryWriter:
    """Adds and removes entries of one store."""

    def __init__(
        self,
        path: Path,
        env: Env,
        tables: Tables,
        blobs: _blobs.Blobs,
        packs: _packs.Packs,
        usage: Usage,
        shared_blocks: bool = False,
        block_tokens: int = _blocks.BLOCK_TOKENS,
        damaged: Optional[Set[bytes]] = None,
    ):
        self.path = path
        self._env = env
        self._db = tables
        self._blobs = blobs
        self._packs = packs
        self._usage = usage
        self.shared_blocks = shared_blocks  # puts keep KV arrays in shared blocks (format 3)
        self.block_tokens = block_tokens  # the most tokens a new block spans
        # Stored blocks a read found damaged (``Reader.damaged``): referenced
        # again by a put, they are checked, and written again from the put's
        # bytes unless intact.
        self.damaged: Set[bytes] = damaged if damaged is not None else set()

    # -- inside a write transaction ---------------------------------------------

    def add(
        self,
        txn,
        ekey: bytes,
        tokens: np.ndarray,
        trimmable: bool,
        manifest: bytes,
        chunks: Iterable[Any] = (),
        used: Optional[bytes] = None,
        size: Optional[int] = None,
        pinned: bool = False,
        evict: bool = True,
        blocks: Sequence[Block] = (),
        packs: Optional[List[int]] = None,
    ) -> int:
        """Write one entry: ``chunks`` (empty when a blob file holds the
        payload), its index records, last use (``used``, f64 bytes; None writes none), id, size
        (``size``, else the manifest's payload plus its own length), pin, and
        the manifest last. ``blocks`` are the shared blocks the manifest
        references, once per reference: each is counted, and written when the
        store lacks it (into a new pack file if ``packs`` is a list, to which
        its number is appended; see :meth:`_reference`). An entry at ``ekey`` is replaced (its pin kept). With
        ``evict``, least-recently-used entries go to make room within the
        budget, in this same transaction. When the entry replaced or one
        evicted had a manifest that could not be read, the blocks are
        recounted (:meth:`recount`) once this entry's manifest is written.
        Returns the bytes of blocks written.

        Raises:
            StoreFull: the entry alone is larger than the budget.
        """
        db = self._db
        old = txn.get(ekey, db=db.entries)
        unknown = False  # an entry removed here could not release its blocks (its manifest cannot be read)
        if old is not None:
            unknown = not self.unlink(txn, ekey, bytes(old))
        for i, chunk in enumerate(chunks):
            txn.put(chunk_key(ekey, i), chunk, db=db.chunks)
        written = self._reference(txn, blocks, packs)
        _index.add(txn, db, model_of(ekey), tokens, _keys.prefix_hashes(tokens), ekey, trimmable)
        _budget.set_used(txn, db, ekey, used if used is not None else F64.pack(0.0))
        txn.put(_keys.entry_id(ekey).encode(), ekey, db=db.ids)
        self._usage.flush_in(txn)
        nbytes = size if size is not None else len(manifest)
        if evict:
            named = {key: size for key, _, size in blocks}
            footprint = nbytes + sum(named.values())
            kept_pin = named if pinned or _budget.is_pinned(txn, db, ekey) else None
            _, evicted_unknown = _budget.admit(txn, db, ekey, nbytes, self.unlink, str(self.path), self.freed_by(txn), footprint, kept_pin)
            unknown = unknown or evicted_unknown
        else:
            _budget.account(txn, db, ekey, nbytes)
        if pinned:
            txn.put(ekey, b"", db=db.pins)
        if packs is not None:
            self.repack(txn, packs)
        txn.put(ekey, manifest, db=db.entries)  # last: the entry is visible whole or not at all
        if unknown:  # after the manifest: this entry's references, size and pin count in the recount
            self.recount(txn)
        return written

    def _reference(self, txn, blocks: Sequence[Block], packs: Optional[List[int]]) -> int:
        """Count one more reference to each block, writing those the store
        lacks: into a new pack file when they add up to at least
        ``_packs.MIN_BYTES`` and ``packs`` is given (the number of the pack
        written is appended to it), else into LMDB."""
        db = self._db
        refs: Dict[bytes, List[Any]] = {}  # address -> [references added, size, its data]
        for key, data, size in blocks:
            if key in refs:
                refs[key][0] += 1
            else:
                refs[key] = [1, size, data]
        counts = {key: _budget.ref_count(txn.get(key, db=db.refs)) for key in refs}
        suspect = [key for key, count in counts.items() if count and key in self.damaged]
        heal = [key for key in suspect if not self._intact(txn, key, refs[key][2], refs[key][1])]
        for key in heal:  # its stored copy is damaged: freed, and written again below from these bytes
            self.free_block(txn, key, refs[key][1])
        if heal:
            _budget.add_usage(txn, db, -sum(refs[key][1] for key in heal))
        new = [(key, refs[key][2], refs[key][1]) for key, count in counts.items() if count == 0 or key in heal]
        if self.damaged and (new or suspect):
            done = {key for key, _, _ in new} | set(suspect)
            self._env.after_commit(lambda: self.damaged.difference_update(done))
        written = sum(size for _, _, size in new)
        if new and packs is not None and written >= _packs.MIN_BYTES:
            self._pack(txn, new, packs)
        else:
            for key, data, _ in new:
                txn.put(key, _contiguous(data), db=db.blocks)
        for key, (added, size, _) in refs.items():
            txn.put(key, _budget.ref_value(counts[key] + added, size), db=db.refs)
        if written:
            _budget.add_usage(txn, db, written)
        return written

    def _intact(self, txn, key: bytes, data: Any, size: int) -> bool:
        """Whether the stored copy of block ``key`` holds exactly ``data``
        (the bytes its address names), as this transaction sees it."""
        where = _packing.place(txn, self._db, key)
        try:
            stored = txn.get(key, db=self._db.blocks) if where is None else self._packs.read(where[0], where[1], size, str(self.path))
        except PromptStoreError:
            return False
        return stored is not None and bytes(stored) == bytes(_contiguous(data))

    def _pack(self, txn, new: Sequence[Block], packs: List[int]) -> None:
        """Write the blocks ``new`` to a new pack file, durably, and record where each is."""
        db = self._db
        pack = self._packs.new_number()
        while _packing.has_pack(txn, db, pack):
            pack = self._packs.new_number()
        packs.append(pack)
        blocks = [(key, size) for key, _, size in new]
        self._packs.write(pack, [view for _, data, _ in new for view in _rows(data)], blocks)
        _packing.record(txn, db, pack, blocks)

    def _release(self, txn, man: Manifest) -> None:
        """Drop one reference to each block of ``man``; remove blocks no entry references."""
        db = self._db
        freed = 0
        for key, _ in man.blocks():
            raw = txn.get(key, db=db.refs)
            count = _budget.ref_count(raw)
            if count > 1:
                txn.put(key, _budget.ref_value(count - 1, _budget.ref_size(raw)), db=db.refs)
            elif raw is not None:
                txn.delete(key, db=db.refs)
                self.free_block(txn, key, _budget.ref_size(raw))
                freed += _budget.ref_size(raw)
        if freed:
            _budget.add_usage(txn, db, -freed)

    def free_block(self, txn, key: bytes, size: int) -> None:
        """Remove a block's bytes: its LMDB value, or its share of a pack
        (the pack is unlinked, after the commit, once none of it is referenced)."""
        db = self._db
        where = _packing.place(txn, db, key)
        if where is None:
            txn.delete(key, db=db.blocks)
            return
        gone = _packing.free(txn, db, key, where, size)
        if gone is not None:
            self.unlink_pack_later(gone)

    def unlink_pack_later(self, pack: int) -> None:
        """Unlink pack file ``pack`` once the write transaction this thread is in commits."""
        self._env.after_commit(functools.partial(self._packs.unlink, pack))

    def repack(self, txn, packs: List[int], every: bool = False) -> int:
        """Rewrite sparse pack files when their dead bytes pass the threshold
        (``_packing``), or, with ``every``, each pack holding any dead block
        (``compact``); returns the bytes moved."""
        if every:
            return _packing.repack(txn, self._db, self._packs, packs, self.unlink_pack_later, str(self.path), share=0.0)
        if not _packing.repack_due(txn, self._db):
            return 0
        return _packing.repack(txn, self._db, self._packs, packs, self.unlink_pack_later, str(self.path))

    def write_packs(self, body: Callable[[Any, List[int]], T]) -> T:
        """``Env.write(body(txn, fresh))`` for a transaction that writes pack
        files (a repack) outside a put: ``fresh`` collects their numbers. A
        retried attempt (map growth) first unlinks the files of the one before,
        which no record names, and a failed write those its commit does not record."""
        fresh: List[int] = []

        def attempt(txn) -> T:
            for num in fresh:
                self._packs.unlink(num)
            fresh.clear()
            return body(txn, fresh)

        try:
            return self._env.write(attempt)
        except BaseException:
            for num in fresh:
                if not self._has_pack(num):
                    self._packs.unlink(num)
            raise

    def recount(self, txn) -> None:
        """Recount every block's references from the manifests, removing the
        blocks none references (``_refcount``), and the byte accounting
        (``_budget.recount``): after removing an entry whose manifest could
        not be read, which left its blocks counted. It reads every manifest."""
        _refcount.recount_blocks(txn, self._db, self.free_block, self.unlink_pack_later)
        _budget.recount(txn, self._db)

    def freed_by(self, txn) -> _budget.Release:
        """What evicting entries frees, their blocks included, given those planned before."""
        def blocks(ekey: bytes) -> List[bytes]:
            man = self.readable(txn, ekey)
            return [key for key, _ in man.blocks()] if man is not None else []

        return _budget.Release(txn, self._db, blocks)

    def readable(self, txn, ekey: bytes) -> Optional[Manifest]:
        """The manifest at ``ekey``, or None when there is none or it cannot be read."""
        raw = txn.get(ekey, db=self._db.entries)
        try:
            return _entry.unpack_manifest(bytes(raw), _keys.entry_id(ekey)) if raw is not None else None
        except PromptStoreError:
            return None

    def unlink(self, txn, ekey: bytes, raw_manifest: Optional[bytes]) -> bool:
        """Remove every record of an entry but its pin (a replaced entry keeps it).
        Its blob file is unlinked once ``txn`` commits. Returns whether its
        blocks were released: False when ``raw_manifest`` is None or cannot be
        read, so its blocks stay counted until :meth:`recount`."""
        db = self._db
        cur = txn.cursor(db=db.chunks)
        if cur.set_range(ekey):
            while owner_of_chunk(cur.key()) == ekey:
                if not cur.delete():
                    break
        eid = _keys.entry_id(ekey)
        released = False
        if raw_manifest is not None:
            try:
                man = _entry.unpack_manifest(bytes(raw_manifest), eid)
                _index.remove(txn, db, model_of(ekey), man.tokens, _keys.prefix_hashes(man.tokens), ekey, man.trimmable)
            except PromptStoreError:
                pass  # damaged manifest: its index records become harmless dead ends (its blob and blocks, leftovers)
            else:
                self._release(txn, man)
                released = True
                if man.blob is not None and man.blob.startswith(eid + "-"):
                    blob = man.blob
                    self._env.after_commit(lambda: self._blobs.unlink(blob))
        _budget.drop_used(txn, db, ekey)
        txn.delete(eid.encode(), db=db.ids)
        _budget.forget(txn, db, ekey)
        txn.delete(ekey, db=db.entries)
        return released

    def drop(self, txn, ekey: bytes) -> bool:
        """Delete the entry at ``ekey`` and its pin; False when there is none.
        An entry whose manifest cannot be read is deleted too, and the blocks
        recounted (:meth:`recount`)."""
        raw = txn.get(ekey, db=self._db.entries)
        if raw is None:
            return False
        released = self.unlink(txn, ekey, bytes(raw))
        txn.delete(ekey, db=self._db.pins)
        if not released:
            self.recount(txn)
        return True

    # -- a put: its own transaction ---------------------------------------------

    def put(
        self,
        model: str,
        model_name: str,
        toks: np.ndarray,
        encoded: Sequence[Encoded],
        trimmable: bool,
        meta: Dict[str, Any],
        *,
        created: Optional[float] = None,
        used: Optional[float] = None,
        expect: Optional[bytes] = None,
    ) -> Written:
        """Write an entry of ``encoded`` layers in one write transaction.

        ``created`` and ``used`` (default: now) keep an entry's dates when it
        is rewritten; with ``expect``, the entry is written only if the
        manifest at its key is still ``expect`` (else :class:`Changed` is
        raised and nothing is written), and nothing is evicted to make room.

        With ``shared_blocks``, the arrays of layers whose codec allows it go
        to shared blocks, cut at the bounds of the stored entry that shares the
        longest prefix with this one (see ``format._blocks``): only blocks the
        store lacks are written. The rest is the entry's own payload; one of
        at least ``_blobs.MIN_PAYLOAD`` bytes goes to a blob file, written and
        fsynced under the writer lock inside the transaction that commits its
        manifest (see ``format._blobs``).

        Raises:
            InvalidInput: ``meta`` cannot be serialised, a layer would
                not decode (``codecs.check_encoded``), or the manifest would
                not read back (``_entry.pack_manifest``); nothing is committed.
            CoverageMismatch: a layer would decode covering other than
                ``len(toks)`` tokens; before any write.
            StoreFull: no room (nothing was written).
        """
        n = len(toks)
        check_encoded(encoded, n)  # what a get would refuse is never written
        shared_kind = (lambda enc: codec_for_kind(enc.kind).shared_blocks) if self.shared_blocks else None
        records, views, payload = _payload.prepare(encoded, n, shared_kind)
        blob = payload >= _blobs.MIN_PAYLOAD
        # A blob entry's checksums are computed while its file is written.
        hashing = _fill.submit(_payload.add_checksums, records, views) if blob else None
        if not blob:
            _payload.add_checksums(records, views)
        mid = _keys.model_id(model)
        ekey = _keys.entry_key(mid, toks)
        eid = _keys.entry_id(ekey)
        bounds: Tuple[int, ...] = ()
        blocks: List[Block] = []
        shared = 0
        if any(len(a) == 7 for rec in records for a in rec["arrays"]):
            bounds = _blocks.plan_bounds(*self._base(model, mid, toks), n, self.block_tokens)
            blocks, shared = _cut(records, bounds)
        now = time.time() if created is None else created
        last_used = F64.pack(now if used is None else used)
        committed: List[bytes] = []  # the manifest of the last attempt
        written: List[str] = []  # blob files this put wrote (one per attempt)
        packed: List[int] = []  # pack files this put wrote (one per attempt)

        def pack(blob_name: Optional[str]) -> bytes:
            return _entry.pack_manifest(
                model=model, model_name=model_name, tokens=toks, layers=records, payload=payload,
                created=now, trimmable=trimmable, meta=meta, entry_id=eid, blob=blob_name, bounds=bounds,
                read_back=blob_name is not None or not blob,
            )

        # Bad meta fails here, before any write, and so does a manifest a reader
        # would refuse, read back once as final: a blob entry's is packed again
        # once its checksums are in (they are None here), naming its file, and
        # is read back then, inside the transaction, its file removed if refused.
        manifest = pack(None)

        def write(txn) -> int:
            if expect is not None and bytes(txn.get(ekey, b"", db=self._db.entries)) != expect:
                raise Changed(eid)
            self._same_representation(txn, ekey, [rec["kind"] for rec in records])
            chunks: Iterable[Any] = ()
            man = manifest
            # Files are written under the writer lock; a retried transaction
            # drops its earlier files and writes new ones.
            for num in packed:
                self._packs.unlink(num)
            packed.clear()
            if hashing is not None:
                for name in written:
                    self._blobs.unlink(name)
                name = _blobs.new_name(eid)
                written.append(name)
                self._blobs.write(name, views)
                hashing.result()
                man = pack(name)
            else:
                chunks = _payload.iter_chunks(views, payload)
            committed[:] = [man]
            return self.add(txn, ekey, toks, trimmable, man, chunks, last_used, payload + len(man), evict=expect is None, blocks=blocks, packs=packed)

        try:
            new = self._env.write(write)
        except BaseException:
            # An interrupt can land after the commit (a signal is handled at the
            # next bytecode): the files the committed records name stay.
            for name in written:
                if not self._names_blob(ekey, name):
                    self._blobs.unlink(name)
            for num in packed:
                if not self._has_pack(num):
                    self._packs.unlink(num)
            raise
        return Written(eid, now, payload, shared, new, len(committed[0]))

    def _same_representation(self, txn, ekey: bytes, kinds: Sequence[str]) -> None:
        """Refuse to replace an entry whose layers hold gated-DeltaNet state as
        ``ssm.gated_delta`` (with coverage) by one that holds it as plain
        ``arrays`` (the other direction, an upgrade, is allowed).

        Raises:
            InvalidInput: the put would downgrade the stored representation.
        """
        old = self.readable(txn, ekey)
        if old is None or len(old.kinds) != len(kinds):
            return
        for i, (was, now) in enumerate(zip(old.kinds, kinds)):
            if _GATED in was and _GATED not in now and "arrays" in now:
                raise InvalidInput(
                    f"{self.path}: entry {old.entry_id} holds layer {i} as {was}; this put would replace it by {now} "
                    "(mlx-lm's ArraysCache): convert the cache with promptstore.ssm.to_ssm(cache, len(tokens)) first"
                )

    def _base(self, model: str, mid: bytes, toks: np.ndarray) -> Tuple[Tuple[int, ...], int]:
        """The block bounds of the stored entry sharing the longest prefix
        with ``toks``, and the length of that prefix (``((), 0)``: none).

        When no stored entry can serve ``toks`` (none is a prefix of it and
        no trimmable one shares a prefix with it: the conversations of a
        model with recurrent layers, stored whole), ``((), p)``: ``p`` the
        longest prefix, in whole blocks of the prefix index, that a stored
        entry of the model starts with. So a conversation that shares a
        system prompt with a stored one is cut inside the prompt, and from
        the next such conversation on the blocks up to there are shared.

        Read from a snapshot before the write: a stale answer only costs
        blocks that are not shared."""
        hashes = _keys.prefix_hashes(toks)
        with self._env.read() as txn:
            for _key, matched, man in _index.candidates(txn, self._db, mid, toks, lambda key: self.readable(txn, key), hashes):
                if man.model == model and man.bounds:
                    return man.bounds, matched
            return (), _index.indexed_prefix(txn, self._db, mid, toks, hashes)

    def _has_pack(self, pack: int) -> bool:
        """Whether the store records pack ``pack`` (True when that cannot be
        read: then the file stays, for gc)."""
        try:
            with self._env.read() as txn:
                return _packing.has_pack(txn, self._db, pack)
        except BaseException:
            return True

    def _names_blob(self, ekey: bytes, name: str) -> bool:
        """Whether the committed entry at ``ekey`` names blob file ``name``
        (True when that cannot be read: then the file stays, for gc)."""
        try:
            with self._env.read() as txn:
                raw = txn.get(ekey, db=self._db.entries)
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(ekey)) if raw is not None else None
        except BaseException:
            return True
        return man is not None and man.blob == name


def check_coverage(layers: Sequence[Any], n: int, coverage: Optional[int]) -> None:
    """Refuse a cache that is not exactly ``n`` tokens: a layer reporting
    another coverage, ``coverage`` (the caller's word) other than ``n``, or
    no layer reporting any and no ``coverage`` given.

    Raises:
        CoverageMismatch
    """
    if coverage is not None and coverage != n:
        raise CoverageMismatch(f"the cache covers {coverage} tokens but {n} tokens were given")
    reported = False
    for i, layer in enumerate(layers):
        cov = codec_for_layer(layer).coverage(layer)
        reported = reported or cov is not None
        if cov is not None and cov != n:
            raise CoverageMismatch(
                f"layer {i} ({storage_kind(layer)}) covers {cov} tokens but {n} tokens were given; "
                "pass exactly the tokens the cache has absorbed"
            )
    if not reported and coverage is None:
        raise CoverageMismatch(
            "no layer of this cache reports how many tokens it covers, so the tokens cannot be "
            "checked: pass coverage=len(tokens) when you know it (you prefilled the cache)"
        )


_PARALLEL_HASH = 16 << 20  # a put with at least this many bytes of blocks hashes them on the fill threads


def _cut(records: List[dict], bounds: Tuple[int, ...]) -> Tuple[List[Block], int]:
    """Replace each shared array in ``records`` (a 7th element: the array) by
    its block addresses; return the blocks, once per reference, and their bytes.

    A large put's blocks are hashed on the fill threads (the hash releases
    the GIL), each thread a run of consecutive blocks of about equal bytes."""
    cuts: List[Tuple[str, int, str, Tuple[int, ...], np.ndarray]] = []  # what _blocks.address hashes, in order
    total = 0
    for rec in records:
        for a in rec["arrays"]:
            if len(a) != 7:
                continue
            shape = a[2]
            data = np.frombuffer(_payload.host_bytes(a[6]), dtype=np.uint8)
            rows = data.reshape(-1, shape[-2], shape[-1] * _entry.DTYPES[a[1]].size)
            start = 0
            for end in bounds:
                cuts.append((rec["kind"], rec["version"], a[1], _blocks.block_shape(shape, start, end), rows[:, start:end, :]))
                start = end
            total += a[4]

    def addresses(lo: int, hi: int) -> List[bytes]:
        return [_blocks.address(*cut) for cut in cuts[lo:hi]]

    lanes = _fill.WORKERS if total >= _PARALLEL_HASH else 1
    if lanes == 1:
        keys = addresses(0, len(cuts))
    else:
        ends, acc = [0], 0
        for i, cut in enumerate(cuts):  # a lane ends past each lanes-th of the bytes
            acc += cut[4].nbytes
            if acc * lanes >= total * len(ends) and len(ends) < lanes:
                ends.append(i + 1)
        ends.append(len(cuts))
        futures = [_fill.submit(addresses, lo, hi) for lo, hi in zip(ends, ends[1:])]
        keys = [key for f in futures for key in f.result()]
    blocks = [(key, cut[4], cut[4].nbytes) for key, cut in zip(keys, cuts)]
    i = 0
    for rec in records:
        for a in rec["arrays"]:
            if len(a) == 7:
                a[6] = keys[i : i + len(bounds)]
                i += len(bounds)
    return blocks, total


def _contiguous(data: Any) -> Any:
    """A block's bytes in C order (a copy of a strided view; made only for blocks the store lacks)."""
    return np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data


def _rows(data: Any) -> List[memoryview]:
    """A block's bytes as contiguous pieces, in order, without a copy."""
    if isinstance(data, np.ndarray):
        return [row.reshape(-1).data for row in data] if not data.flags.c_contiguous else [data.reshape(-1).data]
    return [memoryview(data)]
