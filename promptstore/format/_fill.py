"""Filling restore buffers straight from the data file, on several threads.

Copying a payload out of LMDB's memory map costs a page-table entry per
source page: each restore faults the pages in and (to keep the resident set
at one copy) drops them again. ``pread(2)`` from the same file copies out of
the page cache inside the kernel with no source mapping at all, and, with
the GIL released, several threads do it at once, as mlx's own loader does. Each
thread checksums what it has just read (xxh3-64 over 1 MiB pieces, while
they are in its CPU cache) through the C library the ``xxhash`` package is
built on, called by ctypes, which also releases the GIL.

The offsets read are those of pages the caller's read transaction holds, so
the caller waits for every job inside that transaction.
"""

from __future__ import annotations

import ctypes
import struct
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar, cast

import numpy as np

from promptstore.format import _pages

T = TypeVar("T")

PIECE = 1 << 20  # read then hash 1 MiB at a time: the hash reads it from cache


def _workers() -> int:
    """How many fill threads: ``PROMPTSTORE_FILL_THREADS`` when it is a
    positive integer, else one per core, at least 2 and at most 8 (mlx's
    own loader reads on several threads too)."""
    raw = os.environ.get("PROMPTSTORE_FILL_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(2, min(8, os.cpu_count() or 2))


WORKERS = _workers()
_MADV_POPULATE_WRITE = 23
_POPULATE_MIN = 1 << 20


def _huge_pages() -> bool:
    """Whether large mallocs here get transparent huge pages: the kernel
    gives them to every large anonymous mapping (``always``), or only to
    madvised ones and glibc madvises its mmapped chunks
    (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; ``2`` uses preallocated
    huge pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        mode = ""
    tunables = {t.strip() for t in os.environ.get("GLIBC_TUNABLES", "").split(":")}
    if "glibc.malloc.hugetlb=2" in tunables:
        return True
    return "[always]" in mode or ("[madvise]" in mode and "glibc.malloc.hugetlb=1" in tunables)


_HUGE = _huge_pages()


def _load_xxh3() -> Optional[ctypes.CDLL]:
    """The XXH3 streaming functions, or None: from the ``xxhash`` package's
    extension (it exports libxxhash's symbols), else the system library.

    ``lib.update`` is the library's runtime-dispatched update (AVX2/AVX-512
    where the CPU has them) when it exports one, else the plain one, which
    is built for the baseline instruction set and hashes markedly slower
    where wider vectors exist (docs/performance.md).
    """
    candidates = []
    try:
        import xxhash._xxhash as ext

        candidates.append(ext.__file__)
    except (ImportError, AttributeError):
        pass
    candidates.append("libxxhash.so.0")
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            lib.XXH3_createState.restype = ctypes.c_void_p
            lib.XXH3_createState.argtypes = ()
            lib.XXH3_freeState.argtypes = (ctypes.c_void_p,)
            lib.XXH3_64bits_reset.argtypes = (ctypes.c_void_p,)
            lib.XXH3_64bits_update.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
            lib.update = lib.XXH3_64bits_update  # type: ignore[attr-defined]  # CDLL takes new attributes
            lib.XXH3_64bits_digest.restype = ctypes.c_uint64
            lib.XXH3_64bits_digest.argtypes = (ctypes.c_void_p,)
        except (OSError, AttributeError):
            continue
        try:
            fast = lib.XXH3_64bits_update_dispatch
            fast.argtypes = lib.update.argtypes
            lib.update = fast  # type: ignore[attr-defined]
            if _selftest(lib):
                return lib
            lib.update = lib.XXH3_64bits_update  # type: ignore[attr-defined]
        except AttributeError:
            pass
        if _selftest(lib):
            return lib
    return None


def _selftest(lib: ctypes.CDLL) -> bool:
    """The library computes what the ``xxhash`` package computes (the
    checksums in every manifest), in pieces and whole."""
    import xxhash

    data = np.frombuffer(bytes(range(256)) * 1031, dtype=np.uint8)
    return _digest(lib, data, [(0, 1000), (1000, data.size - 1000)]) == xxhash.xxh3_64_intdigest(data.data)


@contextmanager
def _state(lib: ctypes.CDLL) -> Iterator[int]:
    """A fresh XXH3-64 streaming state, freed afterwards."""
    state = lib.XXH3_createState()
    if not state:
        raise MemoryError("XXH3_createState failed")
    try:
        lib.XXH3_64bits_reset(state)
        yield state
    finally:
        lib.XXH3_freeState(state)


def _digest(lib: ctypes.CDLL, host: np.ndarray, pieces: Sequence[Tuple[int, int]]) -> int:
    with _state(lib) as state:
        for pos, n in pieces:
            lib.update(state, host.ctypes.data + pos, n)
        return int(lib.XXH3_64bits_digest(state))


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _setup_128(lib: Optional[ctypes.CDLL]) -> bool:
    """Declare the XXH3-128 streaming functions of ``lib`` (the shared blocks'
    addresses); False when it lacks them or disagrees with the ``xxhash``
    package."""
    if lib is None:
        return False
    try:
        lib.XXH3_128bits_reset.argtypes = (ctypes.c_void_p,)
        update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
        update.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        lib.update128 = update  # type: ignore[attr-defined]  # CDLL takes new attributes
        lib.XXH3_128bits_digest.restype = _XXH128
        lib.XXH3_128bits_digest.argtypes = (ctypes.c_void_p,)
    except AttributeError:
        return False
    import xxhash

    data = np.frombuffer(bytes(range(256)) * 1031, dtype=np.uint8)
    state = lib.XXH3_createState()
    try:
        lib.XXH3_128bits_reset(state)
        lib.update128(state, data.ctypes.data, 1000)
        lib.update128(state, data.ctypes.data + 1000, data.size - 1000)
        d = lib.XXH3_128bits_digest(state)
    finally:
        lib.XXH3_freeState(state)
    return struct.pack(">QQ", d.high64, d.low64) == xxhash.xxh3_128_digest(data.data)


def _setup_quick(lib: Optional[ctypes.CDLL]) -> Optional[ctypes.CDLL]:
    """The same library's XXH3-128 reset, update and digest, declared to keep
    the GIL (``ctypes.PyDLL``): for calls of a few nanoseconds, which cost
    more in letting the GIL go and taking it back than they run."""
    if lib is None:
        return None
    quick = ctypes.PyDLL(lib._name)
    quick.XXH3_128bits_reset.argtypes = (ctypes.c_void_p,)
    quick.update128 = getattr(quick, getattr(lib.update128, "__name__"))  # type: ignore[attr-defined]
    quick.update128.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    quick.XXH3_128bits_digest.restype = _XXH128
    quick.XXH3_128bits_digest.argtypes = (ctypes.c_void_p,)
    return quick


_XXH3 = _load_xxh3()
_HAS_128 = _setup_128(_XXH3)
_QUICK = _setup_quick(_XXH3) if _HAS_128 else None


def available_128() -> bool:
    """Whether :func:`read_hashed` can run (the library has XXH3-128)."""
    return _HAS_128


_local = threading.local()  # per thread: one XXH3-128 state, reused by read_hashed


def _thread_state(lib: ctypes.CDLL) -> int:
    state = getattr(_local, "state", None)
    if state is None:
        state = lib.XXH3_createState()
        if not state:
            raise MemoryError("XXH3_createState failed")
        _local.state = state  # freed with the process: one per fill thread (and caller)
    return state


def read_hashed(fd: int, rows: Sequence[memoryview], offset: int, head: bytes) -> bytes:
    """Read consecutive file bytes from ``offset`` into ``rows`` (writable
    byte views, filled in order), hashing them with XXH3-128 after ``head``;
    return the canonical (big-endian) digest. Only when :func:`available_128`.

    Rows of a block come in one ``preadv`` when they add up to at most
    :data:`PIECE` (then hashed from the CPU cache); larger ones a piece at a
    time (see :func:`_read_piecewise`). Blocks stored back to back are
    better read together (:func:`read_run`).

    Raises:
        ShortRead: the file ends first.
    """
    lib = cast(ctypes.CDLL, _XXH3)
    state = _thread_state(lib)
    lib.XXH3_128bits_reset(state)
    lib.update128(state, head, len(head))
    total = sum(len(row) for row in rows)
    if total <= PIECE:
        _preadv_all(fd, rows, offset, total)
        for row in rows:
            lib.update128(state, ctypes.addressof(ctypes.c_char.from_buffer(row)), len(row))
    else:
        for row in rows:
            _read_piecewise(fd, row, ctypes.addressof(ctypes.c_char.from_buffer(row)), 0, offset, len(row), lib.update128, state)
            offset += len(row)
    d = lib.XXH3_128bits_digest(state)
    return struct.pack(">QQ", d.high64, d.low64)


RUN = 4 << 20  # read_run: blocks read by one preadv, at most this many bytes (hashed from the CPU's cache)
RUN_VIEWS = 512  # and at most this many rows (IOV_MAX is 1024 on Linux)


def read_run(fd: int, offset: int, blocks: Sequence[Tuple[np.ndarray, bytes]]) -> List[bytes]:
    """Read blocks stored back to back in a file from ``offset``, each
    ``(rows, head)`` into ``rows`` (a ``[rows, ...]`` uint8 array whose rows
    are each contiguous, filled in order), with one ``preadv`` for them all;
    then hash each block's rows with XXH3-128 after its ``head``. Return the
    canonical digests, in order. Only when :func:`available_128`.

    One call per block (:func:`read_hashed`) lets go of the GIL and takes
    it back at every ``preadv`` and ctypes call, and threads then wait on
    each other at every block: in a one-off script a 4K-token get's 384
    blocks of 256 KiB read 1.2-1.6x as fast on two threads 4 MiB at a time
    (inside a get on that 2-core machine, no faster; docs/performance.md).
    So here one read covers the run, the small calls of the hash (reset,
    header, digest) keep the GIL, and only hashing a row lets it go.

    Raises:
        ShortRead: the file ends first.
    """
    lib, quick = cast(ctypes.CDLL, _XXH3), cast(ctypes.CDLL, _QUICK)
    views: List[memoryview] = []
    rows_of: List[Tuple[int, int, int]] = []  # per block: address of its first row, stride, row bytes
    for rows, _ in blocks:
        flat = rows.reshape(rows.shape[0], -1)
        views.extend(row.data for row in flat)
        rows_of.append((flat.ctypes.data, flat.strides[0], flat.shape[1]))
    _preadv_all(fd, views, offset, sum(len(v) for v in views))
    state = _thread_state(lib)
    out: List[bytes] = []
    for (rows, head), (addr, stride, width) in zip(blocks, rows_of):
        quick.XXH3_128bits_reset(state)
        quick.update128(state, head, len(head))
        for k in range(rows.shape[0]):
            lib.update128(state, addr + k * stride, width)
        d = quick.XXH3_128bits_digest(state)
        out.append(struct.pack(">QQ", d.high64, d.low64))
    return out


def _preadv_all(fd: int, rows: Sequence[memoryview], offset: int, total: int) -> None:
    """``preadv`` of ``total`` bytes into ``rows``, continued after a short
    read where it stopped.

    Raises:
        ShortRead: the file ends first.
    """
    got = os.preadv(fd, rows, offset)
    while got < total:
        skip = got
        rest = []
        for row in rows:
            if skip >= len(row):
                skip -= len(row)
                continue
            rest.append(row[skip:])
            skip = 0
        r = os.preadv(fd, rest, offset + got)
        if r <= 0:
            raise ShortRead(offset + got, total - got)
        got += r


def read_into(fd: int, rows: Sequence[memoryview], offset: int) -> None:
    """Read consecutive file bytes from ``offset`` into ``rows``, unhashed
    (where :func:`read_hashed` cannot run).

    Raises:
        ShortRead: the file ends first.
    """
    for row in rows:
        got = 0
        while got < len(row):
            r = os.preadv(fd, [row[got:]], offset + got)
            if r <= 0:
                raise ShortRead(offset + got, len(row) - got)
            got += r
        offset += len(row)


def _read_piecewise(fd: int, view: memoryview, addr: int, pos: int, offset: int, length: int, update: Any, state: int) -> int:
    """Read file bytes ``[offset, offset + length)`` into ``view[pos:]``
    (whose memory starts at ``addr``), ``PIECE`` bytes at a time, hashing
    each piece with ``update(state, address, n)`` right after it is read,
    while it is in the CPU cache; return the position after them. The GIL
    is released while reading and hashing.

    Raises:
        ShortRead: the file ends first.
    """
    done = 0
    while done < length:
        n = min(PIECE, length - done)
        got = 0
        while got < n:
            r = os.preadv(fd, [view[pos + got : pos + n]], offset + done + got)
            if r <= 0:
                raise ShortRead(offset + done + got, n - got)
            got += r
        update(state, addr + pos, n)
        pos += n
        done += n
    return pos
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def available() -> bool:
    return _XXH3 is not None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="promptstore-fill")
        return _pool


def submit(fn: Callable[..., T], *args: Any) -> "Future[T]":
    """Run ``fn(*args)`` on the fill threads (work to overlap with I/O on the
    caller's thread); on this thread, before returning, when the pool takes
    no more work (the interpreter is exiting: a put from an atexit handler)."""
    try:
        return _executor().submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return _done(fn, *args)


_copier: Optional[ThreadPoolExecutor] = None
_COPY_PIECE = 1 << 20


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (uint8, same size), in pieces of at least 1 MiB on
    threads of their own (not the fill threads, which may be busy reading)
    and this one: a copy into memory nobody has touched yet also faults its
    pages in, and several threads fault them at once."""
    n = dst.nbytes
    parts = min(WORKERS, max(1, n // _COPY_PIECE))
    if parts == 1:
        np.copyto(dst, src)
        return
    global _copier
    with _pool_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(WORKERS - 1, thread_name_prefix="promptstore-copy")
        pool = _copier
    step = -(-n // parts)
    futures: List[Future] = []
    here = [slice(0, step)]
    for a in range(step, n, step):
        try:
            futures.append(pool.submit(np.copyto, dst[a : a + step], src[a : a + step]))
        except RuntimeError:  # the interpreter is exiting: the rest on this thread
            here.append(slice(a, n))
            break
    try:
        for piece in here:
            np.copyto(dst[piece], src[piece])
    finally:
        _wait_all(futures)
    for f in futures:
        f.result()


def _done(fn: Callable[..., T], *args: Any) -> "Future[T]":
    """A future of ``fn(*args)`` run here and now."""
    future: "Future[T]" = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - delivered through the future, as from the pool
        future.set_exception(err)
    return future


def _forget_pool() -> None:  # a forked child has the pool objects but none of their threads
    global _pool, _copier, _pool_lock
    _pool, _copier, _pool_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _whole_pages(addr: int, n: int) -> Tuple[int, int]:
    """The pages wholly inside ``[addr, addr + n)``, as ``(lo, hi)``."""
    return (addr + _pages._PAGE - 1) & ~(_pages._PAGE - 1), (addr + n) & ~(_pages._PAGE - 1)


def resident(host: np.ndarray) -> bool:
    """Whether every page of ``host`` is in memory: a buffer mlx's cache
    handed back, which :func:`_populate` must leave alone. One ``mincore``
    call per buffer, on the caller's thread: asked for each array on the
    fill threads instead, the checks cost a noticeable share of a restore."""
    if _pages._libc is None:
        return False
    lo, hi = _whole_pages(host.ctypes.data, host.nbytes)
    if hi <= lo:
        return True
    present = np.empty((hi - lo) // _pages._PAGE, dtype=np.uint8)
    return _pages._libc.mincore(lo, hi - lo, present.ctypes.data) == 0 and bool(np.bitwise_and(present, 1).all())


def populate(host: np.ndarray) -> None:
    """Fault in the pages of a fresh destination ``host`` in one call (see :func:`_populate`)."""
    _populate(host.ctypes.data, host.nbytes)


def _populate(addr: int, n: int) -> None:
    """Fault in a fresh destination's pages in one call
    (``MADV_POPULATE_WRITE``, Linux 5.14+; elsewhere a no-op) rather than
    one page fault at a time inside ``pread``, which makes a restore into
    fresh 4 KiB pages faster.

    Not where large mallocs get huge pages (:func:`_huge_pages`): faults
    are then few, and zeroing a whole destination ahead of the copy writes
    it twice through the caches, which costs more than the faults it saves.
    Nor on a destination that is already resident (see :func:`resident`):
    populating resident pages saves nothing and still walks every one of
    them on one thread.
    """
    if _pages._libc is None or _HUGE or n < _POPULATE_MIN:
        return
    lo, hi = _whole_pages(addr, n)
    if hi > lo:
        _pages._libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE)


class ShortRead(Exception):
    """The file ended before a segment did."""

    def __init__(self, offset: int, length: int):
        super().__init__(f"the data file ends inside bytes [{offset}, {offset + length})")


def _job(fd: int, host: np.ndarray, segments: Sequence[Tuple[int, int]], fresh: bool) -> int:
    """Read ``segments`` (file offset, length) back to back into ``host``,
    first populating its pages if ``fresh``; return the xxh3-64 of ``host``."""
    assert _XXH3 is not None
    with _state(_XXH3) as state:
        base, pos = host.ctypes.data, 0
        if fresh:
            _populate(base, host.nbytes)
        view = host.data
        for offset, length in segments:
            pos = _read_piecewise(fd, view, base, pos, offset, length, _XXH3.update, state)
        return int(_XXH3.XXH3_64bits_digest(state))


def read_summed(fd: int, host: np.ndarray, offset: int) -> int:
    """Read ``host.nbytes`` file bytes from ``offset`` into ``host`` on this
    thread, hashing each piece as it is read; return their xxh3-64 (what a
    manifest's checksum of an array is). Only when :func:`available`.

    Raises:
        ShortRead: the file ends first.
    """
    return _job(fd, host, [(offset, host.nbytes)], False)


def balance(sizes: Sequence[int], n: int = 0) -> List[List[int]]:
    """Indexes of ``sizes`` in ``n`` lanes (default :data:`WORKERS`) of about
    equal total size: largest first, each to the lane with the least so far."""
    n = n or WORKERS
    lanes: List[List[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        light = loads.index(min(loads))
        lanes[light].append(k)
        loads[light] += sizes[k]
    return lanes


def fill(fd: int, jobs: Sequence[Tuple[np.ndarray, Sequence[Tuple[int, int]], bool]]) -> List[int]:
    """Run every ``(host, segments, fresh)`` job (see :func:`_job`) on the
    pool; return their digests in order. Returns (or raises the first
    error) only once every job has finished, so no thread still writes or
    reads when it does.

    The jobs go out as one lane per thread, balanced by size (longest
    first, each to the lighter lane), rather than one pool task each: a
    restore has about a hundred arrays, and handing them out one by one
    costs a pool round trip each (measured in docs/performance.md).
    """
    lanes = balance([host.nbytes for host, _, _ in jobs])
    digests: List[int] = [0] * len(jobs)

    def run(lane: List[int]) -> None:
        for k in lane:
            digests[k] = _job(fd, *jobs[k])

    in_lanes(run, lanes)
    return digests


def in_lanes(run: Callable[[List[int]], T], lanes: Sequence[List[int]]) -> List[T]:
    """``run(lane)`` on the pool for every non-empty lane (see
    :func:`balance`); their results, in order. Returns (or raises the first
    lane's error) only once every lane has finished, even when a submit
    failed or on KeyboardInterrupt, so no thread still writes into the
    caller's buffers when it does."""
    futures: List[Future] = []
    try:
        for lane in lanes:
            if lane:
                futures.append(submit(run, lane))
    finally:
        _wait_all(futures)
    return [f.result() for f in futures]


def _wait_all(futures: List[Future]) -> None:
    """Wait until every future is done, even through KeyboardInterrupt (the
    jobs write into the caller's buffers and read pages its transaction
    holds); an interruption is re-raised once they are."""
    interrupted: Optional[BaseException] = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as err:  # noqa: BLE001 - re-raised below
            interrupted = err
    if interrupted is not None:
        raise interrupted
