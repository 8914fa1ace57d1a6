"""Write-behind: entries are published by one daemon thread from a bounded queue.

``submit`` never waits on the network: past ``QUEUE`` pending entries it
drops the new one (counted as ``dropped``); a put never blocks on the remote.
``flush`` waits, at most its timeout, until what was submitted is published
(a CLI ``put`` flushes before it exits; ``close`` flushes).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

from promptstore.errors import PromptStoreError
from promptstore.remote._tier import Remote

QUEUE = 16  # entries waiting to be published, at most


class Publisher:
    """Runs publish jobs for one Remote in the background, in order."""

    def __init__(self, remote: Remote, size: int = QUEUE):
        self.remote = remote
        self._q: "queue.Queue[Optional[Callable[[], object]]]" = queue.Queue(maxsize=size)
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], object]) -> bool:
        """Queue ``job`` (one entry's publish); False when the queue is full,
        or the publisher closed (a put racing the store's close): dropped."""
        if self._closed:
            self.remote.count("dropped")
            return False
        self._ensure_thread()
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self.remote.count("dropped")
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="promptstore-publish", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if not self.remote.available():
                    self.remote.count("dropped")
                    continue
                try:
                    job()
                except PromptStoreError as err:  # RemoteUnavailable above all: counted, logged once
                    self.remote.failed("publish", err)
                except Exception as err:  # never let one entry stop the thread
                    self.remote.failed("publish", err)
            finally:
                self._q.task_done()

    def pending(self) -> int:
        """Entries queued and not yet taken up (the stop marker :meth:`close`
        queues is not one)."""
        with self._q.mutex:
            return sum(1 for job in self._q.queue if job is not None)

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted entry is published (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._q.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Flush (at most ``timeout`` seconds), then stop the thread; what is submitted later is dropped."""
        self._closed = True
        done = self.flush(timeout)
        if self._thread is not None and self._thread.is_alive():
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass  # the daemon thread dies with the process
        return done
