"""Shared blocks: the sequence arrays of KV layers cut along their token axis.

An entry's KV arrays (``[..., tokens, width]``, the token axis second to last)
are stored as blocks, one per token range of the entry's *bounds*; a block is
stored once in the store however many entries reference it, under its
content address:

    address = xxh3-128(kind, codec version, dtype, block shape, block bytes)

Content, not token ids: the KV of the same tokens computed by another prefill
path can differ in the low bits, and a restore must equal the cache that was
saved, bit for bit. Identical bytes share; anything else gets its own block.
The address is also the block's checksum: a block is verified against it
whenever it is read.

Bounds are chosen when an entry is written (see ``store._write``): the bounds
of the stored entry that shares the longest prefix with it, up to that
prefix, a cut at the end of that prefix, then every :data:`BLOCK_TOKENS`
tokens, then the entry's length (when no stored entry can serve the new
one, as with entries that cannot be trimmed and share only a system
prompt, the longest prefix the prefix index holds stands in for the shared
prefix: ``_index.indexed_prefix``). So a conversation that grows turn by turn
reuses every block of its previous turn, the partial last block included:
the next turn's blocks start where it ended, and no token's bytes are stored
twice along one chain. Conversations that branch off a stored one (after a
shared system prompt, an edited turn) cut at the branch point, so from the
second branch on, the shared prefix's last, partial block is shared too.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import xxhash

from promptstore.errors import CorruptEntry
from promptstore.format._limits import MAX_ARRAYS

BLOCK_TOKENS = 512  # a new block spans at most this many tokens (why 512: docs/performance.md)
ADDRESS = 16  # bytes of a block address

Bounds = Tuple[int, ...]


def plan_bounds(base: Sequence[int], shared: int, n: int, step: int = BLOCK_TOKENS, limit: int = MAX_ARRAYS) -> Bounds:
    """Block ends for an entry of ``n`` tokens whose first ``shared`` tokens
    equal those of a stored entry with block ends ``base``: every base end
    up to ``shared``, then ``shared`` itself, then every ``step`` tokens
    from there, then ``n``.
    (Counting from the last shared end, not from token 0, leaves no sliver
    of a block between a turn's end and the next multiple of ``step``.)

    At most ``limit`` ends, as many as a manifest's list holds: when ``step``
    would cut more, the blocks after the shared prefix are cut longer, as
    few longer as will do (and should the base's ends alone leave no room,
    the base is not followed)."""
    ends = [b for b in base if 0 < b <= min(shared, n)]
    start = ends[-1] if ends else 0
    if start < shared < n:
        # The prefix ends inside a block of the base: cut there too, so the
        # next entry that shares this prefix (another conversation after the
        # same system prompt) shares the prefix's last, partial block as well.
        ends.append(shared)
        start = shared
    room = limit - len(ends)  # ends left for the tokens after ``start``
    if start < n:
        if room < 1:
            return plan_bounds((), 0, n, step, limit) if ends else (n,)
        step = max(step, -(-(n - start) // room))
    elif room < 0:
        return plan_bounds((), 0, n, step, limit)
    nxt = start + step
    while nxt < n:
        ends.append(nxt)
        nxt += step
    if not ends or ends[-1] != n:
        ends.append(n)
    return tuple(ends)


def header(kind: str, version: int, dtype: str, shape: Sequence[int]) -> bytes:
    return _header(kind, version, dtype, tuple(shape))


@functools.lru_cache(maxsize=1024)
def _header(kind: str, version: int, dtype: str, shape: Tuple[int, ...]) -> bytes:
    # An entry's blocks have a few shapes (full blocks, the last one): formatted once.
    return f"{kind}\0{version}\0{dtype}\0{','.join(map(str, shape))}\0".encode()


@functools.lru_cache(maxsize=1024)
def _hashed_header(kind: str, version: int, dtype: str, shape: Tuple[int, ...]) -> Any:
    """An XXH3-128 state that has absorbed the header: copied for each block (never updated itself)."""
    return xxhash.xxh3_128(_header(kind, version, dtype, shape))


def address(kind: str, version: int, dtype: str, shape: Sequence[int], data: Any, into: Optional[np.ndarray] = None) -> bytes:
    """The content address of a block: ``data`` is its bytes in C order, or a
    ``[rows, tokens, width]`` view of them whose rows are each contiguous
    (hashed row by row, no copy). With ``into`` (a destination of the same
    ``[rows, tokens, width]`` shape), ``data`` must be such a view, and each
    row is copied there right after it is hashed, while it is in the CPU's
    cache: a whole block of 512 tokens can outgrow the cache between the two."""
    h = _hashed_header(kind, version, dtype, tuple(shape)).copy()
    if into is not None:
        for row, out in zip(data, into):
            h.update(row)
            out[...] = row
    elif isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        for row in data:
            h.update(row)
    else:
        h.update(data)
    return h.digest()


def block_shape(shape: Sequence[int], start: int, end: int) -> Tuple[int, ...]:
    return tuple(shape[:-2]) + (end - start, shape[-1])


def check(key: bytes, kind: str, version: int, dtype: str, shape: Sequence[int], itemsize: int, data: Any, where: str) -> None:
    """Refuse a block whose bytes do not hash to its address.

    Raises:
        CorruptEntry: the block is missing bytes or damaged (or is not the one the entry names).
    """
    if len(data) != math.prod(shape) * itemsize:
        raise CorruptEntry(f"{where}: block {key.hex()} has {len(data)} bytes, expected shape {tuple(shape)} {dtype}")
    if address(kind, version, dtype, shape, data) != key:
        raise CorruptEntry(f"{where}: block {key.hex()} does not match its address (its bytes are damaged)")
