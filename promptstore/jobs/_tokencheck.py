"""Checking a cache that carries no token ids against the prompt it claims to cover.

An mlx-lm prompt-cache file holds layers and a token count, not tokens. The
check recomputes what it can from the prompt and compares:

- **the tail**: every layer is copied without its last ``k`` positions and
  the model runs the prompt's last ``k`` tokens on the copy; the keys and
  values it makes must agree with the file's last ``k``. This needs every
  layer to be a KV layer that can be re-run from a shorter copy: ``KVCache``,
  ``QuantizedKVCache``, and ``RotatingKVCache`` (a sliding window) for as
  many tokens as its window still holds beyond the ``max_size - 1``
  positions the first re-run token attends to. A recurrent layer holds only
  its state after the last token, so a hybrid model's cache has no tail
  check: its attention layers' inputs pass through recurrent layers whose
  earlier state the file does not hold.
- **the head**: the model prefills the prompt's first ``HEAD_TOKENS``
  tokens afresh; every layer that still holds those positions (KV layers,
  the attention layers of a hybrid included; not a window that has moved
  on) must agree. When that covers the whole prompt, every layer is
  compared, recurrent state included.

Agreement is relative, per position: prefill in other chunks changes the low
bits, another token changes everything.

The file's layers are mlx-lm's classes (``load_prompt_cache`` makes them),
handled here by exact class; a fresh prefill's layers are compared as the
mlx-lm class a file holds them as (their codec's ``to_mlx_lm``).

Token ids reach the model only through :func:`token_ids`: mlx does not
bounds-check an embedding lookup, so an id past the model's vocabulary reads
out of bounds (a segfault on the CPU, garbage elsewhere), and one past int64
makes ``mx.array`` throw ``std::bad_cast``.
"""

from __future__ import annotations

import math

import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from promptstore.codecs import codec_for_layer
from promptstore.errors import CorruptEntry, CoverageMismatch, InvalidInput, PromptStoreError
from promptstore.jobs.prefill import MAX_TOKEN_ID, make_cache, prefill, vocab_size

__all__ = [
    "TokenCheck",
    "check_cache_tokens",
    "token_ids",
    "vocab_size",
    "kv_shape",
    "KV_SUBSTITUTES",
    "TAIL_TOKENS",
    "HEAD_TOKENS",
    "TOLERANCE",
]

TAIL_TOKENS = 4
HEAD_TOKENS = 64
TOLERANCE = 0.05
# A quantized layer past the first: its keys re-run attend to quantized keys
# where the file's may have attended to float ones (made before quantization
# began), which moves them by quantization noise (about 0.2 at 4 bits on the
# fixtures); another token moves them by more than 1. The first layer's keys
# depend on the tokens alone, so it is always held to TOLERANCE.
QUANTIZED_TOLERANCE = 0.5

#: mlx-lm's flags turn a model's KVCache into these (``--kv-bits``, ``--max-kv-size``).
KV_SUBSTITUTES: Dict[type, Tuple[type, ...]] = {KVCache: (QuantizedKVCache, RotatingKVCache)}

def token_ids(
    tokens: Any, model: Any = None, where: str = "tokens", error: Type[PromptStoreError] = InvalidInput
) -> List[int]:
    """``tokens`` as a list of ids that ``model`` can look up, checked before
    any reaches mlx.

    Args:
        tokens: a sequence of ints (numpy integers too; not bools).
        model: the model they will run through (None: only the uint32 range
            the store keeps is checked).
        where: what the message names (a path, a metadata key).
        error: what to raise: InvalidInput for a caller's ids, CorruptEntry
            for ids a file records.

    Raises:
        InvalidInput (or ``error``): not a list, or an id that is not an int
            in ``[0, vocabulary)`` (``[0, 2**32)`` without a model).
    """
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise error(f"{where}: token ids must be a list of ints, not {type(tokens).__name__}")
    vocab = vocab_size(model) if model is not None else None
    limit = MAX_TOKEN_ID + 1 if vocab is None else min(vocab, MAX_TOKEN_ID + 1)
    what = "the uint32 range" if vocab is None else f"the model's vocabulary of {vocab} ids"
    hint = "it is damaged" if vocab is None else "it was made for another model, or it is damaged"
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise error(f"{where}: token id at position {i} is {t!r}, not an int")
        if not 0 <= int(t) < limit:
            raise error(
                f"{where}: token id {int(t)} at position {i} is outside {what} (0 to {limit - 1}); {hint}"
            )
        out.append(int(t))
    return out


@dataclass(frozen=True)
class TokenCheck:
    """What :func:`check_cache_tokens` verified.

    ``head``: the first positions recomputed from the prompt (in every layer
    that still holds them); ``tail``: the last positions recomputed from the
    prompt's last tokens, in every layer (0: the tail could not be checked);
    ``unverified``: why the end of the cache was not checked (None: it was,
    by the tail or by a head that covers the whole prompt).
    """

    tokens: int
    head: int
    tail: int
    unverified: Optional[str]

    @property
    def verified(self) -> bool:
        return self.unverified is None

    def describe(self) -> str:
        """One line for an entry's metadata: what was compared."""
        parts = []
        if self.head:
            parts.append(f"first {self.head}")
        if self.tail:
            parts.append(f"last {self.tail}")
        what = " and ".join(parts) + f" of {self.tokens} tokens" if parts else "nothing"
        return what if self.verified else f"{what}; end unverified"


# -- KV layers by exact class ------------------------------------------------------------


def _positions(layer: Any) -> Optional[Tuple[Any, Any, int]]:
    """``(keys, values, first)``: the positions a KV layer holds, in temporal
    order and as stored (a quantized layer's are ``(packed, scales, biases)``
    triples), of which the first is position ``first``. None: not a KV layer,
    or one whose held positions are not consecutive (a window with ``keep``
    sink tokens that has moved on)."""
    t = type(layer)
    if t not in (KVCache, QuantizedKVCache, RotatingKVCache) or layer.keys is None:
        return None
    n = int(layer.offset)
    if t is KVCache:
        return layer.keys[..., :n, :], layer.values[..., :n, :], 0
    if t is QuantizedKVCache:
        return tuple(x[..., :n, :] for x in layer.keys), tuple(x[..., :n, :] for x in layer.values), 0
    if t is RotatingKVCache:
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        held = int(keys.shape[2])
        if held > n or (layer.keep > 0 and n > layer.max_size):
            return None
        return keys, values, n - held
    return None


def _cut(x: Any, a: int, b: int) -> Any:
    """Positions ``a:b`` of an array or a quantized triple (fresh array objects:
    mlx-lm's caches write into their buffers in place)."""
    if isinstance(x, tuple):
        return tuple(y[..., a:b, :] for y in x)
    return x[..., a:b, :]


def _floats(layer: Any, x: Any) -> mx.array:
    """Positions as float32 (a quantized triple dequantized).

    Raises:
        CorruptEntry: a quantized layer whose bits or group size do not fit its arrays.
    """
    if isinstance(x, tuple):
        packed, scales, biases = x
        try:
            return mx.dequantize(packed, scales, biases, group_size=layer.group_size, bits=layer.bits).astype(mx.float32)
        except ValueError as err:  # mlx checks the shapes against the parameters
            raise CorruptEntry(f"a quantized layer's arrays do not fit its {layer.bits} bits and group size "
                               f"{layer.group_size} ({err})") from err
    return x.astype(mx.float32)


def _held(x: Any) -> int:
    return int((x[0] if isinstance(x, tuple) else x).shape[2])


def kv_shape(layer: Any) -> Optional[Tuple[int, ...]]:
    """The shape of one position of a KV layer's keys, dequantized (None: not
    a KV layer, or one that holds none). Any held position: a window whose
    positions are not consecutive (``keep`` sink tokens, moved on) has one too."""
    if type(layer) not in (KVCache, QuantizedKVCache, RotatingKVCache) or layer.keys is None or int(layer.offset) < 1:
        return None
    keys = tuple(layer.keys) if isinstance(layer.keys, (list, tuple)) else layer.keys  # a quantized triple, as a list when loaded
    return tuple(_floats(layer, _cut(keys, 0, 1)).shape)


def _max_tail(layer: Any, n: int) -> int:
    """How many last tokens a shorter copy of ``layer`` can re-run exactly (0: none)."""
    held = _positions(layer)
    if held is None:
        return 0
    first = held[2]
    if first == 0:
        return n - 1
    # A window that has moved on: the first re-run token attends to the
    # max_size - 1 positions before it, which the copy must still hold.
    return _held(held[0]) - layer.max_size + 1


def _shorter(layer: Any, k: int) -> Any:
    """A copy of ``layer`` without its last ``k`` positions, which mlx-lm's own
    update then extends exactly as the original prefill did."""
    keys, values, first = cast(Tuple[Any, Any, int], _positions(layer))
    n, held = int(layer.offset), _held(keys)
    t = type(layer)
    c: Any
    if t is KVCache:
        c = KVCache()
    elif t is QuantizedKVCache:
        c = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
    else:
        c = RotatingKVCache(layer.max_size, keep=layer.keep)
        if k == 1 and first > 0:
            # One token takes mlx-lm's in-place path: a full ring whose write
            # slot holds the position being recomputed (attention over the
            # ring is order-free; the mask is None for a full window).
            w = layer.max_size
            c.keys, c.values = _cut(keys, held - w, held), _cut(values, held - w, held)
            c.offset, c._idx = n - 1, w - 1
            return c
        c._idx = held - k
    c.keys, c.values = _cut(keys, 0, held - k), _cut(values, 0, held - k)
    c.offset = n - k
    return c


# -- comparison ---------------------------------------------------------------------------


def _worst(a: mx.array, b: mx.array, per_position: bool) -> float:
    """The largest mean absolute difference relative to the mean magnitude:
    per position for KV arrays ``[B, heads, seq, dim]``, over all of a state.
    Infinite where either side holds a NaN or an infinity: no prefill of the
    prompt made those (and NaN compares false with any tolerance)."""
    axes = [0, 1, 3] if per_position else list(range(a.ndim))
    d = mx.abs(a - b).mean(axis=axes) / (mx.abs(b).mean(axis=axes) + 1e-6)
    worst = cast(float, d.max().item())
    return worst if math.isfinite(worst) else math.inf


def _states(layer: Any) -> List[mx.array]:
    return [v for _, v in cast(List[Tuple[str, Any]], tree_flatten(layer.state)) if isinstance(v, mx.array)]


def _check_tail(cache: Sequence[Any], model: Any, tokens: Sequence[int], where: str) -> Tuple[int, Optional[str]]:
    n = len(tokens)
    limits = []
    for i, layer in enumerate(cache):
        m = _max_tail(layer, n)
        if m < 1:
            name = type(layer).__name__
            if type(layer) in (KVCache, QuantizedKVCache, RotatingKVCache):
                why = f"layer {i} ({name}) no longer holds the positions its last token attends to"
            elif type(layer) is ArraysCache:
                why = f"layer {i} ({name}) holds only its recurrent state after the last token, which cannot be re-run from an earlier point"
            else:
                why = f"layer {i} ({name}) is a kind this check cannot re-run from an earlier point"
            return 0, why
        limits.append(m)
    k = min([TAIL_TOKENS, n - 1] + limits)
    if k < 1:
        return 0, "a one-token cache has no earlier point to re-run from"
    copies = [_shorter(layer, k) for layer in cache]
    model(mx.array([list(tokens[n - k :])]), cache=copies)
    for i, (mine, theirs) in enumerate(zip(copies, cache)):
        a, b = cast(Tuple[Any, Any, int], _positions(mine)), cast(Tuple[Any, Any, int], _positions(theirs))
        tolerance = QUANTIZED_TOLERANCE if i > 0 and type(theirs) is QuantizedKVCache else TOLERANCE
        for x, y in ((a[0], b[0]), (a[1], b[1])):
            hx, hy = _held(x), _held(y)
            if _worst(_floats(mine, _cut(x, hx - k, hx)), _floats(theirs, _cut(y, hy - k, hy)), True) > tolerance:
                raise CoverageMismatch(
                    f"{where}: the cache's last {k} positions (layer {i}) were not made from the last {k} tokens of the prompt; "
                    "give the exact prompt the file was made from"
                )
    return k, None


def _check_head(cache: Sequence[Any], model: Any, tokens: Sequence[int], where: str) -> Tuple[int, bool]:
    """Returns ``(positions compared, whether every layer was compared)``;
    0 positions when no layer holds them."""
    n = len(tokens)
    m = min(n, HEAD_TOKENS)
    fresh = make_cache(model)
    for i, layer in enumerate(cache):
        if type(layer) is RotatingKVCache and type(fresh[i]) is not RotatingKVCache:  # --max-kv-size
            fresh[i] = RotatingKVCache(layer.max_size, keep=layer.keep)
        if type(layer) is RotatingKVCache and layer.keep > 0:
            m = min(m, layer.max_size)  # sink tokens: the window's content depends on chunking past max_size
    prefill(model, tokens[:m], cache=fresh)
    fresh = [codec_for_layer(layer).to_mlx_lm(layer) for layer in fresh]  # as the file holds them
    everything, compared = True, False
    for i, (mine, theirs) in enumerate(zip(fresh, cache)):
        held = _positions(theirs)
        if held is not None:
            # A window that has moved past the head; or quantized keys, of which
            # those made after quantization began attended to quantized keys,
            # so a fresh prefill differs from them by more than chunking does.
            if held[2] > 0 or type(theirs) is QuantizedKVCache:
                everything = False
                continue
            ours = cast(Tuple[Any, Any, int], _positions(mine))
            pairs = [(_floats(mine, _cut(x, 0, m)), _floats(theirs, _cut(y, 0, m))) for x, y in zip(ours[:2], held[:2])]
            per_position = True
        elif m == n:
            a, b = _states(mine), _states(theirs)
            if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
                raise CoverageMismatch(f"{where}: layer {i} ({type(theirs).__name__}) holds state of other shapes than the prompt makes")
            pairs = [(x.astype(mx.float32), y.astype(mx.float32)) for x, y in zip(a, b)]
            per_position = False
        else:
            everything = False
            continue
        compared = True
        if any(_worst(x, y, per_position) > TOLERANCE for x, y in pairs):
            raise CoverageMismatch(
                f"{where}: layer {i} ({type(theirs).__name__}) was not made from the first {m} tokens of the prompt; "
                "give the exact prompt (and chat template settings) the file was made from"
            )
    return (m if compared else 0), everything and m == n


def check_cache_tokens(cache: Sequence[Any], model: Any, tokens: Sequence[int], where: str = "cache") -> TokenCheck:
    """Check that ``cache`` (mlx-lm layers covering ``len(tokens)``) was made from ``tokens``.

    Every layer that can be checked is: the head in every layer that holds
    it, the tail in all of them when every layer can be re-run (see the
    module docstring). ``cache`` is left as it was.

    Returns:
        A :class:`TokenCheck`; ``verified`` is False when the end of the
        cache could not be checked (a hybrid model's prompt longer than
        ``HEAD_TOKENS``, a window with sink tokens that has moved on).

    Raises:
        CoverageMismatch: a checked position was made from other tokens.
        InvalidInput: a token id the model cannot look up (:func:`token_ids`).
    """
    tokens = token_ids(tokens, model, where)
    tail, why = _check_tail(cache, model, tokens, where)
    head, whole = _check_head(cache, model, tokens, where)
    if whole:
        why = None
    elif why is not None:
        why = f"its end cannot be checked against the prompt: {why}"
    return TokenCheck(len(tokens), head, tail, why)
