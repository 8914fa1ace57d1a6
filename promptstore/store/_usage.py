"""Usage: last-use times and hit counters, kept off the read path.

A read records its entry's last use and the hit or miss in memory; the next
write transaction of this process (a put, gc, close) writes them, so reads
never wait for the writer lock. A store opened read-only keeps them to itself.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Dict, Iterable

from promptstore.store._schema import F64, U64, Tables, stat_key, u64_or

COUNTERS = ("hits", "misses")


class Usage:
    """Recorded, not yet written, last uses and counters of one PromptStore."""

    def __init__(self, tables: Tables):
        self._db = tables
        self._lock = threading.Lock()
        self._touched: Dict[bytes, float] = {}
        self._counts: Counter = Counter()

    def touch(self, ekey: bytes) -> None:
        with self._lock:
            self._touched[ekey] = time.time()

    def count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def forget(self, ekeys: Iterable[bytes]) -> None:
        """Drop what was recorded for entries that are being deleted."""
        with self._lock:
            for ekey in ekeys:
                self._touched.pop(ekey, None)

    def pending(self) -> bool:
        return bool(self._touched or self._counts)

    def last_used(self, ekey: bytes, stored: float) -> float:
        """The later of the stored last use and one recorded here."""
        return max(stored, self._touched.get(ekey, 0.0))

    def flush_in(self, txn) -> None:
        """Write what was recorded, inside write transaction ``txn``."""
        with self._lock:
            touched, self._touched = self._touched, {}
            counts, self._counts = self._counts, Counter()
        db = self._db
        for ekey, ts in touched.items():
            if txn.get(ekey, db=db.entries) is not None:
                txn.put(ekey, F64.pack(ts), db=db.used)
        for what, n in counts.items():
            key = stat_key(what)
            txn.put(key, U64.pack(u64_or(txn.get(key, db=db.info)) + n), db=db.info)

    def counters(self, txn) -> Dict[str, int]:
        """Hits and misses as stored (by every process, after their flush)."""
        return {what: u64_or(txn.get(stat_key(what), db=self._db.info)) for what in COUNTERS}
