"""PromptStore: prompt caches in LMDB, keyed by model identity and exact tokens.

The facade. It validates its arguments and hands the work to collaborators
that own their state: :class:`~promptstore.store._env.Env` (transactions),
:class:`~promptstore.store._read.Reader`, :class:`~promptstore.store._find.Finder`
(the queries), :class:`~promptstore.store._write.EntryWriter`
(the one write path), :class:`~promptstore.store._catalog.Catalog` (ids,
listing), :class:`~promptstore.store._usage.Usage` (last use, counters),
:class:`~promptstore.store._capacity.Capacity` (budget, pins, gc) and
:class:`~promptstore.store._verify.Maintenance` (verify).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from promptstore import rows
from promptstore._paths import default_path, store_path
from promptstore.codecs import detached, encode_layer, is_trimmable, layers_of
from promptstore.errors import InvalidInput
from promptstore.format import _blobs, _blocks, _entry, _packs
from promptstore.identity import model_name_of
from promptstore.remote import Found, RemoteTier, RemoteURL, open_remote
from promptstore.store import _keys
from promptstore.store._budget import check_budget
from promptstore.store._capacity import Capacity
from promptstore.store._catalog import Catalog, id_list
from promptstore.store._env import DEFAULT_MAP_SIZE, MAX_MAP_SIZE, Env
from promptstore.store._lmdbfile import live_data_size
from promptstore.store._fetched import adopt, remote_key
from promptstore.store._find import Finder
from promptstore.store._gate import CLOSE_TIMEOUT, closed_error
from promptstore.store._read import Reader
from promptstore.store._results import EntryInfo, GcReport, Hit, SalvageReport, VerifyReport, utc
from promptstore.store._salvage import salvage_held
from promptstore.store._upgrade import upgrade as _upgrade
from promptstore.store._schema import Tables
from promptstore.store._usage import Usage, try_flush
from promptstore.store._verify import Maintenance
from promptstore.store._write import EntryWriter, check_coverage

__all__ = ["PromptStore", "EntryInfo", "Hit", "VerifyReport", "default_path"]

log = logging.getLogger("promptstore")


class PromptStore:
    """Prompt caches in an LMDB environment.

    Args:
        path: the store directory; None means :func:`default_path`
            (``$PROMPTSTORE_DIR``, else ``promptstore`` in the user's cache
            folder). Created when missing (unless ``readonly``).
        map_size: initial LMDB map (address space only; it grows on demand).
        readonly: open without write access.
        budget: a byte budget to set and remember in the store (see
            :meth:`set_budget`); None keeps the stored one.
        shared_blocks: keep the KV arrays of what this instance puts in
            content-addressed blocks that entries sharing a prefix share
            (entry format 3, see ``promptstore.format._blocks``); None reads
            ``$PROMPTSTORE_SHARED_BLOCKS`` (``0``: off), on by default.
            Entries of either layout are read either way.
        block_tokens: the most tokens one new shared block spans
            (default :data:`~promptstore.format._blocks.BLOCK_TOKENS`).
        remote: a shared tier, ``redis://[user:password@]host:port[/db]``
            (``rediss://`` for TLS; a Redis Cluster is found from any node;
            see ``promptstore.remote``): what is put is published in the
            background, and a local miss or a longer remote match is
            fetched, checked, written here and restored. None reads
            ``$PROMPTSTORE_REMOTE``; False means none.

    One instance serves any number of threads; other processes may open the
    same path at the same time. Never use an instance across ``fork()``.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike, None] = None,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        readonly: bool = False,
        budget: Optional[int] = None,
        shared_blocks: Optional[bool] = None,
        block_tokens: int = _blocks.BLOCK_TOKENS,
        remote: Union[str, bool, RemoteURL, None] = None,
    ):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise InvalidInput(f"block_tokens must be a positive token count, not {block_tokens!r}")
        if isinstance(map_size, bool) or not isinstance(map_size, int) or not 0 < map_size <= MAX_MAP_SIZE:
            raise InvalidInput(f"map_size must be a byte count from 1 to {MAX_MAP_SIZE}, not {map_size!r}")
        check_budget(budget)  # before the store's folder is created
        self._remote: Optional[RemoteTier] = None
        tier = open_remote(remote)  # a bad URL fails before anything is opened
        self.path = store_path(path) if path is not None else default_path()
        env = Env(self.path, map_size=map_size, readonly=readonly)
        self._env: Optional[Env] = env
        tables = env.db
        self._blobs = _blobs.Blobs(self.path)
        self._packs = _packs.Packs(self.path)
        self._usage = Usage(tables, env.after_commit)
        self._reader = Reader(self.path, env, tables, self._blobs, self._packs)
        if shared_blocks is None:
            shared_blocks = os.environ.get("PROMPTSTORE_SHARED_BLOCKS", "1") != "0"
        self._writer = EntryWriter(self.path, env, tables, self._blobs, self._packs, self._usage, shared_blocks, block_tokens,
                                   damaged=self._reader.damaged)
        self._catalog = Catalog(self.path, tables, self._usage)
        self._maintenance = Maintenance(self.path, env, tables, self._blobs, self._packs, self._reader, self._writer)
        self._finder = Finder(self.path, self._reader, self._catalog, self._usage)
        self._capacity = Capacity(self.path, env, tables, self._usage, self._catalog, self._writer, self._maintenance)
        env.check_format(self._maintenance.upgrade_format)
        env.check_identity()
        if budget is not None:
            self.set_budget(budget)
        self._remote = tier

    # -- lifecycle -----------------------------------------------------------

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush recorded usage (a failure is logged: it is advisory) and close
        the store; safe while other threads use it. New operations raise
        StoreClosed from the call on; those in flight in other threads finish,
        then usage is flushed and the files close
        (the rules: :meth:`promptstore.store._gate.Gate.close`). An operation of
        several transactions (``verify``, ``gc``) cut by it raises StoreClosed.
        In a forked child it only drops this object's reference.

        Raises:
            StoreUnavailable: called inside an operation of this thread, or
                operations in flight outlast ``timeout`` seconds; the files
                then close when the last of them ends (usage not flushed).
        """
        tier, self._remote = getattr(self, "_remote", None), None
        if tier is not None:  # publish what is queued (bounded), then let go of the remote
            tier.close()
        env = self._env
        if env is None:
            return
        last = functools.partial(try_flush, self.flush, "at close failed (they are dropped)")
        try:
            env.close(timeout, last=last if os.getpid() == env.pid else None)
        finally:
            if env.closed or os.getpid() != env.pid:
                self._env = None

    def __enter__(self) -> "PromptStore":
        return self

    def __exit__(self, *exc: Any) -> None:
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

    block_tokens = property(lambda self: self._writer.block_tokens, doc="The most tokens one new shared block spans.")

    @property
    def remote(self) -> Optional[RemoteTier]:
        """The shared tier (its ``stats()``, ``flush()``, ``remote.entries()``), or None."""
        return self._remote

    @property
    def _db(self) -> Tables:
        """The open tables (for tools and tests that read records raw)."""
        return self.env.db

    def flush(self) -> None:
        """Write recorded last-use times and hit counters (done on every put,
        on close, and in the background within ``_usage.FLUSH_EVERY`` seconds
        of a read; a store opened read-only keeps them to itself)."""
        if not self.env.readonly and self._usage.pending():
            self.env.write(self._usage.flush_in)

    def _flush_soon(self) -> None:
        """Have recorded usage written within ``_usage.FLUSH_EVERY`` seconds, in the background."""
        env = self._env
        if env is not None and not env.readonly and os.getpid() == env.pid:
            self._usage.flush_soon(env, self.flush)

    # -- writing -------------------------------------------------------------

    def put(self, model: str, tokens: _keys.Tokens, cache: Sequence[Any], meta: Optional[Dict[str, Any]] = None,
            *, coverage: Optional[int] = None) -> EntryInfo:
        """Store ``cache`` as the prompt cache of ``tokens`` under ``model``.

        Args:
            model: the model identity, normally ``fingerprint(...)``; any
                non-empty string is accepted.
            tokens: the token ids the cache covers, exactly.
            cache: the per-layer cache objects (``make_prompt_cache(model)``).
            meta: optional user metadata: a dict with str keys whose values
                are str, int, finite float, bool, None, lists and such dicts
                (what reads back as written and prints as JSON).
            coverage: the tokens the cache has absorbed, as the caller knows
                it (it prefilled the cache). Required when no layer reports
                its coverage (e.g. every layer an ``arrays`` state); checked
                against ``len(tokens)`` whenever given.

        Returns:
            The stored entry's EntryInfo. An existing entry for the same model
            and tokens is replaced.

        Raises:
            CoverageMismatch: a layer covers another number of tokens (or
                its arrays hold fewer than its offset says), or no layer
                reports coverage and ``coverage`` was not given, or
                ``coverage`` differs from ``len(tokens)``.
            UnknownStorageKind: a layer's class has no codec.
            InvalidInput: bad model id, tokens, cache (not a list of layers,
                or a layer whose arrays disagree with its own state so that
                it could not be read back) or meta (see
                :func:`promptstore.format._entry.check_meta`), or a manifest a
                reader would refuse; nothing was written, a stored entry is untouched.
            StoreFull: disk or map full; nothing was written.
        """
        return self._put(model, tokens, cache, meta, coverage, publish=True)

    def _put(self, model: str, tokens: _keys.Tokens, cache: Sequence[Any], meta: Optional[Dict[str, Any]],
             coverage: Optional[int], publish: bool) -> EntryInfo:
        _keys.model_id(model)
        toks = _keys.as_tokens(tokens)
        if len(toks) > _entry.MAX_TOKENS:  # its manifest could not be read back
            raise InvalidInput(f"an entry covers at most {_entry.MAX_TOKENS} tokens, not {len(toks)}")
        layers = layers_of(cache)
        if not layers:
            raise InvalidInput("cache has no layers")
        n = len(toks)
        check_coverage(layers, n, coverage)
        if meta is not None:
            _entry.check_meta(meta)  # early, before encoding; every write checks it again as it packs the manifest
            meta = _entry.meta_as_read(meta)  # what the returned EntryInfo and the remote copy hold
        encoded = [encode_layer(layer) for layer in layers]
        trimmable = is_trimmable(layers)
        name = model_name_of(model)
        tier = self._remote
        done = self._writer.put(model, name, toks, encoded, trimmable, dict(meta or {}))
        if publish and tier is not None:  # write-behind: never waits on the network
            tier.publish_later(remote_key(model, toks), name, detached(encoded), trimmable, dict(meta or {}), done.created)
        return EntryInfo(
            id=done.entry_id,
            model=model,
            model_name=name,
            n_tokens=n,
            kinds=tuple(e.kind for e in encoded),
            nbytes=done.payload + done.shared,
            created=utc(done.created),
            last_used=utc(done.created),
            trimmable=trimmable,
            meta=dict(meta or {}),
            shared=done.shared,
            added=done.payload + done.manifest + done.written,
        )

    def put_row(self, model: str, tokens: _keys.Tokens, batch_cache: Sequence[Any], row: int, meta: Optional[Dict[str, Any]] = None,
                *, gated: rows.Gated = None) -> EntryInfo:
        """Store row ``row`` of a running batch as a serial entry; the batch is untouched.

        See :func:`promptstore.rows.put_row` (Args, Returns, Raises): the row is
        extracted compactly, refused with CoverageMismatch unless it covers
        exactly ``tokens``; a row index out of range raises InvalidInput.
        ``gated`` (one flag per layer, e.g. ``gated_delta_layers(model)``, or
        True): those layers' ArraysCache states are stored as ``ssm.gated_delta``.
        """
        return rows.put_row(self, model, tokens, batch_cache, row, meta, gated=gated)

    def delete(self, model: str, tokens: _keys.Tokens) -> bool:
        """Delete the entry of exactly ``tokens``; True when one existed."""
        ekey = _keys.entry_key(_keys.model_id(model), _keys.as_tokens(tokens))
        self._usage.forget([ekey])
        return self.env.write(lambda txn: self._writer.drop(txn, ekey))

    def remove(self, key: str) -> EntryInfo:
        """Delete an entry by id (or unique id prefix) and return what it was.

        Raises:
            EntryNotFound: no entry, or the prefix is ambiguous.
        """
        def write(txn) -> Tuple[EntryInfo, bytes]:  # resolve and delete in one transaction
            ekey, man = self._finder.resolve(txn, key)
            info = self._catalog.info(txn, ekey, man)
            self._writer.drop(txn, ekey)
            return info, ekey

        info, ekey = self.env.write(write)
        self._usage.forget([ekey])
        return info

    def remove_planned(self, plan: Sequence[EntryInfo]) -> Tuple[List[EntryInfo], List[str]]:
        """Delete exactly the entries of ``plan`` (from :meth:`entries` or
        :meth:`info`), in one transaction: ``(removed, vanished ids)``.

        An entry deleted or replaced by a newer put since the plan was made is
        left alone and reported as vanished, so what is deleted is never more
        than what was planned.

        Raises:
            InvalidInput: ``plan`` holds something other than EntryInfo objects.
        """
        return self._capacity.remove_planned(plan)

    # -- reading ---------------------------------------------------------------

    def _manifest(self, txn, ekey: bytes) -> Optional[_entry.Manifest]:
        """The manifest at ``ekey`` (for tools and tests)."""
        return self._reader.manifest(txn, ekey)

    def exists(self, model: str, tokens: _keys.Tokens) -> bool:
        """True when an entry of exactly ``tokens`` under ``model`` is stored.

        Cheap: reads the manifest only, no arrays, and counts no hit or miss.
        An entry whose manifest is damaged or does not match counts as absent,
        so a caller that re-puts it replaces it; so does one naming a shared
        block that a read of this process found damaged (the put writes it again).
        """
        toks = _keys.as_tokens(tokens)
        return self._finder.exists(self.env, model, toks)

    def touch(self, model: str, tokens: _keys.Tokens) -> None:
        """Record a use of the entry of exactly ``tokens`` (if stored) for the
        eviction order, reading nothing: for a caller that served it from its
        own memory (written within ``_usage.FLUSH_EVERY`` seconds)."""
        self.env  # closed: StoreClosed, as every other call
        toks = _keys.as_tokens(tokens)
        self._usage.touch(_keys.entry_key(_keys.model_id(model), toks))
        self._flush_soon()

    def get(self, model: str, tokens: _keys.Tokens) -> Optional[List[Any]]:
        """The stored cache of exactly ``tokens``, or None.

        Raises:
            CorruptEntry: the entry is damaged (nothing is returned).
            UnknownStorageKind, UnsupportedVersion: written by a newer promptstore.
            ModelMismatch: the entry's recorded identity is not ``model``.
        """
        toks = _keys.as_tokens(tokens)
        hit = self._reader.again(lambda lost: self._finder.exact(self.env, model, toks, lost))
        self._flush_soon()
        tier = self._remote  # read once: close() in another thread drops it
        if hit is None and tier is not None:
            got = tier.remote.read_exact(remote_key(model, toks))
            hit = None if got is None else self._adopt(model, tier, *got)
        return None if hit is None else hit.cache

    def peek(self, model: str, tokens: _keys.Tokens) -> int:
        """How many tokens of ``tokens`` :meth:`lookup` would cover, reading
        manifests only (no arrays), so a caller can skip a restore that would
        not beat what it holds. 0 when nothing matches.
        """
        toks = _keys.as_tokens(tokens)
        local = self._finder.peek(self.env, model, toks)
        tier = self._remote
        if tier is not None and local < len(toks):
            found = tier.remote.find(remote_key(model, toks), local)
            return found.matched if found is not None else local
        return local

    def prefixes(self, model: str, tokens: _keys.Tokens) -> List[EntryInfo]:
        """The stored entries of ``model`` whose tokens are a prefix of
        ``tokens`` (``tokens`` itself included), longest first; manifests only.
        Its cost is bounded by the query, not by the number of entries."""
        toks = _keys.as_tokens(tokens)
        return self._finder.prefixes(self.env, model, toks)

    def lookup(self, model: str, tokens: _keys.Tokens) -> Optional[Hit]:
        """The longest usable stored prefix of ``tokens``, restored.

        An entry whose tokens are a prefix of the query is usable as is; a
        longer entry whose layers are all trimmable is trimmed down to the
        common prefix. Recurrent entries match only at their exact length.
        Damaged candidates are logged and skipped.

        Returns:
            A Hit (``matched`` tokens are covered by ``hit.cache``; the
            caller prefills ``tokens[hit.matched:]``), or None.
        """
        toks = _keys.as_tokens(tokens)
        hit = self._reader.again(lambda lost: self._finder.longest(self.env, model, toks, lost))
        self._flush_soon()
        tier = self._remote
        if tier is not None and (hit is None or hit.matched < len(toks)):
            got = tier.remote.read_through(remote_key(model, toks), hit.matched if hit else 0, hit.cache if hit else None)
            if got is not None:
                return self._adopt(model, tier, *got) or hit
        return hit

    # -- the remote tier -----------------------------------------------------------

    def _adopt(self, model: str, tier: RemoteTier, found: Found, cache: List[Any]) -> Optional[Hit]:
        """A remote entry ``tier`` fetched, written to this store, not published
        again (see :func:`adopt`). StoreClosed: the store closed meanwhile."""
        put = None if self.env.readonly else functools.partial(self._put, publish=False)
        return adopt(model, found.manifest, cache, found.matched, put, tier.remote)

    def load(self, key: str, model: Optional[str] = None) -> Tuple[List[Any], EntryInfo, List[int]]:
        """Restore an entry by id: ``(cache, info, tokens)``.

        Raises:
            EntryNotFound: no such id.
            ModelMismatch: ``model`` is given and the entry belongs to another.
            CorruptEntry, UnknownStorageKind, UnsupportedVersion.
        """
        return self._reader.again(lambda lost: self._finder.by_id(self.env, key, model, lost))

    # -- inspecting ------------------------------------------------------------

    def info(self, key: str) -> EntryInfo:
        """EntryInfo of the entry with id (or unique id prefix) ``key``.

        Raises:
            EntryNotFound: no such entry, or the prefix is ambiguous.
        """
        return self._finder.info(self.env, key)

    def tokens(self, key: str) -> List[int]:
        """The token ids of the entry with id (or unique prefix) ``key``."""
        return self._finder.tokens(self.env, key)

    def entries(self, model: Optional[str] = None) -> Iterator[EntryInfo]:
        """EntryInfo of every readable entry (of ``model`` when given).

        Entries whose manifest is damaged are skipped with a warning; run
        :meth:`verify` to list them.
        """
        with self.env.read() as txn:
            return iter(self._catalog.listing(txn, model))

    def own_bytes(self, keys: Iterable[str]) -> Dict[str, int]:
        """For each entry id: its array bytes that no other entry shares
        (deleting it alone frees them, plus its manifest). The rest of its
        ``nbytes`` is in shared blocks other entries also reference. Ids no
        longer stored (or unreadable) are left out.

        Raises:
            InvalidInput: ``keys`` is not a list of ids.
        """
        with self.env.read() as txn:
            return self._catalog.own_bytes(txn, keys, lambda ekey: self._reader.manifest(txn, ekey))

    def frees(self, keys: Iterable[str]) -> int:
        """What deleting the entries of these ids together frees: their own
        bytes (payload, manifest) and the blocks no other entry references.
        Ids not stored are left out; not a list of ids: InvalidInput."""
        return self._capacity.frees(id_list(keys))

    def counters(self) -> Dict[str, int]:
        """Hits and misses recorded by every process (after their flush)."""
        self.flush()
        with self.env.read() as txn:
            return self._usage.counters(txn)

    def file_size(self) -> int:
        """Bytes the store's files take: the LMDB data file (it never shrinks
        by itself), the blob files of large entries and the pack files of
        shared blocks. The data file is the live generation's, which
        another process's compaction may have moved (``StoreUnavailable``
        when it is never found)."""
        return live_data_size(self.path) + self._blobs.nbytes() + self._packs.nbytes()

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every manifest and checksum; with ``fix``, delete what is broken.

        Returns:
            A VerifyReport listing each damaged entry and orphaned chunks,
            and counting the blob files no entry names. Those are leftovers
            of puts killed before their commit, not damage: they do not make
            the report fail, and a put in flight may show as one; ``fix``
            (and :meth:`gc`) decide again under the writer lock and remove
            them. Entries written by a newer promptstore (an entry format,
            storage kind or codec version this one does not know, their
            manifest intact) are listed in ``newer``: they are not damage,
            do not fail the report, and ``fix`` keeps them. It also repairs
            ``bad_counts``, removes ``orphan_blocks``, and rebuilds
            ``bad_records`` (a lost block place first, from its pack file):
            it never deletes an intact entry, and lists what it deleted in ``removed``.

        Raises:
            InvalidInput: ``fix`` is not a bool.
        """
        if not isinstance(fix, bool):  # fix="no" would delete what is broken
            raise InvalidInput(f"fix must be True or False, not {fix!r:.80}")
        return self._maintenance.verify(fix)

    # -- capacity --------------------------------------------------------------

    @property
    def budget(self) -> Optional[int]:
        """The store's byte budget (remembered in the store), or None."""
        return self._capacity.budget()

    def usage(self) -> int:
        """Bytes the entries account for (payloads plus manifests)."""
        return self._capacity.usage()

    def set_budget(self, budget: Optional[int], plan: Optional[GcReport] = None) -> GcReport:
        """Set (or with None, remove) the byte budget, remembered by the store,
        and evict least-recently-used unpinned entries down to it (or, given
        ``plan`` from ``gc(budget, dry_run=True)``, exactly the planned ones).

        From then on every ``put`` evicts in its own transaction, so the store
        never holds more than the budget plus the entry being written.

        Raises:
            InvalidInput: not a byte count the store can hold, or ``plan``
                is not a GcReport.
            StoreFull: the pinned entries alone exceed the budget (nothing changes).
        """
        return self._capacity.set_budget(budget, plan)

    def gc(self, budget: Optional[int] = None, dry_run: bool = False, plan: Optional[GcReport] = None) -> GcReport:
        """Evict least-recently-used unpinned entries down to the budget.

        Also recounts the size accounting, drops pins of deleted entries and
        removes blob files no entry names (left by a put killed before its
        commit, or by a crash before a deleted entry's file was unlinked).

        Args:
            budget: evict down to this many bytes instead of the stored budget
                (the stored budget is not changed; use :meth:`set_budget`).
            dry_run: report what would be evicted; change nothing. The
                report is a plan.
            plan: a dry run's report: evict exactly its entries that are
                still there (and not pinned since), no others.

        Returns:
            A GcReport; with no budget and no plan nothing is evicted.

        Raises:
            InvalidInput: ``budget`` is not a byte count the store can hold,
                or ``plan`` is not a GcReport.
        """
        return self._capacity.gc(budget, dry_run, plan)

    def pin(self, key: str) -> None:
        """Pin the entry with id (or unique prefix) ``key``: never evicted.

        Raises:
            EntryNotFound: no such entry.
            StoreFull: pinned entries would exceed the budget.
        """
        self._capacity.pin(key)

    def unpin(self, key: str) -> bool:
        """Unpin an entry; True when it was pinned."""
        return self._capacity.unpin(key)

    def pinned(self) -> List[str]:
        """Ids of the pinned entries."""
        return self._capacity.pinned()

    def compact(self, upgrade: bool = True) -> Tuple[int, int]:
        """Rewrite the data file without its free pages, and every pack file
        that holds blocks no entry uses any more without them: ``(bytes
        before, after)`` of the store's files (:meth:`file_size`), before
        measured as the call starts.

        With ``upgrade`` (and shared blocks on), entries of the older layouts
        are first rewritten into shared blocks (:meth:`upgrade`).

        Safe while other processes use the store: they move to the compacted
        file at their next transaction (see ``promptstore.store._env``). Needs
        free disk space for the compacted copy.

        Raises:
            StoreFull: no room for the copy (the store is unchanged).
        """
        before = self.file_size()  # before the upgrade and the repack write anything
        if upgrade:
            self.upgrade()
        self.flush()
        self._writer.write_packs(lambda txn, fresh: self._writer.repack(txn, fresh, every=True))
        _, after = self.env.compact()
        return before, after + self._blobs.nbytes() + self._packs.nbytes()

    def upgrade(self) -> int:
        """Rewrite entries of the older layouts (entry formats 1 and 2) whose
        KV arrays can be shared into shared blocks, keeping their dates and
        pins; returns how many were rewritten. Entries changed meanwhile,
        damaged or written by a newer promptstore are left as they are.
        A no-op when this instance does not write shared blocks."""
        return _upgrade(self.env, self.env.db, self._reader, self._writer)

    def salvage(self, dst: Union[str, os.PathLike]) -> SalvageReport:
        """Copy every intact entry of this store into a fresh store at ``dst``.

        See :func:`promptstore.salvage`.
        """
        return salvage_held(self.env, self.path, dst)

