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
comes from its attention layers. Each layer's row moves are a capability found
in the codec registry by the layer's exact class (``rows_for_layer``): a class
nobody registered, a subclass of a registered one included, is refused with
``MissingCapability`` (an UnknownStorageKind and an InvalidInput).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import mlx.core as mx

from promptstore.codecs import encode_layer, rows_for_layer
from promptstore.codecs._rows import check_joinable
from promptstore.errors import CoverageMismatch, InvalidInput
from promptstore.store._keys import Tokens, as_tokens

__all__ = ["row_count", "row_coverage", "extract_row", "put_row", "merge_rows", "row_nbytes"]


# -- row moves of each class: the codec registry, by exact type (rows_for_layer) ----


def _name(layer: Any) -> str:
    return type(layer).__name__


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
        counts.append(rows_for_layer(layer, f"layer {li}").count(layer))
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
    return [rows_for_layer(layer, f"layer {li}").coverage(layer, row, f"layer {li}") for li, layer in enumerate(layers)]


def _eval_layers(layers: Sequence[Any]) -> None:
    from mlx.utils import tree_flatten

    arrays: List[mx.array] = []
    for layer in layers:
        # SSMCache.state folds pending rows first; mlx-lm caches are plain.
        flat = cast(List[Tuple[str, Any]], tree_flatten(layer.state))  # no destination given: a list
        arrays.extend(v for _, v in flat if isinstance(v, mx.array))
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
    out = [rows_for_layer(layer, f"layer {li}").extract(layer, row, f"layer {li}") for li, layer in enumerate(layers)]
    _eval_layers(out)
    return out


def put_row(store: Any, model: str, tokens: Tokens, batch_cache: Sequence[Any], row: int, meta: Optional[Dict[str, Any]] = None):
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
        InvalidInput: row out of range, bad tokens, or a batch between
            ``prepare()`` and ``finalize()``.
        MissingCapability: a layer whose exact class has no row moves (no
            codec, e.g. an unregistered subclass, or a kind without row
            support); nothing is stored.
        CoverageMismatch: a layer's coverage of this row is not
            ``len(tokens)``, or no layer can tell the row's coverage.
        and everything ``PromptStore.put`` raises.
    """
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
    return sum(int(a.nbytes) for layer in serial_cache for a in encode_layer(layer).arrays.values())


# -- merging rows into a batch -----------------------------------------------------

def _check_shapes(layers: Sequence[Any], where: str) -> None:
    """Rows must agree on KV heads, head dims and dtype, and on the shape and
    dtype of every recurrent slot, before mlx-lm pads or concatenates them."""
    seen = set()
    slots = set()
    for layer in layers:
        rows = rows_for_layer(layer, where)
        kv, slot = rows.kv_signature(layer), rows.slot_signature(layer)
        if kv is not None:
            seen.add(kv)
        if slot is not None:
            slots.add(slot)
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
            if rows_for_layer(layer, f"row {r} layer {li}").serial is not type(layer):
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
                check_joinable(ref, layer, f"{where} (row {r})")
            elif type(layer) is not type(ref):
                raise InvalidInput(f"{where}: rows mix {_name(ref)} and {_name(layer)}")
        _check_shapes(per_row + ([ref] if batch is not None else []), where)
    if batch is not None:
        for li, layer in enumerate(batch):
            rows_for_layer(layer, f"layer {li}").check_settled(layer, f"layer {li}")
    merged = [type(row_layers[0][li]).merge([r[li] for r in row_layers]) for li in range(n_layers)]
    if batch is None:
        return merged
    for layer, new in zip(batch, merged):
        layer.extend(new)
    return batch_cache if isinstance(batch_cache, list) else batch
