"""Operations in flight on a store, and closing it under them.

py-lmdb releases the GIL inside some calls (value preloading, commit) and
large restores ``pread`` the data file on worker threads, so closing the
environment or that descriptor under a transaction may crash the process or
read another file. Every ``Env.read``, ``Env.write`` and ``Env.compact`` is
counted, per thread, while in flight (:meth:`Gate.enter` / :meth:`Gate.leave`);
:meth:`Gate.close` refuses new ones, waits (bounded) for those, and only then
closes the files. An operation nested in one already in flight on the same
thread still runs, so an operation never fails half-way inside a transaction.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Dict, Optional

from promptstore.errors import StoreClosed, StoreUnavailable

CLOSE_TIMEOUT = 60.0  # seconds close() waits for operations in flight in other threads
_OPEN, _CLOSING, _CLOSED = "open", "closing", "closed"


def closed_error(path: Path) -> StoreClosed:
    """The error of an operation started on a closed store."""
    return StoreClosed(f"{path}: the store is closed; open a new PromptStore")


class Gate:
    """Counts each thread's operations in flight on one store and closes
    the store's files (``close_files``, called under ``lock``) once none is
    left. ``lock`` is the environment's own condition."""

    def __init__(self, path: Path, lock: threading.Condition, close_files: Callable[[], None]):
        self.path = path
        self._lock = lock
        self._close_files = close_files
        self._state = _OPEN
        self._ops: Dict[object, int] = {}  # thread token -> operations it has in flight
        self._tokens = threading.local()  # a token per thread: thread ids are reused, tokens are not
        self._closer: Optional[object] = None  # the token of the thread running close()'s last transactions
        self._waiting = 0  # close() calls waiting for operations in flight

    @property
    def closed(self) -> bool:
        """True once the files are closed (not merely closing)."""
        return self._state == _CLOSED

    def check(self) -> None:
        """Raise the closed error once close() has begun."""
        if self._state != _OPEN:
            raise closed_error(self.path)

    def wait_closing(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for close() to begin; whether it has."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._state == _OPEN:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _token(self) -> object:
        token = getattr(self._tokens, "token", None)
        if token is None:
            token = self._tokens.token = object()
        return token

    def enter(self) -> object:
        """Count an operation of this thread as in flight and return the thread's
        token. Once close() has begun only an operation nested in one this
        thread has in flight, or close()'s own flush, may start."""
        me = self._token()
        with self._lock:
            if self._state != _OPEN and not self._ops.get(me) and me != self._closer:
                raise closed_error(self.path)
            self._ops[me] = self._ops.get(me, 0) + 1
        return me

    def leave(self, me: object) -> None:
        """End an operation of thread ``me`` (maybe ended by another thread:
        a generator holding a transaction may be collected anywhere)."""
        with self._lock:
            if self._ops[me] > 1:
                self._ops[me] -= 1
            else:
                del self._ops[me]
            if self._state == _CLOSING and not self._ops and self._closer is None and not self._waiting:
                self._finish()  # close() stopped waiting: the last operation closes the files
            self._lock.notify_all()

    def _finish(self) -> None:
        """Close the files (under the lock, nothing in flight)."""
        if self._state != _CLOSED:
            try:
                self._close_files()
            finally:  # after the files: ``closed`` says they are closed (another thread may then open the folder)
                self._state = _CLOSED

    def close(self, timeout: float = CLOSE_TIMEOUT, last: Optional[Callable[[], None]] = None) -> None:
        """Close the store, safely while other threads use it.

        From the call on, a new operation raises the closed error. Operations
        in flight finish normally; once none is left, ``last`` runs (its own
        operations allowed: the final flush) and the files are closed. Calling
        it again, or from several threads, is harmless: every call returns
        once the files are closed.

        Raises:
            StoreUnavailable: this thread has an operation in flight (close()
                from inside a transaction, a callback, or a half-consumed
                iterator holding ``Env.read``), or others still have after
                ``timeout`` seconds. The store stays closed to new operations
                and its files are closed when the last of those ends; ``last``
                does not run.
        """
        me = self._token()
        with self._lock:
            if self._state == _CLOSED:
                return
            self._state = _CLOSING
            self._lock.notify_all()  # wakes wait_closing()
            if self._ops.get(me):
                raise StoreUnavailable(
                    f"{self.path}: close() was called while this thread has a transaction of the store open "
                    "(inside an operation or a callback of it, or a half-consumed iterator holding "
                    "`env.read()`); the store refuses new operations and closes when that transaction ends"
                )
            deadline = time.monotonic() + max(timeout, 0.0)
            self._waiting += 1
            try:
                while self._state != _CLOSED and (self._ops or self._closer is not None):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        what = (
                            f"{sum(self._ops.values())} operation(s) in flight in {len(self._ops)} other thread(s) "
                            "(a transaction held open, e.g. by a half-consumed iterator over `env.read()`)"
                            if self._ops
                            else "another close() to flush"
                        )
                        raise StoreUnavailable(
                            f"{self.path}: close() waited {timeout:g} s for {what}; the store refuses new "
                            "operations and closes its files when they end"
                        )
                    self._lock.wait(left)
            finally:
                self._waiting -= 1
            if self._state == _CLOSED:
                return
            self._closer = me
        try:
            if last is not None:
                last()
        finally:
            with self._lock:
                self._closer = None
                self._finish()
                self._lock.notify_all()
