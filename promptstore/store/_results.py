"""What the store's API returns: frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Tuple


def utc(ts: float) -> datetime:
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
    shared: int = 0  # of nbytes, the bytes in blocks stored once for every entry that has them
    # put's return only: the bytes that put added to the store's usage (the
    # entry's own arrays and manifest, and the blocks the store did not hold
    # yet: what the budget counts); None elsewhere.
    added: Optional[int] = field(default=None, compare=False)

    @property
    def own(self) -> int:
        """Bytes of this entry's arrays that no other entry can share."""
        return self.nbytes - self.shared


@dataclass(frozen=True)
class Hit:
    """A lookup result: a ready cache covering ``matched`` tokens of the query.

    ``trimmed`` is how many tokens were cut from a longer stored entry;
    ``bytes_read`` how many array bytes the restore read (a prefix of a
    longer entry reads only the shared blocks it needs).
    """

    cache: List[Any]
    matched: int
    info: EntryInfo
    trimmed: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :meth:`PromptStore.verify`."""

    checked: int
    problems: Tuple[Tuple[str, str], ...]  # (entry id, what is wrong)
    orphan_chunks: int
    fixed: bool
    orphan_blobs: int = 0  # blob files no entry names: leftovers of killed puts, not damage
    bad_counts: int = 0  # shared blocks whose reference count is not the number of references
    orphan_blocks: int = 0  # shared blocks no entry references
    newer: Tuple[Tuple[str, str], ...] = ()  # (entry id, why): intact, written by a newer promptstore; kept
    orphan_packs: int = 0  # pack files the store does not record: leftovers of killed puts, not damage
    bad_accounting: int = 0  # entries' size records, and the usage counter, that differ from what is stored
    bad_records: int = 0  # index records (pack records, entry ids) that differ from the tables they index
    removed: Tuple[str, ...] = ()  # with fix: the ids of the damaged entries deleted (of ``problems``; the others were kept)

    @property
    def ok(self) -> bool:
        return not (self.problems or self.orphan_chunks or self.bad_counts or self.orphan_blocks or self.bad_accounting or self.bad_records)


@dataclass(frozen=True)
class GcReport:
    """Outcome of :meth:`PromptStore.gc`: what was (or, dry, would be) evicted.

    A dry run's report is a plan: pass it back as ``gc(plan=report)`` to
    evict exactly those entries and no others.
    """

    evicted: Tuple[str, ...]  # entry ids, least recently used first
    freed: int  # bytes of the evicted entries
    usage: int  # bytes accounted after eviction
    budget: Optional[int]
    dry_run: bool
    # A dry run's: each evicted entry's created time (seconds since the epoch,
    # -1.0 where its manifest is unreadable), so that gc(plan=...) leaves an
    # entry put again under the same id since the plan.
    created: Tuple[float, ...] = ()


@dataclass(frozen=True)
class SalvageReport:
    """Outcome of :func:`salvage`."""

    src: str
    dst: str
    copied: Tuple[str, ...]  # entry ids copied intact
    skipped: Tuple[Tuple[str, str], ...]  # (entry id, why) left behind
    unreadable_tables: Tuple[str, ...]  # tables whose walk failed part way
    scanned: Tuple[str, ...] = ()  # of ``copied``, the entries found by scanning the data file's bytes (its tree lost)
