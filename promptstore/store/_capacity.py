"""PromptStore's capacity methods: budget, pins, gc, compact, salvage.

A mixin so that ``store.py`` keeps the read and write paths; the bookkeeping
itself lives in ``_budget`` and runs inside the store's write transactions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

from promptstore.store import _budget, _keys
from promptstore.format import _entry
from promptstore.store._budget import GcReport
from promptstore.errors import EntryNotFound, PromptStoreError, StoreFull

if TYPE_CHECKING:
    from promptstore.store._salvage import SalvageReport


class CapacityMixin:
    """Byte budget with LRU eviction, pinned entries, gc, compact and salvage."""

    # -- budget -----------------------------------------------------------------

    @property
    def budget(self) -> Optional[int]:
        """The store's byte budget (remembered in the store), or None."""
        with self.env.read() as txn:
            return _budget.get_budget(txn, self._db)

    def usage(self) -> int:
        """Bytes the entries account for (payloads plus manifests)."""
        with self.env.read() as txn:
            return _budget.usage(txn, self._db)

    def set_budget(self, budget: Optional[int]) -> GcReport:
        """Set (or with None, remove) the byte budget, remembered by the store,
        and evict least-recently-used unpinned entries down to it.

        From then on every ``put`` evicts in its own transaction, so the store
        never holds more than the budget plus the entry being written.

        Raises:
            InvalidInput: not a byte count.
            StoreFull: the pinned entries alone exceed the budget (nothing changes).
        """
        budget = _budget.check_budget(budget)

        def write(txn) -> GcReport:
            if budget is not None:
                pinned = _budget.pinned_bytes(txn, self._db)
                if pinned > budget:
                    raise StoreFull(
                        f"{self.path}: pinned entries take {pinned} bytes, more than the budget of {budget}; "
                        "unpin some (`PromptStore.unpin`) or choose a larger budget"
                    )
                txn.put(_budget.BUDGET, _budget._U64.pack(budget), db=self._db[b"info"])
            else:
                txn.delete(_budget.BUDGET, db=self._db[b"info"])
            return self._gc_in(txn, budget, False)

        return self.env.write(write)

    def gc(self, budget: Optional[int] = None, dry_run: bool = False) -> GcReport:
        """Evict least-recently-used unpinned entries down to the budget.

        Also recounts the size accounting, drops pins of deleted entries and
        removes blob files no entry names (left by a put killed before its
        commit, or by a crash before a deleted entry's file was unlinked).

        Args:
            budget: evict down to this many bytes instead of the stored budget
                (the stored budget is not changed; use :meth:`set_budget`).
            dry_run: report what would be evicted; change nothing.

        Returns:
            A GcReport; with no budget at all nothing is evicted.
        """
        budget = _budget.check_budget(budget)

        def write(txn) -> GcReport:
            self._flush_in(txn)
            _budget.recount(txn, self._db, self._manifest_size)
            target = budget if budget is not None else _budget.get_budget(txn, self._db)
            report = self._gc_in(txn, target, dry_run)
            self._drop_stray_blobs(txn)
            return report

        if dry_run:
            with self.env.read() as txn:
                target = budget if budget is not None else _budget.get_budget(txn, self._db)
                return self._gc_in(txn, target, True)
        return self.env.write(write)

    def _gc_in(self, txn, budget: Optional[int], dry_run: bool) -> GcReport:
        if budget is None:
            return GcReport((), 0, _budget.usage(txn, self._db), None, dry_run)
        victims, after = _budget.plan(txn, self._db, budget, set())
        if not dry_run:
            entries = self._db[b"entries"]
            for k, _ in victims:
                self._unlink(txn, k, txn.get(k, db=entries))
            with self._lock:
                for k, _ in victims:
                    self._touched.pop(k, None)
        return GcReport(
            tuple(_keys.entry_id(k) for k, _ in victims),
            sum(s for _, s in victims),
            after,
            budget,
            dry_run,
        )

    def _manifest_size(self, ekey: bytes, raw: bytes) -> Optional[int]:
        try:
            return _entry.unpack_manifest(raw, _keys.entry_id(ekey)).payload + len(raw)
        except PromptStoreError:
            return None

    # -- pins -------------------------------------------------------------------

    def pin(self, key: str) -> None:
        """Pin the entry with id (or unique prefix) ``key``: never evicted.

        Raises:
            EntryNotFound: no such entry.
            StoreFull: pinned entries would exceed the budget.
        """

        def write(txn) -> None:
            ekey = self._resolve(txn, key)
            if txn.get(ekey, db=self._db[b"entries"]) is None:
                raise EntryNotFound(f"{self.path}: entry {key!r} has vanished")
            budget = _budget.get_budget(txn, self._db)
            if budget is not None:
                total = _budget.pinned_bytes(txn, self._db, but=ekey) + _budget.size_of(txn, self._db, ekey)
                if total > budget:
                    raise StoreFull(
                        f"{self.path}: pinning {key} would make pinned entries take {total} bytes, more than "
                        f"the budget of {budget}; unpin others or raise the budget"
                    )
            txn.put(ekey, b"", db=self._db[b"pins"])

        self.env.write(write)

    def unpin(self, key: str) -> bool:
        """Unpin an entry; True when it was pinned."""
        return self.env.write(lambda txn: txn.delete(self._resolve(txn, key), db=self._db[b"pins"]))

    def pinned(self) -> List[str]:
        """Ids of the pinned entries."""
        with self.env.read() as txn:
            return sorted(
                _keys.entry_id(bytes(k))
                for k in txn.cursor(db=self._db[b"pins"]).iternext(keys=True, values=False)
                if txn.get(bytes(k), db=self._db[b"entries"]) is not None
            )

    # -- file space --------------------------------------------------------------

    def compact(self) -> Tuple[int, int]:
        """Rewrite the data file without its free pages: ``(bytes before, after)``.

        Safe while other processes use the store: they move to the compacted
        file at their next transaction (see ``promptstore.store._env``). Needs free
        disk space for the compacted copy.

        Raises:
            StoreFull: no room for the copy (the store is unchanged).
        """
        self.flush()
        return self.env.compact()

    def salvage(self, dst: Union[str, os.PathLike]) -> "SalvageReport":
        """Copy every intact entry of this store into a fresh store at ``dst``.

        See :func:`promptstore.salvage`.
        """
        from promptstore.store._salvage import salvage

        return salvage(self.path, Path(dst))
