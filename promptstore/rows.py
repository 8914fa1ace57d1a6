"""Rows of a running batch: per-row coverage, compact extraction, merge.

A serving loop batches requests: every layer cache then holds B rows
(mlx-lm's ``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache`` with
``left_padding``/``lengths``, ``CacheList`` of those, or promptstore's
``SSMCache``). This module moves single rows in and out of such a batch:

* :func:`row_coverage` -- tokens row ``i`` has absorbed, per layer;
* :func:`extract_row` -- row ``i`` of every layer as a serial (B=1) cache with
  compact storage: left padding and unused capacity stripped, arrays copied
  and evaluated, so holding the row keeps none of the batch alive and the
  batch itself is not touched;
* :func:`put_row` (also ``PromptStore.put_row``) -- extract and store a row as
  a normal serial entry, refused unless its coverage equals ``len(tokens)``;
* :func:`merge_rows` -- join restored serial caches (``store.get``) to a
  running batch, or make a new batch of them, layer by layer through
  mlx-lm's own ``merge``/``extend``.

mlx-lm's ``BatchGenerator.insert(prompts, caches=[restored])`` accepts restored
rows as they are; ``BatchGenerator.extract_cache(uids)`` returns
``{uid: (serial cache, tokens)}`` that ``store.put(model, tokens, cache)``
stores directly (the tokens are exact when ``insert`` got ``all_tokens`` for
any cache it was given).

Hybrid models: ``ArraysCache`` cannot tell its coverage; a row's coverage then
comes from its attention layers. Classes of our own plug in by duck typing:
anything with ``row_offset(i)``, ``extract(i)`` and ``batch_size`` (SSMCache).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)

from promptstore.errors import CoverageMismatch, InvalidInput

__all__ = ["row_count", "row_coverage", "extract_row", "put_row", "merge_rows", "row_nbytes"]


# -- per-class row handlers -----------------------------------------------------


def _name(layer: Any) -> str:
    return type(layer).__name__


def _ints(x: Optional[mx.array]) -> Optional[List[int]]:
    return None if x is None else [int(v) for v in x.tolist()]


def _own(x: Optional[mx.array]) -> Optional[mx.array]:
    """A copy of a slice that shares no buffer with the batch (evaluated later)."""
    return None if x is None else mx.contiguous(x)


def _check_settled(layer: Any, where: str) -> None:
    """Refuse a batch caught between ``prepare()`` and ``finalize()``: its
    offsets still count right padding."""
    if type(layer) is BatchKVCache:
        pending = layer._right_padding is not None
    elif type(layer) is BatchRotatingKVCache:
        pending = layer._lengths is not None
    else:
        pending = getattr(layer, "lengths", None) is not None
    if pending:
        raise InvalidInput(
            f"{where}: the batch is between prepare() and finalize() (a right-padded window is "
            "in progress); take rows between forward calls"
        )


# BatchKVCache: keys [B, H, capacity, D]; row i holds positions
# left_padding[i] .. _idx, and offset[i] == _idx - left_padding[i].


def _bkv_rows(layer: BatchKVCache) -> int:
    return int(layer.offset.shape[0])


def _bkv_cov(layer: BatchKVCache, i: int, where: str) -> int:
    _check_settled(layer, where)
    off = int(layer.offset[i].item())
    lp = int(layer.left_padding[i].item())
    if lp < 0 or layer._idx - lp != off:
        raise InvalidInput(
            f"{where}: BatchKVCache row {i} is inconsistent (offset {off}, left padding {lp}, "
            f"write position {layer._idx}); was the cache changed behind mlx-lm's back?"
        )
    return off


def _bkv_extract(layer: BatchKVCache, i: int, where: str) -> KVCache:
    off = _bkv_cov(layer, i, where)
    out = KVCache()
    if layer.keys is not None and off > 0:
        lp = layer._idx - off
        out.keys = _own(layer.keys[i : i + 1, :, lp : layer._idx, :])
        out.values = _own(layer.values[i : i + 1, :, lp : layer._idx, :])
        out.offset = off
    return out


# BatchRotatingKVCache: a ring of max_size (+ a window while prefilling) per
# row; in temporal order row i starts at max(0, left_padding[i]).


def _brkv_rows(layer: BatchRotatingKVCache) -> int:
    return int(layer.offset.shape[0])


def _brkv_cov(layer: BatchRotatingKVCache, i: int, where: str) -> int:
    _check_settled(layer, where)
    return int(layer.offset[i].item())


def _brkv_extract(layer: BatchRotatingKVCache, i: int, where: str) -> RotatingKVCache:
    off = _brkv_cov(layer, i, where)
    out = RotatingKVCache(layer.max_size)
    if layer.keys is None or off == 0:
        return out
    lp = max(0, int(layer.left_padding[i].item()))
    keys, values, end = layer.keys[i : i + 1], layer.values[i : i + 1], layer._idx
    if layer.rotated:  # the oldest position sits at _idx: unroll the ring
        keys, values = mx.roll(keys, -end, axis=2), mx.roll(values, -end, axis=2)
        end = keys.shape[2]
    n = end - lp
    if n <= 0 or n > off or (lp > 0 and n != off):
        raise InvalidInput(
            f"{where}: BatchRotatingKVCache row {i} is inconsistent ({n} positions held for "
            f"offset {off}, left padding {lp})"
        )
    out.keys = _own(keys[:, :, lp:end, :])
    out.values = _own(values[:, :, lp:end, :])
    out.offset = off
    out._idx = n
    return out


# ArraysCache: fixed slots [B, ...]; coverage unknown. Empty slots stay empty
# (mlx-lm's own extract raises TypeError on them).


def _arrays_rows(layer: ArraysCache) -> int:
    return int(layer.batch_size)


def _arrays_cov(layer: ArraysCache, i: int, where: str) -> Optional[int]:
    _check_settled(layer, where)
    return None


def _arrays_extract(layer: ArraysCache, i: int, where: str) -> ArraysCache:
    _check_settled(layer, where)
    out = ArraysCache(len(layer.cache))
    # left_padding only masks a window still to come; a serial row has none.
    out.cache = [None if s is None else _own(s[i : i + 1]) for s in layer.cache]
    return out


# Serial mlx-lm classes run with B > 1 (a plain batched forward, no padding):
# every row covers ``offset`` tokens.


def _kv_rows(layer: Any) -> int:
    return 1 if layer.keys is None else int(layer.keys.shape[0])


def _kv_cov(layer: Any, i: int, where: str) -> int:
    return int(layer.offset)


def _kv_extract(layer: KVCache, i: int, where: str) -> KVCache:
    out = KVCache()
    if layer.keys is not None and layer.offset > 0:
        out.keys = _own(layer.keys[i : i + 1, :, : layer.offset, :])
        out.values = _own(layer.values[i : i + 1, :, : layer.offset, :])
        out.offset = int(layer.offset)
    return out


def _rkv_extract(layer: RotatingKVCache, i: int, where: str) -> RotatingKVCache:
    out = RotatingKVCache(layer.max_size, keep=layer.keep)
    if layer.keys is not None:
        n = min(int(layer.offset), layer.keys.shape[2])
        out.keys = _own(layer.keys[i : i + 1, :, :n, :])
        out.values = _own(layer.values[i : i + 1, :, :n, :])
    out.offset, out._idx = int(layer.offset), int(layer._idx)
    return out


# CacheList: its inner caches, row by row.


def _list_rows(layer: CacheList) -> int:
    counts = {row_count([c]) for c in layer.caches}
    if len(counts) != 1:
        raise InvalidInput(f"CacheList inner caches disagree on the number of rows: {sorted(counts)}")
    return counts.pop()


def _list_cov(layer: CacheList, i: int, where: str) -> Optional[int]:
    known = {c for c in (_handler(x, where)[1](x, i, where) for x in layer.caches) if c is not None}
    if len(known) > 1:
        raise CoverageMismatch(f"{where}: CacheList inner caches of row {i} cover {sorted(known)} tokens")
    return known.pop() if known else None


def _list_extract(layer: CacheList, i: int, where: str) -> CacheList:
    return CacheList(*(_handler(c, where)[2](c, i, where) for c in layer.caches))


# Our own batch-lane classes (SSMCache): duck typed on row_offset / extract.


def _duck_rows(layer: Any) -> int:
    return int(layer.batch_size)


def _duck_cov(layer: Any, i: int, where: str) -> int:
    return int(layer.row_offset(i))


def _duck_extract(layer: Any, i: int, where: str) -> Any:
    return layer.extract(i)


Handler = Tuple[Callable[[Any], int], Callable[[Any, int, str], Optional[int]], Callable[[Any, int, str], Any]]

_HANDLERS: Dict[type, Handler] = {
    BatchKVCache: (_bkv_rows, _bkv_cov, _bkv_extract),
    BatchRotatingKVCache: (_brkv_rows, _brkv_cov, _brkv_extract),
    ArraysCache: (_arrays_rows, _arrays_cov, _arrays_extract),
    KVCache: (_kv_rows, _kv_cov, _kv_extract),
    RotatingKVCache: (_kv_rows, _kv_cov, _rkv_extract),
    CacheList: (_list_rows, _list_cov, _list_extract),
}
_DUCK: Handler = (_duck_rows, _duck_cov, _duck_extract)


def _handler(layer: Any, where: str) -> Handler:
    # Exact type, as the codec registry: a subclass may carry state we would drop.
    h = _HANDLERS.get(type(layer))
    if h is not None:
        return h
    if all(hasattr(layer, a) for a in ("row_offset", "extract", "batch_size")):
        return _DUCK
    raise InvalidInput(
        f"{where}: cannot take a row of a {type(layer).__module__}.{type(layer).__qualname__}; "
        "supported: BatchKVCache, BatchRotatingKVCache, ArraysCache, KVCache, RotatingKVCache, "
        "CacheList, and classes with row_offset(i)/extract(i)/batch_size (SSMCache)"
    )


# -- public API ---------------------------------------------------------------------


def _layers(batch_cache: Sequence[Any]) -> List[Any]:
    if isinstance(batch_cache, (str, bytes)) or not isinstance(batch_cache, Sequence):
        raise InvalidInput(f"a batch cache is a list of layer caches, got {type(batch_cache).__name__}")
    layers = list(batch_cache)
    if not layers:
        raise InvalidInput("the batch cache has no layers")
    return layers


def row_count(batch_cache: Sequence[Any]) -> int:
    """Number of rows of a batch cache (every layer must agree).

    Raises:
        InvalidInput: not a list of supported layer caches, or layers disagree.
    """
    counts = []
    for li, layer in enumerate(_layers(batch_cache)):
        counts.append(_handler(layer, f"layer {li}")[0](layer))
    if len(set(counts)) != 1:
        raise InvalidInput(f"the layers of this batch hold different numbers of rows: {counts}")
    return counts[0]


def _check_row(batch_cache: Sequence[Any], row: Any) -> int:
    n = row_count(batch_cache)
    if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < n:
        raise InvalidInput(f"row {row!r} is out of range for a batch of {n} rows (valid: 0..{n - 1})")
    return n


def row_coverage(batch_cache: Sequence[Any], row: int) -> List[Optional[int]]:
    """Tokens row ``row`` has absorbed, per layer (None: the layer cannot tell).

    Raises:
        InvalidInput: row out of range, an unsupported layer class, or a batch
            caught between ``prepare()`` and ``finalize()``.
        CoverageMismatch: the inner caches of a CacheList disagree.
    """
    layers = _layers(batch_cache)
    _check_row(layers, row)
    return [_handler(layer, f"layer {li}")[1](layer, row, f"layer {li}") for li, layer in enumerate(layers)]


def _eval_layers(layers: Sequence[Any]) -> None:
    from mlx.utils import tree_flatten

    arrays = []
    for layer in layers:
        # SSMCache.state folds pending rows first; mlx-lm caches are plain.
        arrays.extend(v for _, v in tree_flatten(layer.state) if isinstance(v, mx.array))
    mx.eval(arrays)


def extract_row(batch_cache: Sequence[Any], row: int) -> List[Any]:
    """Row ``row`` of every layer as a serial (B=1) cache with compact storage.

    Left padding and unused capacity are stripped and every array is copied
    and evaluated: the result shares no buffer with the batch, and the batch
    is left exactly as it was (it may keep running).
    ``BatchKVCache`` rows become ``KVCache``, ``BatchRotatingKVCache`` rows
    ``RotatingKVCache``, ``ArraysCache`` rows ``ArraysCache`` (empty slots stay
    empty), ``CacheList`` rows ``CacheList``, ``SSMCache`` rows ``SSMCache``.

    Raises:
        InvalidInput: row out of range, an unsupported layer class, or a batch
            caught between ``prepare()`` and ``finalize()``.
    """
    layers = _layers(batch_cache)
    _check_row(layers, row)
    out = [_handler(layer, f"layer {li}")[2](layer, row, f"layer {li}") for li, layer in enumerate(layers)]
    _eval_layers(out)
    return out


def put_row(store: Any, model: str, tokens: Sequence[int], batch_cache: Sequence[Any], row: int, meta: Optional[Dict[str, Any]] = None):
    """Store row ``row`` of a running batch as a normal serial entry.

    The row is extracted compactly (see :func:`extract_row`), written with
    ``store.put`` and dropped; the batch is not modified and may keep running.
    ``store.get(model, tokens)`` later returns the serial cache.

    Args:
        store: a PromptStore.
        model: the model identity (``fingerprint(...)``).
        tokens: exactly the tokens row ``row`` has absorbed (for mlx-lm's
            BatchGenerator: the row's prompt plus the generated tokens already
            fed back, i.e. ``extract_cache(uids)[uid][1]``).
        batch_cache: the batch's per-layer caches.
        row: the row index, ``0 <= row < batch size``.
        meta: optional user metadata.

    Returns:
        The stored entry's EntryInfo; ``nbytes`` counts only this row.

    Raises:
        InvalidInput: row out of range, bad tokens, an unsupported layer, or
            a batch between ``prepare()`` and ``finalize()``.
        CoverageMismatch: a layer's coverage of this row is not
            ``len(tokens)``, or no layer can tell the row's coverage.
        and everything ``PromptStore.put`` raises.
    """
    from promptstore.store._keys import as_tokens

    layers = _layers(batch_cache)
    n = len(as_tokens(tokens))
    covs = row_coverage(layers, row)
    known = [(li, c) for li, c in enumerate(covs) if c is not None]
    if not known:
        raise CoverageMismatch(
            f"no layer of this batch can tell how many tokens row {row} covers, so the entry "
            "cannot be checked against the tokens; use SSMCache for recurrent layers"
        )
    for li, c in known:
        if c != n:
            raise CoverageMismatch(
                f"row {row}: layer {li} ({_name(layers[li])}) covers {c} tokens but {n} tokens were given; "
                "pass exactly the tokens this row has absorbed (prompt plus generated tokens fed back)"
            )
    return store.put(model, tokens, extract_row(layers, row), meta)


def row_nbytes(serial_cache: Sequence[Any]) -> int:
    """Bytes of the arrays that carry a serial row's state (what put_row writes)."""
    from promptstore.codecs import encode_layer

    return sum(int(a.nbytes) for layer in serial_cache for a in encode_layer(layer).arrays.values())


# -- merging rows into a batch -----------------------------------------------------

_SERIAL_FOR: Dict[type, type] = {
    BatchKVCache: KVCache,
    BatchRotatingKVCache: RotatingKVCache,
    ArraysCache: ArraysCache,
    CacheList: CacheList,
}


def _check_joinable(batch_layer: Any, row_layer: Any, where: str) -> None:
    want = _SERIAL_FOR.get(type(batch_layer), type(batch_layer))
    if type(row_layer) is not want:
        raise InvalidInput(
            f"{where}: a {_name(row_layer)} row cannot join a {_name(batch_layer)} layer "
            f"(expected a {want.__name__})"
        )
    if type(batch_layer) is BatchRotatingKVCache and row_layer.max_size != batch_layer.max_size:
        raise InvalidInput(
            f"{where}: a RotatingKVCache of max_size {row_layer.max_size} cannot join a batch "
            f"of max_size {batch_layer.max_size}"
        )
    if type(batch_layer) is CacheList:
        if len(row_layer.caches) != len(batch_layer.caches):
            raise InvalidInput(f"{where}: CacheList rows hold a different number of inner caches")
        for j, (b, r) in enumerate(zip(batch_layer.caches, row_layer.caches)):
            _check_joinable(b, r, f"{where}.{j}")


def _check_shapes(layers: Sequence[Any], where: str) -> None:
    """Rows must agree on KV heads, head dims and dtype, and on the shape and
    dtype of every recurrent slot, before mlx-lm pads or concatenates them."""
    seen = set()
    slots = set()
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, mx.array):
            seen.add((keys.shape[1], keys.shape[3], layer.values.shape[3], keys.dtype))
        if isinstance(layer, ArraysCache) or hasattr(layer, "row_offset"):
            slots.add(tuple(None if x is None else (tuple(x.shape[1:]), str(x.dtype)) for x in (layer[0], layer[1])))
    if len(seen) > 1:
        raise InvalidInput(f"{where}: rows disagree on KV heads, head dims or dtype: {sorted(map(str, seen))}")
    present = {s for s in slots if all(x is not None for x in s)}
    if len(present) > 1:
        raise InvalidInput(f"{where}: rows disagree on recurrent state shapes or dtypes: {sorted(map(str, present))}")


def _row_layers(rows: Sequence[Sequence[Any]], n_layers: Optional[int]) -> List[List[Any]]:
    out = []
    for r, row in enumerate(rows):
        layers = _layers(row)
        if n_layers is not None and len(layers) != n_layers:
            raise InvalidInput(f"row {r} has {len(layers)} layers, expected {n_layers}")
        n_layers = len(layers)
        for li, layer in enumerate(layers):
            if type(layer) in _SERIAL_FOR and _SERIAL_FOR[type(layer)] is not type(layer):
                raise InvalidInput(
                    f"row {r} layer {li} is a {_name(layer)}: pass serial caches "
                    "(from store.get or extract_row)"
                )
        if row_count(layers) != 1:
            raise InvalidInput(f"row {r} is not a serial (single-row) cache")
        covs = {c for c in row_coverage(layers, 0) if c is not None}
        if len(covs) > 1:
            raise CoverageMismatch(f"row {r}: its layers cover different numbers of tokens: {sorted(covs)}")
        out.append(layers)
    return out


def merge_rows(batch_cache: Optional[Sequence[Any]], rows: Sequence[Sequence[Any]]) -> List[Any]:
    """Join serial rows (e.g. caches from ``store.get``) to a batch.

    With ``batch_cache=None`` the rows become a new batch (what mlx-lm's
    ``BatchGenerator`` does with ``insert(..., caches=...)``); otherwise each
    batch layer is extended in place with the rows, appended after its
    existing rows in order, and the same list is returned. Layers are joined
    through mlx-lm's own ``merge``/``extend``, so the batch stays a normal
    mlx-lm batch. Call between forward calls.

    Raises:
        InvalidInput: no rows, layer counts or classes that do not match, a
            row that holds more than one row, or KV shapes that disagree.
        CoverageMismatch: a row's layers disagree on its coverage.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
        raise InvalidInput("merge_rows needs a non-empty list of serial caches")
    batch = None if batch_cache is None else _layers(batch_cache)
    row_layers = _row_layers(rows, None if batch is None else len(batch))
    n_layers = len(row_layers[0])
    for li in range(n_layers):
        where = f"layer {li}"
        per_row = [r[li] for r in row_layers]
        ref = batch[li] if batch is not None else per_row[0]
        for r, layer in enumerate(per_row):
            if batch is not None:
                _check_joinable(ref, layer, f"{where} (row {r})")
            elif type(layer) is not type(ref):
                raise InvalidInput(f"{where}: rows mix {_name(ref)} and {_name(layer)}")
        _check_shapes(per_row + ([ref] if batch is not None else []), where)
    if batch is not None:
        _check_settled_all(batch)
    merged = [type(row_layers[0][li]).merge([r[li] for r in row_layers]) for li in range(n_layers)]
    if batch is None:
        return merged
    for layer, new in zip(batch, merged):
        layer.extend(new)
    return batch_cache if isinstance(batch_cache, list) else batch


def _check_settled_all(batch: Sequence[Any]) -> None:
    for li, layer in enumerate(batch):
        if type(layer) is CacheList:
            _check_settled_all(layer.caches)
        elif type(layer) in (BatchKVCache, BatchRotatingKVCache, ArraysCache):
            _check_settled(layer, f"layer {li}")
