"""Capacity: the byte budget with LRU eviction, pinned entries, and gc.

The bookkeeping itself (sizes, usage, the eviction order) lives in ``_budget``
and runs inside the store's write transactions, so a put and the evictions it
causes commit together.

gc is scan, plan, execute: a dry run's :class:`GcReport` is a plan, and
``gc(plan=report)`` (or ``set_budget(budget, plan=report)``) evicts exactly
the planned entries that are still there, and no others.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

from promptstore.errors import EntryNotFound, InvalidInput, PromptStoreError, StoreFull
from promptstore.format import _entry
from promptstore.store import _budget, _keys
from promptstore.store._catalog import Catalog, is_entry_id
from promptstore.store._env import Env
from promptstore.store._results import EntryInfo, GcReport, utc
from promptstore.store._schema import Tables
from promptstore.store._usage import Usage, try_flush
from promptstore.store._verify import Maintenance
from promptstore.store._write import EntryWriter


class Capacity:
    """Byte budget, pins and eviction of one store."""

    def __init__(self, path: Path, env: Env, tables: Tables, usage: Usage, catalog: Catalog, writer: EntryWriter, maintenance: Maintenance):
        self.path = path
        self._env = env
        self._db = tables
        self._usage = usage
        self._catalog = catalog
        self._writer = writer
        self._maintenance = maintenance

    # -- budget -----------------------------------------------------------------

    def budget(self) -> Optional[int]:
        with self._env.read() as txn:
            return _budget.get_budget(txn, self._db)

    def usage(self) -> int:
        with self._env.read() as txn:
            return _budget.usage(txn, self._db)

    def set_budget(self, budget: Optional[int], plan: Optional[GcReport] = None) -> GcReport:
        """See :meth:`PromptStore.set_budget`."""
        budget = _budget.check_budget(budget)
        _check_plan(plan)

        def write(txn) -> GcReport:
            if budget is not None:
                pinned = _budget.pinned_bytes(txn, self._db)
                if pinned > budget:
                    raise StoreFull(
                        f"{self.path}: pinned entries take {pinned} bytes, more than the budget of {budget}; "
                        "unpin some (`PromptStore.unpin`) or choose a larger budget"
                    )
            self._usage.flush_in(txn)  # this process's recent uses count in the eviction order
            _budget.set_budget(txn, self._db, budget)
            return self._evict(txn, budget, plan)

        return self._env.write(write)

    def gc(self, budget: Optional[int] = None, dry_run: bool = False, plan: Optional[GcReport] = None) -> GcReport:
        """See :meth:`PromptStore.gc`."""
        budget = _budget.check_budget(budget)
        _check_plan(plan)
        if dry_run:
            if self._usage.pending() and not self._env.readonly:  # this process's recent uses count in the plan, as in gc's own
                try_flush(lambda: self._env.write(self._usage.flush_in), "before a gc plan failed (the plan may not see them)")
            with self._env.read() as txn:
                target = budget if budget is not None else _budget.get_budget(txn, self._db)
                return self._plan(txn, target)

        def write(txn, fresh: List[int]) -> GcReport:
            self._usage.flush_in(txn)
            _budget.recount(txn, self._db)
            target = budget if budget is not None else _budget.get_budget(txn, self._db)
            report = self._evict(txn, target, plan)
            self._writer.repack(txn, fresh)
            self._maintenance.sweep_blobs(txn)
            return report

        return self._writer.write_packs(write)

    def frees(self, ids: Sequence[str]) -> int:
        """See :meth:`PromptStore.frees`: measured as eviction measures it (``freed_by``)."""
        with self._env.read() as txn:
            release = self._writer.freed_by(txn)
            total, seen = 0, set()
            for eid in ids:
                try:
                    ekey = self._catalog.resolve(txn, eid)
                except EntryNotFound:
                    continue
                if ekey not in seen:
                    seen.add(ekey)
                    total += release(ekey)
            return total

    def _plan(self, txn, budget: Optional[int]) -> GcReport:
        if budget is None:
            return GcReport((), 0, _budget.usage(txn, self._db), None, True)
        victims, after = _budget.plan(txn, self._db, budget, set(), self._writer.freed_by(txn))
        return GcReport(tuple(_keys.entry_id(k) for k, _ in victims), sum(s for _, s in victims), after, budget, True,
                        tuple(self._created(txn, k) for k, _ in victims))

    def _created(self, txn, ekey: bytes) -> float:
        """The created time of the entry at ``ekey``; -1.0 when missing or unreadable."""
        raw = txn.get(ekey, db=self._db.entries)
        try:
            return _entry.unpack_manifest(bytes(raw), f"{self.path} entry {_keys.entry_id(ekey)}").created if raw is not None else -1.0
        except PromptStoreError:
            return -1.0

    def _evict(self, txn, budget: Optional[int], plan: Optional[GcReport]) -> GcReport:
        """Evict down to ``budget`` by LRU order, or exactly the entries of
        ``plan`` that are still there (then ``budget`` decides nothing)."""
        if plan is not None:
            victims = self._planned(txn, plan)
        elif budget is None:
            return GcReport((), 0, _budget.usage(txn, self._db), None, False)
        else:
            victims, _ = _budget.plan(txn, self._db, budget, set(), self._writer.freed_by(txn))
        unknown = False
        for k, _ in victims:
            released = self._writer.unlink(txn, k, txn.get(k, db=self._db.entries))
            unknown = unknown or not released
        self._usage.forget(k for k, _ in victims)
        if unknown:
            # An entry whose manifest was damaged cannot release its blocks as
            # it goes: they are freed here when no other manifest names them
            # (none while one cannot be read), and the usage recounted.
            self._writer.recount(txn)
        return GcReport(
            tuple(_keys.entry_id(k) for k, _ in victims),
            sum(s for _, s in victims),
            _budget.usage(txn, self._db),
            budget,
            False,
        )

    def _planned(self, txn, plan: GcReport) -> List[Tuple[bytes, int]]:
        """The entries of ``plan`` still there and unpinned, each with what
        evicting it frees: measured as the dry run and the budget's own
        eviction measure it (``freed_by``), so a shared block counts with the
        last of its referrers the plan removes, and the report matches usage."""
        victims: List[Tuple[bytes, int]] = []
        seen: Set[bytes] = set()
        freed = self._writer.freed_by(txn)
        created = plan.created if len(plan.created) == len(plan.evicted) else ()  # one per entry, or by id alone
        for i, eid in enumerate(plan.evicted):
            try:
                ekey = self._catalog.resolve(txn, eid)
            except EntryNotFound:
                continue  # deleted since the plan
            if ekey in seen or _budget.is_pinned(txn, self._db, ekey):
                continue  # pinned since the plan: never evicted
            if created and created[i] >= 0 and self._created(txn, ekey) != created[i]:
                continue  # put again since the plan: not the entry planned
            seen.add(ekey)
            victims.append((ekey, freed(ekey)))
        return victims

    def remove_planned(self, plan: Sequence[EntryInfo]) -> Tuple[List[EntryInfo], List[str]]:
        """See :meth:`PromptStore.remove_planned`."""
        try:
            planned_entries = list(plan)
        except TypeError:
            planned_entries = None
        if isinstance(plan, (str, bytes)) or planned_entries is None or not all(isinstance(e, EntryInfo) for e in planned_entries):
            raise InvalidInput(f"plan must be EntryInfo objects (from entries() or info()), not {plan!r:.80}")

        def write(txn) -> Tuple[List[EntryInfo], List[str], List[bytes]]:
            removed, vanished, keys = [], [], []
            for planned in planned_entries:
                try:
                    ekey = self._catalog.resolve(txn, planned.id)
                except EntryNotFound:
                    vanished.append(planned.id)
                    continue
                man = self._writer.readable(txn, ekey)  # None: unreadable since the plan
                if man is None or utc(man.created) != planned.created:
                    vanished.append(planned.id)
                    continue
                removed.append(self._catalog.info(txn, ekey, man))
                self._writer.drop(txn, ekey)
                keys.append(ekey)
            return removed, vanished, keys

        removed, vanished, keys = self._env.write(write)
        self._usage.forget(keys)
        return removed, vanished

    # -- pins -------------------------------------------------------------------

    def pin(self, key: str) -> None:
        """See :meth:`PromptStore.pin`."""

        def write(txn) -> None:
            ekey = self._catalog.resolve(txn, key)
            if txn.get(ekey, db=self._db.entries) is None:
                raise self._catalog.vanished(key)
            budget = _budget.get_budget(txn, self._db)
            if budget is not None:
                total = _budget.pinned_bytes(txn, self._db, also=ekey)
                if total > budget:
                    raise StoreFull(
                        f"{self.path}: pinning {key} would make pinned entries take {total} bytes, more than "
                        f"the budget of {budget}; unpin others or raise the budget"
                    )
            txn.put(ekey, b"", db=self._db.pins)

        self._env.write(write)

    def unpin(self, key: str) -> bool:
        return self._env.write(lambda txn: bool(txn.delete(self._catalog.resolve(txn, key), db=self._db.pins)))

    def pinned(self) -> List[str]:
        with self._env.read() as txn:
            return sorted(
                _keys.entry_id(bytes(k))
                for k in txn.cursor(db=self._db.pins).iternext(keys=True, values=False)
                if txn.get(bytes(k), db=self._db.entries) is not None
            )


def _check_plan(plan: Optional[GcReport]) -> None:
    """Refuse a ``plan`` that is not a dry run's GcReport (None is no plan).

    Raises:
        InvalidInput: anything else.
    """
    if plan is None:
        return
    if not isinstance(plan, GcReport):
        raise InvalidInput(f"plan must be the GcReport of gc(dry_run=True), not {type(plan).__name__}")
    ids, created = plan.evicted, plan.created
    # Whole ids only: a prefix could name an entry put after the plan was made.
    if not isinstance(ids, (tuple, list)) or not all(is_entry_id(e, whole=True) for e in ids):
        raise InvalidInput(f"plan.evicted must be a dry run's entry ids (16 hex digits each), not {ids!r:.80}")
    if not isinstance(created, (tuple, list)) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) for c in created
    ):
        raise InvalidInput(f"plan.created must be a dry run's created times (numbers), not {created!r:.80}")
