"""Dropping copied LMDB pages from this process's page tables (Linux).

A restore reads every payload page through LMDB's shared, read-only file
mapping. Those pages then stay mapped, so the process's resident set grows
by the entry's size on top of the copy it keeps: a 1 GB restore would show
as 2 GB in ``top`` and count twice against an RSS limit. Once a chunk is
copied, ``madvise(MADV_DONTNEED)`` unmaps its pages: for a shared file
mapping this only drops page-table entries; the data stays in the page
cache (and in the file), and a later read simply maps it again.

Only buffers that lie inside the data file's mapping are touched (checked
against ``/proc/self/maps``): a value from a write transaction's dirty page
or a ``bytes`` copy is left alone, since DONTNEED on private memory would
zero it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

MIN_PAYLOAD = 8 << 20  # below this the saving is small and the maps scan not worth it
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        _libc = None


def _ranges(data_file: str) -> List[Tuple[int, int]]:
    """Address ranges where ``data_file`` is mapped into this process."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith(data_file):
                    lo, hi = line.split(None, 1)[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


def releaser(data_file: str, payload: int) -> Optional[Callable[[Any], None]]:
    """A ``release(buf)`` for ``read_arrays``, or None when not worth it or
    not possible (not Linux, small payload, mapping not found)."""
    if _libc is None or payload < MIN_PAYLOAD:
        return None
    ranges = _ranges(os.path.realpath(data_file))
    if not ranges:
        return None

    def release(buf: Any) -> None:
        if not isinstance(buf, memoryview) or not buf.nbytes:
            return
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        end = addr + buf.nbytes
        if not any(lo <= addr and end <= hi for lo, hi in ranges):
            return
        start = addr & ~(_PAGE - 1)
        stop = min((end + _PAGE - 1) & ~(_PAGE - 1), next(hi for lo, hi in ranges if lo <= addr < hi))
        _libc.madvise(start, stop - start, _MADV_DONTNEED)

    return release
