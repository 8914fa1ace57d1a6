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
"""

from __future__ import annotations

import io
import json
import struct
from typing import BinaryIO, Dict, List, Sequence, cast

import mlx.core as mx


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


def blank(sizes: Sequence[int]) -> List[mx.array]:
    """One evaluated, unwritten uint8 mlx array per size (each > 0)."""
    if not sizes:
        return []
    header, offset = {}, 0
    for i, n in enumerate(sizes):
        header[str(i)] = {"dtype": "U8", "shape": [int(n)], "data_offsets": [offset, offset + int(n)]}
        offset += int(n)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    # mx.load reads any binary file object; a safetensors file gives a dict.
    source = cast(BinaryIO, _Unwritten(head, len(head) + offset))
    loaded = cast(Dict[str, mx.array], mx.load(source, format="safetensors"))
    out = [loaded[str(i)] for i in range(len(sizes))]
    mx.eval(out)
    return out
