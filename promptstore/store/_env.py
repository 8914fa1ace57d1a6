"""The LMDB environment: opening, transactions, map growth, and the generation switch that makes compaction safe across processes.

Facts this module encodes (each reproduced when it was written; tests cover them):
* ``map_size`` is only address space: it starts large; on ``MapFullError``
  the map doubles and the write is retried; other processes then see
  ``MapResizedError`` on their next transaction and adopt the new size with
  ``set_mapsize(0)``. py-lmdb invalidates every open transaction of an
  environment that is resized, so a thread resizes only once the other
  threads' transactions on it are done (``Env._set_mapsize``).
* ``reader_check()``, on open and in a writer every ``READER_CHECK_EVERY`` s, clears the reader
  slots of dead processes (killed mid-read), whose stale snapshots would block page reuse.
* An environment must never cross ``fork()``: every call checks the pid.
* LMDB's errors become the store's typed errors in :mod:`_faults`.

Generations (compaction). LMDB files never shrink and a data file cannot be
swapped under a lock file that other processes share. So the store directory
holds generation 0 (``data.mdb``, ``lock.mdb``) and, after compaction,
``gen-N/`` directories; the file ``CURRENT`` (replaced atomically) names the
live one. The compactor holds the live generation's write lock while it copies
and switches ``CURRENT``, so no commit can land in the old files after the
copy. Every write transaction re-reads ``CURRENT`` after it holds the write
lock and, when it changed, aborts and retries in the new generation; reads
notice the switch by a ``stat`` of ``CURRENT`` at their start (a read that
starts just before a switch sees a consistent, slightly older snapshot).
Old generations' files are unlinked; processes still mapping them keep them alive until they move on.

Closing while other threads work: :mod:`promptstore.store._gate`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, TypeVar

import lmdb

from promptstore.format import _pages
from promptstore.store._faults import open_tables, translate
from promptstore.store._gate import CLOSE_TIMEOUT, Gate
from promptstore.store._lmdbfile import CURRENT, copy_generation, live_dir, make_store_dir, remove_generations, switch_current
from promptstore.store._schema import (
    FORMAT_KEY, STORE_FORMAT, STORE_ID_FILE, STORE_ID_KEY, TABLES, U64, Tables, u64_or,
)
from promptstore.errors import CorruptEntry, StoreError, StoreFull, StoreUnavailable, UnsupportedVersion

log = logging.getLogger("promptstore")

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; grows on demand
MAX_MAP_SIZE = 1 << 46
# Store folders this process has open, each with the pid that opened it (a
# fork copies the dict: an entry of another pid is the parent's, open in it).
_OPENED: Dict[Path, int] = {}
_READ_SWITCH_WAIT = 10.0  # seconds a read waits for this process's others to leave a compacted generation
READER_CHECK_EVERY = 30.0  # seconds between a writer's checks for reader slots of dead processes


def _signature(path: Path):
    try:
        st = os.stat(path / CURRENT)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


class _Gen:
    """One open generation: its lmdb environment, tables and live transactions."""

    def __init__(self, env: lmdb.Environment, db: Dict[bytes, Any], name: str, where: Path):
        self.env, self.db, self.name, self.dir = env, db, name, where
        self.active = 0
        self.resizing = 0  # of the active, those waiting in Env._set_mapsize (no transaction open)
        self._data: Optional[_pages.DataFile] = None
        self._data_lock = threading.Lock()

    def data_file(self) -> _pages.DataFile:
        with self._data_lock:
            if self._data is None:
                self._data = _pages.DataFile(str(self.dir / "data.mdb"))
            return self._data

    def close(self) -> None:
        with self._data_lock:
            if self._data is not None:
                self._data.close()
        self.env.close()


class Env:
    """One open LMDB environment with the promptstore tables.

    ``env`` and ``db`` always belong to the live generation; ``db`` is one
    :class:`Tables` updated in place, so references to it stay valid across a switch.
    """

    def __init__(self, path: Path, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False):
        self.path = path
        self.pid = os.getpid()
        self.readonly = readonly
        self.map_size = map_size
        self.db = Tables()
        self._lock = threading.Condition()
        self._pending = threading.local()  # callbacks to run once this thread's write commits
        self._readers_checked = time.monotonic()  # reader_check() ran at open
        self._token = threading.local()  # a token per thread (ids are reused, tokens are not)
        self._held: Dict[object, int] = {}  # thread token -> its transactions open (counted in a generation's active)
        self._stuck: Optional[Path] = None  # a read gave up waiting to switch there: reads no longer wait
        self._gate = Gate(path, self._lock, self._close_files)  # operations in flight; close()
        if not readonly:
            make_store_dir(path)
        self._gen = self._open_live()
        self.env = self._gen.env
        self.db.replace(self._gen.db)
        _OPENED[_folder(path)] = self.pid

    def _close_files(self) -> None:
        self._gen.close()
        _OPENED.pop(_folder(self.path), None)

    # -- opening -------------------------------------------------------------

    def check_identity(self) -> None:
        """Refuse a data file that is not the store this folder held.

        A store records a random identity in its data file and in the file
        ``STORE_ID`` beside it. A data file emptied, cut to nothing or
        replaced by another store's would otherwise open as a valid store
        (LMDB makes a fresh one from an empty file) and hide the loss.
        A store without the file (new, or written by an older release)
        gets one.

        Raises:
            StoreUnavailable: the identities differ, or the data file has none
                while the folder says it held a store (the files are closed).
        """
        marker = self.path / STORE_ID_FILE
        try:
            want: Optional[str] = marker.read_bytes().decode("ascii").strip()
        except FileNotFoundError:
            want = None
        except (OSError, UnicodeDecodeError) as err:
            self.close()
            why = "it is not text: damaged" if isinstance(err, UnicodeDecodeError) else err
            raise StoreUnavailable(f"{marker}: cannot read the store's identity ({why}); if {self.path / 'data.mdb'} "
                                   f"is this folder's own store, remove {marker} and it is recorded again") from err
        with self.read() as txn:
            raw = txn.get(STORE_ID_KEY, db=self.db.info)
        have = bytes(raw).hex() if raw is not None else None
        if want is not None and have != want:
            self.close()
            what = "holds no store (it was emptied, cut or recreated)" if have is None else f"belongs to another store ({have})"
            raise StoreUnavailable(
                f"{self.path}: this folder held store {want}, but its data file {what}: nothing of it can be read "
                f"from there. `promptstore salvage {self.path} NEW_DIR` recovers what survives (pack and blob files); "
                f"remove {marker} to use the folder as a new store"
            )
        if want is None and not self.readonly:
            if have is None:
                def write(txn) -> str:
                    now = txn.get(STORE_ID_KEY, db=self.db.info)
                    if now is None:  # not given one by another process meanwhile
                        now = os.urandom(16)
                        txn.put(STORE_ID_KEY, now, db=self.db.info)
                    return bytes(now).hex()

                have = self.write(write)
            tmp = marker.with_name(f".{STORE_ID_FILE}.{os.getpid()}.tmp")
            try:
                tmp.write_text(have + "\n")
                os.replace(tmp, marker)
            except OSError as err:  # a folder this user cannot write: the store still works
                log.warning("promptstore: cannot record the store's identity in %s (%s)", marker, err)

    def check_format(self, upgrade: Optional[Callable[[lmdb.Transaction, int], None]] = None) -> None:
        """Refuse a store whose table layout is newer than this promptstore's
        (or whose format record is damaged); record it in a new store. An
        older store opened for writing is brought to this layout by
        ``upgrade(txn, its format)``, in one write transaction that also
        records the new format; opened read-only, it is read as it is.

        Raises:
            UnsupportedVersion, CorruptEntry: the files are closed first.
        """
        with self.read() as txn:
            raw = txn.get(FORMAT_KEY, db=self.db.info)
        if raw is None:
            if not self.readonly:
                self.write(lambda t: t.put(FORMAT_KEY, U64.pack(STORE_FORMAT), db=self.db.info))
            return
        fmt = u64_or(raw, -1)
        if fmt == STORE_FORMAT or (1 <= fmt < STORE_FORMAT and (self.readonly or upgrade is None)):
            return
        if 1 <= fmt < STORE_FORMAT and upgrade is not None:

            def write(txn) -> None:
                now = u64_or(txn.get(FORMAT_KEY, db=self.db.info), -1)
                if now < STORE_FORMAT:  # not upgraded by another process meanwhile
                    upgrade(txn, now)
                    txn.put(FORMAT_KEY, U64.pack(STORE_FORMAT), db=self.db.info)

            self.write(write)
            return
        self.close()
        if fmt > STORE_FORMAT:
            raise UnsupportedVersion(f"{self.path}: store format {fmt} is newer than this promptstore ({STORE_FORMAT}); upgrade")
        raise CorruptEntry(f"{self.path}: store format record is damaged")

    def _open_live(self) -> _Gen:
        for _ in range(20):
            sig = _signature(self.path)
            where, name = live_dir(self.path)
            try:
                gen = self._open_gen(where, name)
            except StoreError:
                if _signature(self.path) != sig:
                    continue  # a compaction switched generations while we opened: follow it
                raise
            if _signature(self.path) == sig:
                self._sig = sig
                return gen
            gen.env.close()
        raise StoreUnavailable(f"{self.path}: the store kept switching generations while opening; retry")

    def _lmdb_open(self, where: Path, name: str, lock: bool = True) -> lmdb.Environment:
        return lmdb.open(
            str(where),
            map_size=self.map_size,
            max_dbs=len(TABLES) + 1,
            max_readers=1024,
            readonly=self.readonly,
            create=not self.readonly and name == ".",
            subdir=True,
            max_spare_txns=4,
            lock=lock,
        )

    def _open_gen(self, where: Path, name: str) -> _Gen:
        if self.readonly and not (where / "data.mdb").is_file():
            # lmdb would report "No such file"; say what the folder is not.
            raise StoreUnavailable(f"{where}: not a promptstore store (no data.mdb); check the --store path")
        if self.readonly and (where / "data.mdb").stat().st_size == 0 and not (self.path / STORE_ID_FILE).exists():
            # lmdb: "Bad file descriptor"; a folder that held a store: check_identity says so
            raise StoreUnavailable(f"{where}: not a promptstore store (its data.mdb is empty); check the --store path")
        try:
            try:
                env = self._lmdb_open(where, name)
            except lmdb.Error as err:
                denied = getattr(err, "errno", None) in (errno.EACCES, errno.EPERM) or os.strerror(errno.EACCES) in str(err)
                if not (self.readonly and denied):  # py-lmdb reports errno only in the message
                    raise
                # A store this user may only read: its lock file cannot be opened for
                # writing. Read without LMDB's reader table; a concurrent writer may then
                # reuse pages under a read, which the checksums of every array detect.
                log.info("promptstore: %s: lock file not writable; reading without LMDB's reader lock", where)
                env = self._lmdb_open(where, name, lock=False)
        except lmdb.Error as err:
            if "already open in this process" in str(err):
                raise StoreUnavailable(_opened_here(self.path)) from err
            raise translate(err, where, "open") from err
        except OSError as err:
            raise StoreUnavailable(f"{where}: cannot open store ({err}); check the path and permissions") from err
        for tries in range(3):
            try:
                return _Gen(env, open_tables(env, where, self.readonly), name, where)
            except lmdb.MapResizedError:  # another process grew the map as we opened: adopt its size
                if tries == 2:
                    env.close()
                    raise StoreUnavailable(f"{where}: the map kept being resized by other processes while opening; retry")
                env.set_mapsize(0)
            except lmdb.Error as err:
                env.close()
                raise translate(err, where, "open") from err
            except StoreError:
                env.close()
                raise
        raise AssertionError("unreachable")

    @property
    def dir(self) -> Path:
        """The directory of the live generation's ``data.mdb``."""
        return self._gen.dir

    @property
    def generation(self) -> str:
        return self._gen.name

    @property
    def closed(self) -> bool:
        """True once the files are closed (not merely closing, see :meth:`close`)."""
        return self._gate.closed

    def wait_closing(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`close` to begin; whether it has."""
        return self._gate.wait_closing(timeout)

    def check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise StoreUnavailable(
                f"{self.path}: this PromptStore was opened in process {self.pid} and is used in "
                f"{os.getpid()}; LMDB environments cannot cross fork(): {_AFTER_FORK}"
            )

    # -- generation switch -----------------------------------------------------

    def _follow(self, force: bool = False, write: bool = False) -> Tuple[_Gen, object]:
        """The generation to start a transaction in, switching to the live one
        once no transaction of this process is open in the old one (they all
        use the one generation's table handles in :attr:`db`). New ones wait
        for that: a busy process whose reads overlapped stayed on the frozen
        old generation while the new one's commits unlinked pack and blob
        files both name, and its intact entries read as lost. A thread holding
        a transaction here stays (it would wait for itself); a read waits at
        most :data:`_READ_SWITCH_WAIT` s, then reads the older snapshot (and
        later reads do not wait until the switch); a write (``write`` or
        ``force``) waits a minute, then fails. Returns the generation and the
        thread's token, which :meth:`_release` takes (a transaction may end
        on another thread: a generator's)."""
        token = getattr(self._token, "t", None)
        if token is None:
            token = self._token.t = object()
        with self._lock:
            sig = _signature(self.path)
            if force or sig != self._sig:
                where, _ = live_dir(self.path)
                writing = force or write
                waits = writing or (not self._held.get(token) and self._stuck != where)
                if where == self._gen.dir:
                    self._sig = sig
                elif waits or not self._gen.active:
                    deadline = time.monotonic() + (60 if writing else _READ_SWITCH_WAIT)
                    while waits and self._gen.active and self._gen.dir != where:
                        if time.monotonic() > deadline:
                            if not writing:
                                self._stuck = where
                                break  # a read held open elsewhere: read in the older, consistent snapshot
                            raise StoreUnavailable(
                                f"{self.path}: the store was compacted but this process keeps a transaction "
                                "open on the old generation; finish it (no write inside a read) and retry"
                            )
                        self._lock.wait(0.05)
                    # The lock was released while waiting: another thread may have switched.
                    where, _ = live_dir(self.path)
                    if where != self._gen.dir and not self._gen.active:
                        new = self._open_live()
                        self._gen.close()
                        self._gen, self._stuck = new, None
                        self.env = new.env
                        self.db.replace(self._gen.db)
            self._gen.active += 1
            self._held[token] = self._held.get(token, 0) + 1
            return self._gen, token

    def _release(self, gen: _Gen, token: object) -> None:
        with self._lock:
            gen.active -= 1
            left = self._held.pop(token) - 1
            if left:
                self._held[token] = left
            self._lock.notify_all()

    def _begin(self, gen: _Gen, write: bool, buffers: bool, counted: bool = True) -> lmdb.Transaction:
        """Begin a transaction in ``gen``; ``counted``: the caller counts in ``gen.active``."""
        for _ in range(3):
            try:
                if buffers:
                    return gen.env.begin(write=write, buffers=True)
                return gen.env.begin(write=write)
            except lmdb.MapResizedError:
                self._set_mapsize(gen, 0, counted=counted)  # another process grew the map: adopt its size
            except lmdb.Error as err:
                raise translate(err, gen.dir, "begin transaction") from err
        raise StoreUnavailable(f"{self.path}: the map kept being resized by other processes; retry")

    def _set_mapsize(self, gen: _Gen, size: int, seen: Optional[int] = None, counted: bool = True) -> None:
        """Resize ``gen``'s map (``size`` 0: adopt the size another process
        set), once no other transaction of this process is open on it: py-lmdb
        invalidates every open transaction of the environment when the map is
        resized, and a read in another thread then fails ("Attempt to operate
        on closed/deleted/dropped object"). The caller holds no transaction;
        ``counted``: it counts in ``gen.active`` (a raw :meth:`begin` does
        not, and is counted here while it waits). ``seen``: the map size the caller found
        full; when the map has grown since (another thread), nothing is done.

        Raises:
            StoreUnavailable: a transaction of this process stayed open for a
                minute (a write inside a read of the same thread never ends).
        """
        with self._lock:
            gen.active += 0 if counted else 1
            gen.resizing += 1
            try:
                deadline = time.monotonic() + 60
                while gen.active > gen.resizing:
                    if time.monotonic() > deadline:
                        raise StoreUnavailable(
                            f"{self.path}: the map must be resized but this process keeps a transaction open; "
                            "finish it (no write inside a read) and retry"
                        )
                    self._lock.wait(0.05)
                if seen is None or gen.env.info()["map_size"] <= seen:
                    gen.env.set_mapsize(size)
            finally:
                gen.resizing -= 1
                gen.active -= 0 if counted else 1
                self._lock.notify_all()

    def begin(self, write: bool = False, buffers: bool = False) -> lmdb.Transaction:
        """A raw transaction on the live generation (prefer :meth:`read`/:meth:`write`).
        Not counted as in flight: :meth:`close` does not wait for it."""
        self.check_pid()
        self._gate.check()
        return self._begin(self._gen, write, buffers, counted=False)

    @contextmanager
    def read(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A short read transaction. Buffers from it die with it. Held open,
        it holds up :meth:`close` (which waits for it, then gives up)."""
        self.check_pid()
        me = self._gate.enter()
        try:
            gen, token = self._follow()
            try:
                txn = self._begin(gen, False, buffers)
                try:
                    yield txn
                except lmdb.Error as err:
                    raise translate(err, gen.dir, "read") from err
                finally:
                    txn.abort()
            finally:
                self._release(gen, token)
        finally:
            self._gate.leave(me)

    def after_commit(self, call: Callable[[], None], undo: Optional[Callable[[], None]] = None) -> None:
        """Run ``call`` once the write transaction this thread is inside has
        committed (if it aborts or is retried, ``undo`` instead): work outside
        LMDB that must wait for the commit, such as unlinking the blob file of
        an entry it deletes. A failing call is logged."""
        if getattr(self._pending, "calls", None) is None:
            raise RuntimeError("after_commit() outside a write transaction")
        self._pending.calls.append((call, undo))

    def _run_pending(self) -> None:
        calls, self._pending.calls = self._pending.calls, None
        for call, _ in calls:
            try:
                call()
            except Exception as err:  # the commit stands; leftovers are swept later
                log.warning("promptstore: after commit: %s", err)

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn(txn)`` in a write transaction and commit; grow the map and
        retry when it is full. All or nothing: on error nothing is written."""
        self.check_pid()
        me = self._gate.enter()
        try:
            return self._write(fn)
        finally:
            self._gate.leave(me)

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        moved = False
        while True:
            gen, token = self._follow(force=moved, write=True)
            moved = False
            try:
                if time.monotonic() - self._readers_checked >= READER_CHECK_EVERY:  # see the module docstring
                    self._readers_checked = time.monotonic()
                    with suppress(lmdb.Error):  # best effort: the write goes on
                        gen.env.reader_check()
                txn = self._begin(gen, True, False)
                try:
                    if gen.name != live_dir(self.path)[1]:
                        moved = True  # compacted while we waited for the write lock
                        txn.abort()
                        continue
                    self._pending.calls = []
                    result = fn(txn)
                    txn.commit()
                    self._run_pending()
                    return result
                except lmdb.MapFullError as err:
                    txn.abort()
                    size = gen.env.info()["map_size"]
                    if size * 2 > MAX_MAP_SIZE:
                        raise StoreFull(
                            f"{self.path}: LMDB map of {size} bytes is full; delete entries or run "
                            "`promptstore gc`"
                        ) from err
                    self._set_mapsize(gen, size * 2, size)
                except lmdb.Error as err:
                    txn.abort()
                    raise translate(err, gen.dir, "write") from err
                except BaseException:
                    txn.abort()
                    raise
            finally:
                pending, self._pending.calls = getattr(self._pending, "calls", None), None
                self._release(gen, token)
                for _, undo in pending or ():  # not committed (_run_pending empties it)
                    if undo is not None:
                        undo()

    # -- compaction --------------------------------------------------------------

    def compact(self) -> Tuple[int, int]:
        """Rewrite the live generation compactly into a new one and switch to it:
        ``(bytes before, bytes after)`` of the data file. Safe while other
        processes use the store (see the module docstring)."""
        self.check_pid()
        if self.readonly:
            raise StoreUnavailable(f"{self.path}: cannot compact a store opened read-only")
        me = self._gate.enter()
        try:
            return self._compact()
        finally:
            self._gate.leave(me)

    def _compact(self) -> Tuple[int, int]:
        while True:
            gen, token = self._follow(force=True)
            try:
                wtxn = self._begin(gen, True, False)  # hold the writer lock: no commit may land in the old file
                try:
                    cur_name = live_dir(self.path)[1]
                    if gen.name != cur_name:
                        continue
                    before = (gen.dir / "data.mdb").stat().st_size
                    n = 0 if gen.name == "." else int(gen.name[4:])
                    rtxn = gen.env.begin(write=False)
                    try:
                        new_name, after = copy_generation(gen.env, rtxn, self.path, n + 1)
                    finally:
                        rtxn.abort()
                    switch_current(self.path, new_name)
                    # Still under the old generation's write lock: only generations up to
                    # the one just copied are removed; a newer one (a concurrent compaction
                    # that ran after ours) is never touched.
                    remove_generations(self.path, n)
                finally:
                    wtxn.abort()
            except lmdb.Error as err:
                raise translate(err, gen.dir, "compact") from err
            except OSError as err:
                full = err.errno in (errno.ENOSPC, errno.EFBIG)
                cls = StoreFull if full else StoreError
                raise cls(f"{self.path}: compact: {err}; the store is unchanged" + ("; free disk space" if full else "")) from err
            finally:
                self._release(gen, token)
            self._release(*self._follow(force=True))
            return before, after

    def snapshot(self, dest: Path) -> None:
        """Copy the live generation's data file into the empty folder ``dest`` (LMDB's copy: one consistent state)."""
        with self.read():  # pins the generation (as for data_file); close waits for it
            self._gen.env.copy(str(dest))

    def data_file(self) -> _pages.DataFile:
        """The live generation's data file as mapped here, its mapping re-read
        if the map was resized since (call inside a transaction, which pins
        the generation and its map)."""
        gen = self._gen
        data = gen.data_file()
        data.refresh(gen.env.info()["map_size"])
        return data

    def close(self, timeout: float = CLOSE_TIMEOUT, last: Optional[Callable[[], None]] = None) -> None:
        """Close the environment, safely while other threads use it
        (:meth:`promptstore.store._gate.Gate.close`). In a forked child nothing is
        touched: the parent's environment, and maybe its lock, came across
        the fork."""
        if os.getpid() == self.pid:
            self._gate.close(timeout, last)



_AFTER_FORK = ("open stores in the child only when the parent did not have them open as it forked, "
               "or start workers with multiprocessing's 'spawn' or 'forkserver' method")


def _folder(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path.absolute()


def _opened_here(path: Path) -> str:
    """Why py-lmdb refused to open ``path`` again in this process."""
    opener = _OPENED.get(_folder(path))
    if opener is not None and opener != os.getpid():
        return (f"{path}: this process is a fork of process {opener}, which had the store open when it "
                f"forked; LMDB cannot open it again here (the parent's copy shares its files and locks): "
                f"{_AFTER_FORK}")
    return (f"{path}: the store is already open in this process (another PromptStore on this folder); "
            "LMDB opens a store once per process: share that PromptStore (it serves any number of "
            "threads) or close it first")
