"""Fresh mlx buffers that nothing has written yet.

A restore reads each array straight into a new mlx buffer. mlx has no
Python call that allocates a buffer without writing it (``mx.zeros`` fills
it, ``mx.array`` copies into it), and filling first costs a full extra pass
over memory. Its loader does: it allocates each tensor, then asks the
source file to fill it, and a Python file object receives the tensor's own
memory in ``readinto``. So :func:`blank` hands ``mx.load`` a safetensors
stream of its own whose data part is never written: ``readinto`` only
reports the range filled. The caller writes every byte of every buffer
afterwards (through ``np.asarray``); a buffer's contents before that are
unspecified. Each buffer costs a call back into Python, which is why
restored arrays share buffers.

Advising these buffers for transparent huge pages (``madvise`` before the
first write) was measured and left out: it speeds up a restore into memory
the kernel has just freed, but where the host reclaims free memory (a VM
whose balloon reports free 2 MiB blocks back to the host) memory freed a
few seconds earlier is gone from the host, every huge page then costs host
faults, and the same restore becomes several times slower. The figures are
in docs/performance.md.

On mlx's CUDA backend the loader works differently: it allocates each
tensor in device memory and copies what ``readinto`` wrote into a host
buffer of its own across to it. A buffer from :func:`blank` that the host
then writes moves to host memory first (mlx migrates a device buffer the
CPU touches) and back to the device at its first use, and host writes into
it fault page by page: a 4K-token restore ran at half the speed of mlx-lm's
loader there (docs/gpu.md). :func:`filled` therefore lets the caller write
each tensor's bytes inside ``readinto`` instead, into whatever memory the
loader hands over; :func:`staged` says which of the two a restore uses.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, cast

import mlx.core as mx
import numpy as np

from promptstore._backend import backend
from promptstore.format import _fill


class _Unwritten(io.RawIOBase):
    """A safetensors file: a real header, then data that is never written."""

    def __init__(self, head: bytes, size: int):
        super().__init__()
        self.head, self.size, self.pos = head, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:  # called from an mlx thread: must not raise
        m = memoryview(b).cast("B")
        n = m.nbytes
        if self.pos < len(self.head):
            n = min(n, len(self.head) - self.pos)
            m[:n] = self.head[self.pos : self.pos + n]
        self.pos += n
        return n


def mode() -> str:
    """How large restores fill their buffers: ``staged`` (inside mlx's
    loader, :func:`filled`; the CUDA default), ``ahead`` (read ahead of it,
    :func:`ahead`) or ``direct`` (after it, :func:`blank`; elsewhere), as
    ``PROMPTSTORE_RESTORE`` says, else the backend's default."""
    mode = os.environ.get("PROMPTSTORE_RESTORE", "").strip().lower()
    if mode in ("staged", "ahead", "direct"):
        return mode
    return "staged" if backend() == "cuda" else "direct"


def staged() -> bool:
    """Whether restores write each buffer inside mlx's loader (:func:`filled`)
    rather than after it (:func:`blank`): on the CUDA backend, or where
    ``PROMPTSTORE_RESTORE`` says ``staged`` or ``ahead`` (``direct`` forces
    the other)."""
    return mode() != "direct"


def loaders() -> int:
    """How many ``mx.load`` calls a staged restore runs at once, each on a
    thread of its own with a share of the tensors (:func:`filled`):
    ``PROMPTSTORE_LOADERS`` when it is a positive integer, else 4. mlx
    evaluates a file object's tensors one after the other inside one
    ``mx.load`` (its ``python/src/load.cpp``), so on the CUDA backend one
    tensor's reads and its copy to the device never overlap another's;
    several loaders let them. On an H200 a 4K-token get of the
    Qwen3-Next-80B-shaped cache went from 0.43 to 0.61 of mlx-lm's
    loader with 4 (0.54 with 2, 0.63 with 8), a 32K one from 0.95 to 1.97;
    read in one pass (``store._read.assemble``), 1.13 with 4, 0.99 with 8
    and 0.88 with 16 (docs/gpu.md)."""
    raw = os.environ.get("PROMPTSTORE_LOADERS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 4


def reads_ahead() -> bool:
    """Whether a staged restore reads ahead of the loader (:func:`ahead`):
    only where ``PROMPTSTORE_RESTORE`` says ``ahead``. Built to overlap the
    reads with the CUDA loader's copies to the device; on an H200 it gained
    5% at 4K tokens for twice the host memory (docs/gpu.md), so the CUDA
    default stays ``staged``: each tensor read when the loader asks for it."""
    return mode() == "ahead"


def _header(sizes: Sequence[int]) -> bytes:
    """The head of a safetensors file of one uint8 tensor per size, back to back."""
    header, offset = {}, 0
    for i, n in enumerate(sizes):
        header[str(i)] = {"dtype": "U8", "shape": [int(n)], "data_offsets": [offset, offset + int(n)]}
        offset += int(n)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _load(source: _Unwritten, count: int) -> List[mx.array]:
    # mx.load reads any binary file object; a safetensors file gives a dict.
    loaded = cast(Dict[str, mx.array], mx.load(cast(BinaryIO, source), format="safetensors"))
    out = [loaded[str(i)] for i in range(count)]
    mx.eval(out)
    return out


def blank(sizes: Sequence[int]) -> List[mx.array]:
    """One evaluated, unwritten uint8 mlx array per size (each > 0)."""
    if not sizes:
        return []
    head = _header(sizes)
    return _load(_Unwritten(head, len(head) + sum(int(n) for n in sizes)), len(sizes))


class _Filling(_Unwritten):
    """A safetensors file whose tensor ``i`` is written by ``fill(i, view)``.

    Every tensor is filled, whichever failed before it (mlx's loader asks
    for them in an order of its own); ``failures`` holds ``(i, error)`` of
    each that failed."""

    def __init__(self, head: bytes, sizes: Sequence[int], fill: Callable[[int, memoryview], None]):
        super().__init__(head, len(head) + sum(int(n) for n in sizes))
        self.fill = fill
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + int(n))
        self.failures: List[Tuple[int, BaseException]] = []
        self.parts: Dict[int, np.ndarray] = {}  # tensors the loader asked for in pieces

    def readinto(self, b) -> int:  # called from an mlx thread: must not raise
        m = memoryview(b).cast("B")
        pos = self.pos  # another loader thread may seek while this one fills
        if pos < len(self.head):
            return super().readinto(b)
        self._data(pos - len(self.head), m)
        self.pos = pos + m.nbytes
        return m.nbytes

    def _fill_one(self, i: int, view: memoryview) -> None:
        try:
            self.fill(i, view)
        except BaseException as err:  # noqa: BLE001 - raised by filled() once the loader is done
            self.failures.append((i, err))

    def _data(self, lo: int, m: memoryview) -> None:
        hi = lo + m.nbytes
        i = max(0, np.searchsorted(self.starts, lo, side="right") - 1)
        while i < len(self.starts) - 1 and self.starts[i] < hi:
            start, end = self.starts[i], self.starts[i + 1]
            if lo <= start and end <= hi:  # the usual call: one whole tensor
                self._fill_one(int(i), m[start - lo : end - lo])
            else:  # a piece: fill the whole tensor aside once, copy the piece
                if i not in self.parts:
                    whole = np.empty(end - start, dtype=np.uint8)
                    self._fill_one(int(i), memoryview(whole.data))
                    self.parts[i] = whole
                a, z = max(lo, start), min(hi, end)
                np.frombuffer(m, dtype=np.uint8)[a - lo : z - lo] = self.parts[i][a - start : z - start]
            i += 1


def filled(sizes: Sequence[int], fill: Callable[[int, memoryview], None]) -> List[mx.array]:
    """One evaluated uint8 mlx array per size (each > 0), whose bytes
    ``fill(i, view)`` writes into ``view`` (writable, ``sizes[i]`` bytes),
    from inside mlx's loader: on the CUDA backend into the loader's host
    buffer, which it then copies to the device. ``fill`` runs on an mlx
    thread, one tensor at a time per loader (:func:`loaders`: with more
    than one, shares of the tensors balanced by size load at once on
    threads of their own, and ``fill`` may run on several threads at once).
    ``fill`` is called for every tensor even after it raised for one; the
    exception it raised for the lowest ``i`` is raised here, once every
    loader is done (the arrays are then not returned)."""
    if not sizes:
        return []
    shares = _fill.balance(sizes, min(loaders(), len(sizes)))  # no more lanes than tensors: none empty
    out: List[Optional[mx.array]] = [None] * len(sizes)
    errors: List[Tuple[int, BaseException]] = []  # (the tensor it came from, the error)

    def load(share: List[int]) -> None:
        share = sorted(share)  # the loader's reads then go forward through each share
        part = [sizes[i] for i in share]
        source = _Filling(_header(part), part, lambda j, view: fill(share[j], view))
        try:
            arrays = _load(source, len(share))
        except BaseException as err:  # noqa: BLE001 - raised below, once every loader is done
            errors.append((share[0], err))
            return
        if source.failures:
            errors.extend((share[j], err) for j, err in source.failures)
            return
        for i, arr in zip(share, arrays):
            out[i] = arr

    threads = [threading.Thread(target=load, args=(share,), name="promptstore-loader", daemon=True) for share in shares[1:]]
    started = []
    try:
        for t in threads:
            t.start()
            started.append(t)
    except RuntimeError:  # no new threads (the interpreter is exiting): the rest here, in turn
        pass
    load(shares[0])
    interrupted: Optional[BaseException] = None
    for t in started:  # no loader may still call ``fill`` once this returns, even through KeyboardInterrupt
        while t.is_alive():
            try:
                t.join()
            except BaseException as err:  # noqa: BLE001 - re-raised below, once every loader is done
                interrupted = err
    if interrupted is not None:
        raise interrupted
    for share in shares[1 + len(started):]:
        load(share)
    if errors:  # every tensor was filled: the same damage is reported whatever the loaders' order
        raise min(errors, key=lambda e: e[0])[1]
    return cast(List[mx.array], out)


_GROUP = 16 << 20  # ahead(): reads handed out together, at least this many bytes (or one tensor)


def ahead(sizes: Sequence[int], read: Callable[[Sequence[int], List[np.ndarray]], None]) -> List[mx.array]:
    """As :func:`filled`, with the reads running ahead of mlx's loader.

    ``read(indices, hosts)`` writes tensors ``indices`` (consecutive, in
    order) into ``hosts`` (uint8 numpy buffers of this function's, one per
    index). It runs on a thread of its own, a group of at least 16 MiB at a
    time, from the first tensor to the last, while the loader copies every
    tensor already read into its own host buffer and from there to the
    device. With :func:`filled` the loader waits for each tensor's reads
    and the reads wait for each of its copies to the device; here the two
    overlap, for one more host copy (made on several threads) and a host
    buffer of every byte until this returns.

    The first exception ``read`` raises is raised here once the loader is
    done; the groups after it are not read.
    """
    if not sizes:
        return []
    starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))))
    host = np.empty(int(starts[-1]), dtype=np.uint8)
    views = [host[starts[i] : starts[i + 1]] for i in range(len(sizes))]
    groups: List[List[int]] = [[]]
    for i in range(len(sizes)):
        if groups[-1] and starts[i] - starts[groups[-1][0]] >= _GROUP:
            groups.append([])
        groups[-1].append(i)
    ready = [threading.Event() for _ in groups]
    of_group = {i: g for g, members in enumerate(groups) for i in members}
    failed: List[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            for g, members in enumerate(groups):
                if stop.is_set():
                    break
                read(members, [views[i] for i in members])
                ready[g].set()
        except BaseException as err:  # noqa: BLE001 - raised by the loader's next fill, then here
            failed.append(err)
        finally:
            for event in ready:
                event.set()

    def fill(i: int, view: memoryview) -> None:
        ready[of_group[i]].wait()
        if failed:
            raise failed[0]
        _fill.copy(np.frombuffer(view, dtype=np.uint8), views[i])

    reader = threading.Thread(target=run, name="promptstore-ahead", daemon=True)
    try:
        reader.start()
        started = True
    except RuntimeError:  # no new threads (the interpreter is exiting): every read first, here
        started = False
        run()
    try:
        return filled(sizes, fill)
    finally:
        stop.set()
        if started:
            reader.join()  # nothing may still read (the caller's files, its transaction's pages) once this returns


def written(sizes: Sequence[int], fill: Callable[[int, np.ndarray], None]) -> List[mx.array]:
    """One evaluated uint8 mlx array per size (each > 0), whose bytes
    ``fill(i, host)`` writes into ``host`` (a uint8 numpy view of
    ``sizes[i]`` bytes), one array at a time: inside mlx's loader where
    restores are staged (:func:`filled`), else into fresh buffers after it
    (:func:`blank`)."""
    if staged():
        return filled(sizes, lambda i, view: fill(i, np.frombuffer(view, dtype=np.uint8)))
    out = blank(sizes)
    for i, buf in enumerate(out):
        fill(i, np.asarray(buf))
    return out
