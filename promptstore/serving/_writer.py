"""The background writer of PersistentPromptCache: puts happen off the serving thread.

The serving thread hands over a *view* (fresh layer objects over evaluated,
immutable arrays) and returns at once; one writer thread encodes and commits
it. Nothing is copied before the writer runs: the only copy is the one into
LMDB. Pending bytes are bounded: past the bound a new write is dropped (and
counted) rather than making the serving thread wait for the disk. Whatever
must follow a commit (pruning the checkpoint history, ``_history``) runs on
this thread too, through ``on_written``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from promptstore.errors import PromptStoreError
from promptstore.serving._memory import usable
from promptstore.store import EntryInfo

__all__ = ["Writer", "Job"]

log = logging.getLogger("promptstore")


@dataclass
class Job:
    """One pending put."""

    model: str
    tokens: np.ndarray
    cache: List[Any]
    nbytes: int
    meta: Dict[str, Any]
    replace: bool = False  # rewrite a stored entry (an older representation) instead of skipping it
    trimmable: bool = False  # every layer can drop its last tokens (a longer cache serves its prefixes)
    floor: int = 0  # the fewest tokens it can be trimmed to


class Writer:
    """One daemon thread that runs ``store.put`` for submitted jobs, in order.

    Args:
        store: a PromptStore (thread-safe).
        max_pending_bytes: the most array bytes that may wait for the disk;
            a job that would exceed it is dropped (one job is always accepted
            when nothing is pending).
        on_error: called with a job that was dropped or failed to write.
        on_written: called on the writer thread with a job and the EntryInfo
            of its committed put, before the job counts as done (``flush``
            waits for it); what it raises is logged.
    """

    def __init__(
        self,
        store,
        max_pending_bytes: int = 4 << 30,
        on_error: Optional[Callable[[Job], None]] = None,
        on_written: Optional[Callable[[Job, EntryInfo], None]] = None,
    ):
        self.store = store
        self._on_error = on_error
        self._on_written = on_written
        self.max_pending_bytes = max_pending_bytes
        self._jobs: Deque[Job] = deque()
        self._cv = threading.Condition()
        self._pending_bytes = 0
        self._busy: Optional[Job] = None  # the job being written
        self._closed = False
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self.skipped = 0
        self.write_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="promptstore-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._cv:
            return len(self._jobs) + (1 if self._busy is not None else 0)

    def submit(self, job: Job) -> bool:
        """Queue ``job``; never blocks on the disk. False when it was dropped."""
        with self._cv:
            refuse = self._closed or (self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes)
            if not refuse:
                self._jobs.append(job)
                self._pending_bytes += job.nbytes
                self._cv.notify_all()
                return True
            self.dropped += 1
            pending = self._pending_bytes
        if not self._closed:
            log.warning(
                "promptstore: %d bytes already wait for the disk; not persisting a %d-token cache "
                "(raise max_pending_bytes or use a faster disk)", pending, len(job.tokens))
        self._failed(job)
        return False

    def best(self, model: str, query: np.ndarray) -> Optional[Tuple[Job, int]]:
        """The pending job (queued, or being written) of ``model`` that serves
        the longest prefix of ``query``, as ``MemoryTier.best`` ranks them:
        ``(job, matched)``, or None. A cache the memory tier evicted while
        its write waits is still served from here."""
        found: Optional[Tuple[Job, int]] = None
        rank = (0, 0)
        with self._cv:
            jobs = list(self._jobs) + ([self._busy] if self._busy is not None else [])
        for job in jobs:
            if job.model != model:
                continue
            r = usable(job.tokens, job.trimmable, query, job.floor)
            if r is not None and r > rank:
                found, rank = (job, r[0]), r
        return found

    def _failed(self, job: Job) -> None:
        if self._on_error is not None:
            try:
                self._on_error(job)
            except Exception:
                log.exception("promptstore: writer error callback failed")

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            import mlx.core as mx

            # mlx streams are per thread; one left alive aborts the process at exit.
            if hasattr(mx, "clear_streams"):
                mx.clear_streams()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = job
            try:
                self._write(job)
            finally:
                with self._cv:
                    self._busy = None
                    self._pending_bytes -= job.nbytes
                    self._cv.notify_all()

    def _write(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            if not job.replace and self.store.exists(job.model, job.tokens):  # e.g. re-inserted after a restart
                self.skipped += 1
                return
            # The serving loop hands over a cache with the tokens it absorbed:
            # the coverage is known even when no layer can tell it.
            info = self.store.put(job.model, job.tokens, job.cache, meta=job.meta, coverage=len(job.tokens))
            self.written += 1
        except PromptStoreError as err:
            self.failed += 1
            log.warning("promptstore: could not persist a %d-token prompt cache: %s", len(job.tokens), err)
            self._failed(job)
            return
        except Exception:  # a cache must never take the server down
            self.failed += 1
            log.exception("promptstore: unexpected error persisting a %d-token prompt cache", len(job.tokens))
            self._failed(job)
            return
        finally:
            self.write_seconds += time.perf_counter() - start
        if self._on_written is not None:
            try:
                self._on_written(job, info)
            except Exception:  # never into the server
                log.exception("promptstore: writer after-commit callback failed")

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted job is written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._jobs or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Write what is pending, then stop the thread, within ``timeout``
        seconds in all. False when it timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return done and not self._thread.is_alive()
