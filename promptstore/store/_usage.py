"""Usage: last-use times and hit counters, kept off the read path.

A read records its entry's last use and the hit or miss in memory; the next
write transaction of this process (a put, gc, close) writes them, and so
does a background flush within :data:`FLUSH_EVERY` seconds of a read
(:meth:`Usage.flush_soon`), so reads never wait for the writer lock and a
process that only reads still counts for eviction order everywhere. A store
opened read-only keeps them to itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Dict, Iterable, Optional

from promptstore.errors import PromptStoreError, StoreClosed
from promptstore.store import _budget
from promptstore.store._env import Env
from promptstore.store._schema import F64, U64, Tables, stat_key, u64_or

log = logging.getLogger("promptstore")

COUNTERS = ("hits", "misses")
FLUSH_EVERY = 2.0  # seconds: the longest a read's last use stays unwritten while its process runs


class Usage:
    """Recorded, not yet written, last uses and counters of one PromptStore."""

    def __init__(self, tables: Tables, after_commit: Callable[[Callable[[], None], Callable[[], None]], None]):
        self._db = tables
        self._after_commit = after_commit  # the store's ``Env.after_commit``
        self._lock = threading.Lock()
        self._touched: Dict[bytes, float] = {}
        self._counts: Counter = Counter()
        self._flushed = time.monotonic()
        self._flusher: Optional[threading.Thread] = None
        self._flusher_lock = threading.Lock()

    def wait(self) -> float:
        """Seconds until a flush is due (:data:`FLUSH_EVERY` after the last one)."""
        return max(0.0, FLUSH_EVERY - (time.monotonic() - self._flushed))

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
        """Write what was recorded, inside write transaction ``txn``. Last uses
        stay recorded until ``txn`` commits, and counts taken by a transaction
        that does not commit are counted again: a transaction retried (map
        growth) writes them again, one aborted (a put refused) leaves them to the next."""
        with self._lock:
            touched, counts, self._counts = dict(self._touched), self._counts, Counter()
            self._flushed = time.monotonic()
        self._after_commit(lambda: self._written(touched), lambda: self._unwritten(counts))
        db = self._db
        for ekey, ts in touched.items():
            if txn.get(ekey, db=db.entries) is not None:
                _budget.set_used(txn, db, ekey, F64.pack(ts))
        for what, n in counts.items():
            key = stat_key(what)
            txn.put(key, U64.pack(u64_or(txn.get(key, db=db.info)) + n), db=db.info)

    def _written(self, touched: Dict[bytes, float]) -> None:
        """Forget the last uses a committed flush wrote (one recorded again since stays)."""
        with self._lock:
            for ekey, ts in touched.items():
                if self._touched.get(ekey) == ts:
                    del self._touched[ekey]

    def _unwritten(self, counts: Counter) -> None:
        """Count again what a flush whose transaction did not commit took (taken
        at once, so that no other transaction writes them too)."""
        with self._lock:
            self._counts.update(counts)

    def flush_soon(self, env: Env, flush: Callable[[], None]) -> None:
        """Have what is recorded written within :data:`FLUSH_EVERY` seconds by
        ``flush`` on a background thread (one at a time), so other processes'
        eviction sees this one's reads within that delay even if it never
        writes; the read never waits for it. Closing ``env`` stops the wait
        (close flushes what was recorded)."""
        if not self.pending():
            return
        with self._flusher_lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._flusher = threading.Thread(target=self._flush_later, args=(env, flush), name="promptstore-usage", daemon=True)
            self._flusher.start()

    def _flush_later(self, env: Env, flush: Callable[[], None]) -> None:
        if env.wait_closing(self.wait()):
            return
        try_flush(flush, "failed (retried at the next write)")

    def counters(self, txn) -> Dict[str, int]:
        """Hits and misses as stored (by every process, after their flush)."""
        return {what: u64_or(txn.get(stat_key(what), db=self._db.info)) for what in COUNTERS}


def try_flush(flush: Callable[[], None], failed: str) -> None:
    """Run ``flush``; a failure (a full disk) is a warning that says ``failed``:
    last-use times are advisory, and what they record was done."""
    try:
        flush()
    except StoreClosed:
        pass
    except PromptStoreError as err:
        log.warning("promptstore: recording last uses %s: %s", failed, err)
