"""The read side's queries, each in one read transaction: an entry of
exactly some tokens, the longest usable prefix of a query, the prefixes
stored, an entry by id. A restore counts a hit and touches the entry's last
use; a query that finds nothing counts a miss. The remote tier and the
retries after a vanished blob file stay with the facade (``_store``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Collection, List, Optional, Set, Tuple

import numpy as np

from promptstore.codecs import trim_cache
from promptstore.errors import CorruptEntry, MissingCapability, ModelMismatch, PromptStoreError, UnknownStorageKind, UnsupportedVersion
from promptstore.format import _blobs
from promptstore.format._entry import Manifest
from promptstore.store import _index, _keys
from promptstore.store._catalog import Catalog
from promptstore.store._env import Env
from promptstore.store._read import Reader
from promptstore.store._results import EntryInfo, Hit
from promptstore.store._usage import Usage

log = logging.getLogger("promptstore")


class Finder:
    """Finds and restores entries for :class:`~promptstore.store._store.PromptStore`.

    Each query is given the live environment (``PromptStore.env``, which
    raises StoreClosed once the store is closed)."""

    def __init__(self, path: Path, reader: Reader, catalog: Catalog, usage: Usage):
        self.path = path
        self._reader = reader
        self._catalog = catalog
        self._usage = usage

    def resolve(self, txn, key: str) -> Tuple[bytes, Manifest]:
        """The entry key and manifest of the entry with id (or unique id prefix) ``key``.

        Raises:
            EntryNotFound: no such entry, or the prefix is ambiguous.
        """
        ekey = self._catalog.resolve(txn, key)
        man = self._reader.manifest(txn, ekey)
        if man is None:
            raise self._catalog.vanished(key)
        return ekey, man

    def exists(self, env: Env, model: str, toks: np.ndarray) -> bool:
        """``PromptStore.exists``: a readable, intact manifest of exactly ``toks``
        under ``model``, naming no block a read of this process found damaged."""
        ekey = _keys.entry_key(_keys.model_id(model), toks)
        with env.read() as txn:
            try:
                man = self._reader.manifest(txn, ekey)
            except PromptStoreError:
                return False
        return (man is not None and man.intact and man.model == model and np.array_equal(man.tokens, toks)
                and not self._reader.known_damaged(man))

    def exact(self, env: Env, model: str, toks: np.ndarray, lost: Collection[str] = ()) -> Optional[Hit]:
        """The entry of exactly ``toks``, restored; None (a miss, counted) when absent."""
        ekey = _keys.entry_key(_keys.model_id(model), toks)
        with env.read(buffers=True) as txn:
            man = self._reader.manifest(txn, ekey)
            if man is None:
                self._usage.count("misses")
                return None
            if man.model != model:
                raise ModelMismatch(f"{self.path} entry {man.entry_id} belongs to model {man.model!r}, not {model!r}")
            if not np.array_equal(man.tokens, toks):
                raise CorruptEntry(f"{self.path} entry {man.entry_id}: stored tokens do not match its key")
            cache = self._reader.restore(txn, ekey, man, lost=lost)
            info = self._catalog.info(txn, ekey, man)
        self._usage.touch(ekey)
        self._usage.count("hits")
        return Hit(cache, len(toks), info, 0, man.payload + man.shared_bytes)

    def peek(self, env: Env, model: str, toks: np.ndarray) -> int:
        """Tokens of ``toks`` the longest local candidate covers (manifests
        only): the first candidate :meth:`longest` would not skip for what
        its manifest tells (of another model, a trim it cannot take, its
        checksum broken, a codec this promptstore lacks, a block a read of
        this process found damaged). Damage only its arrays show is not seen."""
        mid = _keys.model_id(model)
        with env.read() as txn:
            manifest = lambda ekey: self._reader.safe_manifest(txn, ekey)  # noqa: E731
            return next((m for _e, m, man in _index.candidates(txn, env.db, mid, toks, manifest) if self._may_serve(man, model, m)), 0)

    def _may_serve(self, man: Manifest, model: str, matched: int) -> bool:
        if man.model != model or not man.reaches(matched) or not man.intact or self._reader.known_damaged(man):
            return False
        try:
            man.check_readable(man.entry_id)
        except PromptStoreError:
            return False
        return True

    def prefixes(self, env: Env, model: str, toks: np.ndarray) -> List[EntryInfo]:
        """``PromptStore.prefixes``: the entries whose tokens are a prefix of ``toks``, longest first."""
        mid = _keys.model_id(model)
        found: List[EntryInfo] = []
        with env.read() as txn:
            manifest = lambda ekey: self._reader.safe_manifest(txn, ekey)  # noqa: E731
            for _n, ekey, man in _index.exact(txn, env.db, mid, toks, manifest):
                if man.model == model:
                    found.append(self._catalog.info(txn, ekey, man))
        return found

    def longest(self, env: Env, model: str, toks: np.ndarray, lost: Set[str]) -> Optional[Hit]:
        """The longest usable prefix of ``toks`` (``PromptStore.lookup``), restored;
        damaged candidates are skipped, those whose blob files are in ``lost``
        too (another's are looked for again: ``Reader.again``)."""
        mid = _keys.model_id(model)
        with env.read(buffers=True) as txn:
            manifest = lambda ekey: self._reader.safe_manifest(txn, ekey)  # noqa: E731
            for ekey, matched, man in _index.candidates(txn, env.db, mid, toks, manifest):
                if not man.reaches(matched):  # it no longer holds its first tokens: nothing to trim to
                    continue
                try:
                    if man.model != model:
                        raise ModelMismatch(f"entry {man.entry_id} belongs to {man.model!r}, not {model!r}")
                    # A prefix of a longer entry reads only the blocks it needs.
                    read = man.prefix(matched) if matched < len(man.tokens) else None
                    read = read if read is not None else man
                    cache = self._reader.restore(txn, ekey, read, lost=lost)
                    if len(read.tokens) > matched:
                        trim_cache(cache, len(read.tokens) - matched)
                except _blobs.Vanished as err:
                    if err.blob not in lost:
                        raise  # deleted since this snapshot, or lost: look again
                    log.warning("promptstore: skipping entry %s: %s (run `promptstore verify --fix`)", man.entry_id, err)
                    continue
                except (UnsupportedVersion, UnknownStorageKind) as err:
                    if not man.intact:
                        log.warning("promptstore: skipping entry %s: %s (run `promptstore verify --fix`)", man.entry_id, err)
                    else:  # not damage: never suggest deleting it
                        log.warning("promptstore: skipping entry %s, written by a newer promptstore: %s", man.entry_id, err)
                    continue
                except MissingCapability as err:  # an intact entry that cannot be cut to this prefix
                    log.warning("promptstore: skipping entry %s for a %d-token prefix: %s", man.entry_id, matched, err)
                    continue
                except PromptStoreError as err:
                    log.warning("promptstore: skipping entry %s: %s (run `promptstore verify --fix`)", man.entry_id, err)
                    continue
                info = self._catalog.info(txn, ekey, man)
                self._usage.touch(ekey)
                self._usage.count("hits")
                return Hit(cache, matched, info, len(man.tokens) - matched, read.payload + read.shared_bytes)
        self._usage.count("misses")
        return None

    def by_id(self, env: Env, key: str, model: Optional[str], lost: Collection[str] = ()) -> Tuple[List[Any], EntryInfo, List[int]]:
        """``PromptStore.load``: ``(cache, info, tokens)`` of the entry with id (or unique prefix) ``key``."""
        with env.read(buffers=True) as txn:
            ekey, man = self.resolve(txn, key)
            if model is not None and man.model != model:
                raise ModelMismatch(f"{self.path} entry {man.entry_id} belongs to model {man.model!r}, not {model!r}")
            cache = self._reader.restore(txn, ekey, man, lost=lost)
            info = self._catalog.info(txn, ekey, man)
        self._usage.touch(ekey)
        return cache, info, man.tokens.tolist()

    def info(self, env: Env, key: str) -> EntryInfo:
        """``PromptStore.info``: the EntryInfo of the entry with id (or unique prefix) ``key``."""
        with env.read() as txn:
            ekey, man = self.resolve(txn, key)
            return self._catalog.info(txn, ekey, man)

    def tokens(self, env: Env, key: str) -> List[int]:
        """``PromptStore.tokens``: the token ids of the entry with id (or unique prefix) ``key``."""
        with env.read() as txn:
            return self.resolve(txn, key)[1].tokens.tolist()
