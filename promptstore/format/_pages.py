"""LMDB's mapping of the data file in this process, and reading around it (Linux).

py-lmdb touches every page of a value it returns (it "preloads" it, so that
no page fault happens while it holds the GIL), so each chunk a restore
fetches is mapped into the process whole. Those pages would then stay
mapped, and the process's resident set would grow by the entry's size on
top of the copy it keeps: a 1 GB restore would show as 2 GB in ``top`` and
count twice against an RSS limit. ``release`` unmaps a chunk's pages with
``madvise(MADV_DONTNEED)``: for a shared file mapping this only drops
page-table entries; the data stays in the page cache (and in the file).

Only buffers that lie inside the data file's mapping are touched (checked
against ``/proc/self/maps``): a value from a write transaction's dirty page
or a ``bytes`` copy is left alone, since DONTNEED on private memory would
zero it.

A :class:`DataFile` also gives the file offset of a mapped buffer and a
read-only descriptor of the very file mapped (same device and inode), so a
restore can ``pread`` the payload instead of copying it out of the map; and
it remembers where entries were found, so that a later restore of the same
entry need not fetch (and so map) its chunks at all.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

MIN_PAYLOAD = 8 << 20  # smaller entries are copied out of the map: the maps scan, fd and threads are not worth it
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    except (OSError, AttributeError):
        _libc = None
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


Span = Tuple[int, int, int, int, int]  # lo, hi, file offset at lo, st_dev, st_ino


def _spans(path: str) -> List[Span]:
    """Where ``path`` is mapped into this process."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if not line.rstrip().endswith(path):
                    continue
                fields = line.split()
                lo, hi = fields[0].split("-")
                major, minor = fields[3].split(":")
                dev = os.makedev(int(major, 16), int(minor, 16))
                out.append((int(lo, 16), int(hi, 16), int(fields[2], 16), dev, int(fields[4])))
    except (OSError, ValueError, IndexError):
        return []
    return out


class DataFile:
    """One generation's ``data.mdb`` as this process maps it.

    Thread-safe. The spans are re-read from /proc/self/maps when the map size
    changed since they were read (:meth:`refresh`, called by ``Env.data_file``)
    and whenever a buffer lies outside them.
    """

    LOCATED_MAX = 4096

    def __init__(self, data_file: str):
        self.path = os.path.realpath(data_file)
        self.spans: List[Span] = []
        self.map_size = -1  # the spans are read on the first refresh(map_size)
        self._fd: Optional[int] = None
        self._opened = False
        self._lock = threading.Lock()
        self.located: Dict[Any, List[int]] = {}  # entry -> chunk file offsets, see store._restore

    def refresh(self, map_size: Optional[int] = None) -> None:
        """Re-read the mapping (always, or when ``map_size`` differs from the
        size it was read at: LMDB maps the file again on every resize, maybe
        over the old addresses, and a buffer there must not be taken for a
        page of the old map)."""
        if map_size is not None and map_size == self.map_size:
            return
        self.spans = _spans(self.path) if sys.platform.startswith("linux") else []
        if map_size is not None:
            self.map_size = map_size

    def span(self, buf: Any) -> Optional[Tuple[int, int, int]]:
        """``(address, end of its span, file offset)`` of a buffer lying
        wholly inside the mapping, else None (a private copy, a dirty page)."""
        if not isinstance(buf, memoryview) or not buf.nbytes or not sys.platform.startswith("linux"):
            return None
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        end = addr + buf.nbytes
        for fresh in (False, True):
            if fresh:
                self.spans = _spans(self.path)
            for lo, hi, off, _, _ in self.spans:
                if lo <= addr and end <= hi:
                    return addr, hi, off + addr - lo
        return None

    def offset(self, buf: Any) -> Optional[int]:
        """The file offset of a buffer inside the mapping, else None."""
        where = self.span(buf)
        return None if where is None else where[2]

    def release(self, buf: Any) -> None:
        """Drop a mapped buffer's pages from this process's page tables."""
        if _libc is None:
            return
        where = self.span(buf)
        if where is None:
            return
        addr, hi, _ = where
        start = addr & ~(_PAGE - 1)
        stop = min((addr + buf.nbytes + _PAGE - 1) & ~(_PAGE - 1), hi)
        _libc.madvise(start, stop - start, _MADV_DONTNEED)

    @property
    def fd(self) -> Optional[int]:
        """A read-only descriptor of the mapped file (same device and inode:
        a path can be renamed over), or None."""
        with self._lock:
            if not self._opened:
                self._opened = True
                self._fd = self._open()
            return self._fd

    def _open(self) -> Optional[int]:
        if not self.spans:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if not any((dev, ino) == (st.st_dev, st.st_ino) for _, _, _, dev, ino in self.spans):
            os.close(fd)
            return None
        return fd

    def remember(self, key: Any, offsets: List[int]) -> None:
        with self._lock:
            if len(self.located) >= self.LOCATED_MAX:
                self.located.clear()
            self.located[key] = offsets

    def forget(self, key: Any) -> None:
        with self._lock:
            self.located.pop(key, None)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._opened = None, True
            self.located.clear()
