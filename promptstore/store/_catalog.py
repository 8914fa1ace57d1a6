"""The catalog: entries by id, their EntryInfo, the listing, and the counters."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

from promptstore.errors import EntryNotFound, InvalidInput, PromptStoreError
from promptstore.format import _entry
from promptstore.store import _budget, _keys
from promptstore.store._results import EntryInfo, utc
from promptstore.store._schema import ENTRY_ID, Tables, f64_or, model_of
from promptstore.store._usage import Usage

log = logging.getLogger("promptstore")

_HEX = frozenset("0123456789abcdef")


def id_list(keys: Iterable[str]) -> List[str]:
    """``keys`` as a list of entry ids (str).

    Raises:
        InvalidInput: ``keys`` is not a list of ids (one string is not).
    """
    try:
        ids = None if isinstance(keys, (str, bytes)) else list(keys)
    except TypeError:
        ids = None
    if ids is None or not all(isinstance(k, str) for k in ids):
        raise InvalidInput(f"keys must be a list of entry ids (str), not {type(keys).__name__}")
    return ids


def is_entry_id(key: Any, whole: bool = False) -> bool:
    """Whether ``key`` is an entry id (16 hex digits, any case), or with
    ``whole`` False also a prefix of one."""
    if not isinstance(key, str) or not key or len(key) > ENTRY_ID or (whole and len(key) != ENTRY_ID):
        return False
    return all(c in _HEX for c in key.lower())


class Catalog:
    """Finds entries by id and describes them, within a caller's transaction."""

    def __init__(self, path: Path, tables: Tables, usage: Usage):
        self.path = path
        self._db = tables
        self._usage = usage

    def resolve(self, txn, key: str) -> bytes:
        """The entry key of the entry with id (or unique id prefix) ``key``.

        Raises:
            EntryNotFound: not an id, no such entry, or the prefix is ambiguous.
        """
        if not is_entry_id(key):
            raise EntryNotFound(f"{key!r} is not an entry id (16 hex digits, or a unique prefix)")
        prefix = key.lower().encode()
        cur = txn.cursor(db=self._db.ids)
        found: List[bytes] = []
        if cur.set_range(prefix):
            for k, v in cur:
                if not bytes(k).startswith(prefix) or len(found) > 1:
                    break
                found.append(bytes(v))
        if not found:
            raise EntryNotFound(f"{self.path}: no entry {key!r}; `promptstore ls` lists the ids")
        if len(found) > 1:
            raise EntryNotFound(f"{self.path}: {key!r} is ambiguous; give more digits of the id")
        return found[0]

    def vanished(self, key: str) -> EntryNotFound:
        return EntryNotFound(f"{self.path}: entry {key!r} has vanished")

    def info(self, txn, ekey: bytes, man: _entry.Manifest) -> EntryInfo:
        used = f64_or(txn.get(ekey, db=self._db.used), man.created)
        return EntryInfo(
            id=man.entry_id,
            model=man.model,
            model_name=man.model_name,
            n_tokens=len(man.tokens),
            kinds=man.kinds,
            nbytes=man.payload + man.shared_bytes,
            created=utc(man.created),
            last_used=utc(self._usage.last_used(ekey, used)),
            trimmable=man.trimmable,
            meta=man.meta,
            shared=man.shared_bytes,
        )

    def alone(self, txn, man: _entry.Manifest) -> int:
        """Array bytes of ``man`` no other entry holds: its own payload plus
        the blocks only it references (what deleting it alone frees)."""
        total = man.payload
        mine: Dict[bytes, int] = {}
        sizes: Dict[bytes, int] = {}
        for key, size in man.blocks():
            mine[key] = mine.get(key, 0) + 1
            sizes[key] = size
        for key, n in mine.items():
            if _budget.ref_count(txn.get(key, db=self._db.refs)) <= n:
                total += sizes[key]
        return total

    def own_bytes(self, txn, keys: Iterable[str], manifest: Callable[[bytes], Optional[_entry.Manifest]]) -> Dict[str, int]:
        """:meth:`alone` of each entry id in ``keys`` (ids not stored, or
        unreadable, left out); ``manifest(entry key)`` reads a manifest.

        Raises:
            InvalidInput: ``keys`` is not a list of ids.
        """
        out: Dict[str, int] = {}
        for key in id_list(keys):
            try:
                man = manifest(self.resolve(txn, key))
            except PromptStoreError:
                continue
            if man is not None:
                out[key] = self.alone(txn, man)
        return out

    def listing(self, txn, model: Optional[str]) -> List[EntryInfo]:
        """EntryInfo of every readable entry (of ``model`` when given);
        damaged manifests are skipped with a warning."""
        mid = _keys.model_id(model) if model is not None else None
        cur = txn.cursor(db=self._db.entries)
        found = []
        it: Iterator[Any]
        if mid is None:
            it = iter(cur) if cur.first() else iter(())
        else:
            it = iter(cur) if cur.set_range(mid) else iter(())
        for k, raw in it:
            k = bytes(k)
            if mid is not None and model_of(k) != mid:
                break
            try:
                man = _entry.unpack_manifest(bytes(raw), f"{self.path} entry {_keys.entry_id(k)}")
            except PromptStoreError as err:
                log.warning("promptstore: %s (run `promptstore verify`)", err)
                continue
            found.append(self.info(txn, k, man))
        return found
