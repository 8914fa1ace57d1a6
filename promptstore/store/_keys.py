"""Keys and the prefix index.

* Entry key (layout in ``_schema``): model id (blake2b-128 of the identity
  string) + blake2b-128 of the token bytes + token count. Exact,
  collision-free in practice, and the tokens are verified on every read anyway.
* Prefix hashes: a polynomial rolling hash of every prefix of a token list,
  computed in one vectorised pass (wrapping uint64 arithmetic). They address
  the index only; every candidate they lead to is checked token by token.
The prefix index built on these lives in ``_index``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, Union

import numpy as np

from promptstore.errors import InvalidInput
from promptstore.store._schema import MODEL_ID, U32, U64

_B = 0x9E3779B97F4A7C15 | 1
_B_INV = pow(_B, -1, 1 << 64)
MAX_TOKEN = (1 << 32) - 1

Tokens = Union[Sequence[int], np.ndarray]  # token ids: a list, or a 1-D integer array

# (B**i, B**-i) for i < len: replaced whole, never changed in place, so a
# thread that took the pair has two tables of the same length.
_tables = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))


def as_tokens(tokens: Tokens) -> np.ndarray:
    """Validate a token list and return it as a 1-D uint32 array.

    Raises:
        InvalidInput: not a non-empty 1-D sequence of ints in [0, 2**32).
    """
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as err:
        raise InvalidInput(f"tokens must be a list of ints: {err}") from err
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidInput(f"tokens must be a non-empty 1-D list of ints, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidInput(f"tokens must be ints, got {arr.dtype}")
    if (arr.dtype.kind == "i" and int(arr.min()) < 0) or int(arr.max()) > MAX_TOKEN:
        raise InvalidInput("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def model_id(model: str) -> bytes:
    """16-byte id of a model identity string.

    Raises:
        InvalidInput: empty or non-string identity, or one not encodable as UTF-8.
    """
    if not isinstance(model, str) or not model:
        raise InvalidInput("model identity must be a non-empty string (e.g. promptstore.fingerprint(dir))")
    try:
        raw = model.encode()
    except UnicodeEncodeError as err:
        raise InvalidInput(
            f"model identity {model[:80]!r} is not encodable as UTF-8 ({err.reason} at {err.start}); "
            "use promptstore.fingerprint(dir)"
        ) from err
    return hashlib.blake2b(raw, digest_size=MODEL_ID).digest()


def entry_key(mid: bytes, tokens: np.ndarray) -> bytes:
    digest = hashlib.blake2b(tokens.astype("<u4", copy=False).tobytes(), digest_size=16).digest()
    return mid + digest + U32.pack(len(tokens))


def key_length(ekey: bytes) -> int:
    return U32.unpack(ekey[32:36])[0]


def entry_id(ekey: bytes) -> str:
    """The short, stable, copy-pastable id shown to users (16 hex digits)."""
    return hashlib.blake2b(ekey, digest_size=8).hexdigest()


def _powers_upto(n: int):
    """``(B**i, B**-i)`` for ``i < n`` at least. Threads may race to grow the
    tables; each gets a consistent pair either way."""
    global _tables
    tables = _tables
    if len(tables[0]) >= n:
        return tables
    size = max(n, 2 * len(tables[0]))
    tables = (_powers(_B, size), _powers(_B_INV, size))
    _tables = tables
    return tables


def _powers(base: int, size: int) -> np.ndarray:
    out = np.empty(size, dtype=np.uint64)
    out[0] = 1
    if size > 1:
        with np.errstate(over="ignore"):
            out[1:] = np.cumprod(np.full(size - 1, base, dtype=np.uint64), dtype=np.uint64)
    return out


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """``h[i]`` = hash of ``tokens[:i]`` for ``i`` in ``0..len(tokens)`` (uint64)."""
    n = len(tokens)
    pows, inv_pows = _powers_upto(n + 1)
    t = tokens.astype(np.uint64) + np.uint64(1)
    out = np.zeros(n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s = np.cumsum(t * inv_pows[:n], dtype=np.uint64)
        out[1:] = s * pows[:n]
    return out


def extend_hash(h: int, tokens: np.ndarray) -> int:
    """The :func:`prefix_hashes` value of a prefix (hash ``h``) followed by ``tokens``."""
    pows, _ = _powers_upto(len(tokens) + 1)
    with np.errstate(over="ignore"):
        return int(np.uint64(h) * pows[len(tokens)] + prefix_hashes(tokens)[-1])


def u32(n: int) -> bytes:
    return U32.pack(n)


def u64(n: int) -> bytes:
    return U64.pack(int(n))
