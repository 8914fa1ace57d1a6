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
comes from its attention layers. mlx-lm's own batches (``BatchGenerator``)
hold ``ArraysCache`` in the gated-DeltaNet layers of Qwen3-Next / Qwen3.5:
``extract_row``/``put_row`` with ``gated=`` (one flag per layer, from
:func:`promptstore.ssm.gated_delta_layers`, or True for every ArraysCache
layer) turn those layers of the row into ``SSMCache`` covering the row's
tokens, so they are stored as ``ssm.gated_delta`` with coverage. Without
``gated`` a layer keeps its class (the batch alone cannot tell a
gated-DeltaNet layer from another two-slot recurrent layer, e.g. Mamba2).

Joining ArraysCache and SSMCache rows (:func:`merge_rows`): the running
batch's class wins. An ``ArraysCache`` row joins an ``SSMCache`` batch layer
as an SSMCache covering the row's tokens (known from its attention layers,
else refused with CoverageMismatch); an ``SSMCache`` row joins an
``ArraysCache`` batch layer (mlx-lm's) as the ``ArraysCache(2)`` it mirrors,
pending rows folded and its coverage dropped (that batch cannot hold it).
In a new batch, a layer where rows mix the two classes becomes ``SSMCache``.
Both conversions share the slot arrays: the joined state is bit-identical.

Each layer's row moves are a capability found
in the codec registry by the layer's exact class (``rows_for_layer``): a class
nobody registered, a subclass of a registered one included, is refused with
``MissingCapability`` (an UnknownStorageKind and an InvalidInput).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList

from promptstore.codecs import codec_for_layer, encode_layer, layers_of, rows_for_layer
from promptstore.codecs._rows import check_joinable
from promptstore.errors import CoverageMismatch, InvalidInput, RoundError
from promptstore.ssm import SSMCache
from promptstore.store._keys import Tokens, as_tokens

#: Which layers of a batch are gated-DeltaNet layers: one flag per layer
#: (:func:`promptstore.ssm.gated_delta_layers`), True for every ArraysCache
#: layer, or None/False for none.
Gated = Union[None, bool, Sequence[bool]]

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
    """``row`` as an int index of a row of the batch.

    Raises:
        InvalidInput: not an integer, or out of range.
    """
    n, given = row_count(batch_cache), row
    try:
        row = operator.index(row) if not isinstance(row, (bool, np.bool_)) else None  # numpy and mlx integers too
    except TypeError:
        row = None
    if row is None:
        raise InvalidInput(f"row must be an integer index, not {type(given).__name__}")
    if not 0 <= row < n:
        raise InvalidInput(f"row {row} is out of range for a batch of {n} rows (valid: 0..{n - 1})")
    return row


def row_coverage(batch_cache: Sequence[Any], row: int) -> List[Optional[int]]:
    """Tokens row ``row`` has absorbed, per layer (None: the layer cannot tell).

    Raises:
        InvalidInput: row out of range, an unsupported layer class, or a batch
            caught between ``prepare()`` and ``finalize()``.
        CoverageMismatch: the inner caches of a CacheList disagree.
    """
    layers = _layers(batch_cache)
    row = _check_row(layers, row)
    return [rows_for_layer(layer, f"layer {li}").coverage(layer, row, f"layer {li}") for li, layer in enumerate(layers)]


def _eval_layers(layers: Sequence[Any]) -> None:
    from mlx.utils import tree_flatten

    arrays: List[mx.array] = []
    for layer in layers:
        # SSMCache.state folds pending rows first; mlx-lm caches are plain.
        flat = cast(List[Tuple[str, Any]], tree_flatten(layer.state))  # no destination given: a list
        arrays.extend(v for _, v in flat if isinstance(v, mx.array))
    mx.eval(arrays)


def extract_row(batch_cache: Sequence[Any], row: int, *, gated: Gated = None) -> List[Any]:
    """Row ``row`` of every layer as a serial (B=1) cache with compact storage.

    Left padding and unused capacity are stripped and every array is copied
    and evaluated: the result shares no buffer with the batch, and the batch
    is left exactly as it was (it may keep running).
    ``BatchKVCache`` rows become ``KVCache``, ``BatchRotatingKVCache`` rows
    ``RotatingKVCache``, ``ArraysCache`` rows ``ArraysCache`` (empty slots stay
    empty), ``CacheList`` rows ``CacheList``, ``SSMCache`` rows ``SSMCache``.

    Args:
        batch_cache: the batch's per-layer caches.
        row: the row index.
        gated: the batch's gated-DeltaNet layers (see :data:`Gated`): their
            ``ArraysCache`` rows become ``SSMCache`` covering the tokens the
            row's other layers report (the same arrays, bit for bit).

    Raises:
        InvalidInput: row out of range, an unsupported layer class, a batch
            caught between ``prepare()`` and ``finalize()``, or ``gated`` of
            another length than the batch.
        CoverageMismatch: ``gated`` asks for a conversion but no layer of the
            row reports its coverage, or the layers that do disagree.
    """
    layers = _layers(batch_cache)
    row = _check_row(layers, row)
    flags = _flags(gated, len(layers))
    out = [rows_for_layer(layer, f"layer {li}").extract(layer, row, f"layer {li}") for li, layer in enumerate(layers)]
    if any(f and type(layer) is ArraysCache for f, layer in zip(flags, out)):
        coverage = _known_coverage(row_coverage(layers, row), f"row {row}")
        if coverage is None:
            raise CoverageMismatch(
                f"row {row}: no layer of this batch reports how many tokens the row covers, so its "
                "gated-DeltaNet layers cannot become SSMCache; build the batch with SSMCache layers"
            )
        out = [SSMCache.from_arrays_cache(layer, coverage) if f and type(layer) is ArraysCache else layer
               for f, layer in zip(flags, out)]
    _eval_layers(out)
    return out


def _flags(gated: Gated, n: int) -> List[bool]:
    if gated is None or gated is False:
        return [False] * n
    if gated is True:
        return [True] * n
    if isinstance(gated, (str, bytes)) or not isinstance(gated, Sequence):
        raise InvalidInput(f"gated: one flag per layer, True or None, got {type(gated).__name__}")
    flags = list(gated)
    if len(flags) != n:
        raise InvalidInput(f"gated: {len(flags)} flags for a cache of {n} layers (one bool per layer)")
    if not all(isinstance(f, bool) for f in flags):
        odd = next(f for f in flags if not isinstance(f, bool))
        raise InvalidInput(f"gated: one bool per layer, got a {type(odd).__name__}")
    return flags


def _known_coverage(covs: Sequence[Optional[int]], where: str) -> Optional[int]:
    """The one coverage the layers that can tell report (None: none can)."""
    known = {c for c in covs if c is not None}
    if len(known) > 1:
        raise CoverageMismatch(f"{where}: its layers cover different numbers of tokens: {sorted(known)}")
    return known.pop() if known else None


def put_row(store: Any, model: str, tokens: Tokens, batch_cache: Sequence[Any], row: int,
            meta: Optional[Dict[str, Any]] = None, *, gated: Gated = None):
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
        gated: the batch's gated-DeltaNet layers (see :data:`Gated`): their
            ``ArraysCache`` rows are stored as ``ssm.gated_delta`` covering
            ``tokens``, as every other path stores them.

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
    return store.put(model, tokens, extract_row(layers, row, gated=gated), meta)


def row_nbytes(serial_cache: Sequence[Any]) -> int:
    """Bytes of the arrays that carry a serial row's state (what put_row writes).

    Raises:
        InvalidInput: ``serial_cache`` is not a list of cache layers.
        UnknownStorageKind: a layer's class has no codec.
    """
    return sum(int(a.nbytes) for layer in layers_of(serial_cache, "serial_cache") for a in encode_layer(layer).arrays.values())


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
    counts = {len(s) for s in slots}
    if len(counts) > 1:
        raise InvalidInput(f"{where}: rows disagree on recurrent state shapes or dtypes: they hold {sorted(counts)} slots")
    for e in range(counts.pop() if counts else 0):
        # An empty slot joins any other: mlx-lm fills it with zeros of the others' shape.
        present = {s[e] for s in slots if s[e] is not None}
        if len(present) > 1:
            raise InvalidInput(f"{where}: rows disagree on recurrent state shapes or dtypes: slot {e} is {sorted(map(str, present))}")


def _row_layers(rows: Sequence[Sequence[Any]], n_layers: Optional[int]) -> Tuple[List[List[Any]], List[Optional[int]]]:
    """Each row's layers, and its coverage as the layers that can tell report it."""
    out, covered = [], []
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
        covered.append(_known_coverage(row_coverage(layers, 0), f"row {r}"))
        out.append(layers)
    return out, covered


def _adopt(layer: Any, want: type, coverage: Optional[int], where: str) -> Any:
    """``layer`` as a row of class ``want`` where ArraysCache and SSMCache meet
    (the module docstring's rule); any other layer unchanged, for the caller's
    checks to refuse."""
    if type(layer) is want:
        return layer
    if want is SSMCache and type(layer) is ArraysCache:
        if coverage is None:
            raise CoverageMismatch(
                f"{where}: an ArraysCache row joins SSMCache rows as an SSMCache, which needs its "
                "coverage, and no layer of the row reports one"
            )
        return SSMCache.from_arrays_cache(layer, coverage)
    if want is ArraysCache and type(layer) is SSMCache:
        if layer.in_round:
            raise RoundError(f"{where}: the SSMCache row has an open verify round; commit() or rollback() it first")
        return codec_for_layer(layer).to_mlx_lm(layer)
    return layer


def _merge(layers: List[Any]) -> Any:
    """mlx-lm's ``merge`` of one layer's rows (a CacheList's, member by
    member). An ArraysCache slot that no row holds (a model that leaves one
    unused) stays None: mlx-lm's own merge stops at it (StopIteration), or,
    when it is slot 0, takes every row for empty and drops the others; so
    the slots some row holds are merged alone."""
    cls, ref = type(layers[0]), layers[0]
    if isinstance(ref, CacheList):
        out = cls()
        out.caches = tuple(_merge([x.caches[i] for x in layers]) for i in range(len(ref.caches)))
        return out
    if not isinstance(ref, ArraysCache) or isinstance(ref, SSMCache):
        return cls.merge(layers)
    held = [e for e in range(len(ref.cache)) if any(x.cache[e] is not None for x in layers)]
    if not held or len(held) == len(ref.cache):
        return cls.merge(layers)
    parts = []
    for x in layers:
        part = ArraysCache(len(held))
        part.cache = [x.cache[e] for e in held]
        parts.append(part)
    joined = ArraysCache.merge(parts)
    out = cls(len(ref.cache))
    for j, e in enumerate(held):
        out.cache[e] = joined.cache[j]
    return out


def merge_rows(batch_cache: Optional[Sequence[Any]], rows: Sequence[Sequence[Any]]) -> List[Any]:
    """Join serial rows (e.g. caches from ``store.get``) to a batch.

    With ``batch_cache=None`` the rows become a new batch (what mlx-lm's
    ``BatchGenerator`` does with ``insert(..., caches=...)``); otherwise each
    batch layer is extended in place with the rows, appended after its
    existing rows in order, and the same list is returned. Layers are joined
    through mlx-lm's own ``merge``/``extend``, so the batch stays a normal
    mlx-lm batch. Call between forward calls.

    ArraysCache and SSMCache rows meet by the rule of the module docstring:
    the batch layer's class wins (an SSMCache one in a new batch), through
    conversions that share the slot arrays, so the joined state is bit-exact.

    Every layer is checked before any is extended, and an extend mlx-lm
    refuses on a later layer puts back the layers before it: a refusal
    leaves the batch as it was.

    Raises:
        InvalidInput: no rows, layer counts or classes that do not match, a
            row that holds more than one row, KV shapes or recurrent slots
            that disagree, a batch layer that cannot take rows (no
            ``extend``), or a join mlx-lm refuses.
        CoverageMismatch: a row's layers disagree on its coverage, or an
            ArraysCache row that must become an SSMCache has no layer that
            reports its coverage.
        RoundError: an SSMCache row that must become an ArraysCache has an
            open verify round.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
        raise InvalidInput("merge_rows needs a non-empty list of serial caches")
    batch = None if batch_cache is None else _layers(batch_cache)
    row_layers, covered = _row_layers(rows, None if batch is None else len(batch))
    n_layers = len(row_layers[0])
    for li in range(n_layers):
        where = f"layer {li}"
        if batch is not None:
            want: Optional[type] = rows_for_layer(batch[li], where).serial
        else:
            classes = {type(r[li]) for r in row_layers}
            want = SSMCache if classes == {SSMCache, ArraysCache} else None
        if want is not None:
            for r, row_layer in enumerate(row_layers):
                row_layer[li] = _adopt(row_layer[li], want, covered[r], f"{where} (row {r})")
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
            _check_extendable(layer, f"layer {li}")
    merged = []
    for li in range(n_layers):
        try:
            merged.append(_merge([r[li] for r in row_layers]))
        except ValueError as err:  # mlx-lm's own refusal (windows of other sizes, say)
            raise InvalidInput(f"layer {li}: these rows cannot be merged into one batch: {err}") from err
    if batch is None:
        return merged
    _extend_all(batch, merged)
    return batch_cache if isinstance(batch_cache, list) else batch


def _check_extendable(layer: Any, where: str) -> None:
    """Refuse a batch layer that cannot take rows now: caught between
    ``prepare()`` and ``finalize()``, or made of mlx-lm's serial classes run
    with B > 1, which have no ``extend``."""
    rows = rows_for_layer(layer, where)
    rows.check_settled(layer, where)
    for part in rows.parts(layer):
        if not callable(getattr(part, "extend", None)):
            raise InvalidInput(
                f"{where}: a {_name(part)} holding the rows of a plain batched forward cannot take more "
                "rows; make a new batch of all the rows with merge_rows(None, rows)"
            )


def _extend_all(batch: Sequence[Any], merged: Sequence[Any]) -> None:
    """Extend every batch layer with its merged rows, or none: when mlx-lm
    refuses a later layer, the layers already extended get back their
    attributes (see ``Rows.parts``).

    Raises:
        InvalidInput: mlx-lm's extend refused a layer (its ValueError).
    """
    saved = [(part, dict(vars(part))) for li, layer in enumerate(batch)
             for part in rows_for_layer(layer, f"layer {li}").parts(layer)]
    li = 0
    try:
        for li, (layer, new) in enumerate(zip(batch, merged)):
            layer.extend(new)
    except BaseException as err:
        for part, attrs in saved:
            vars(part).clear()
            vars(part).update(attrs)
        if isinstance(err, ValueError):
            raise InvalidInput(f"layer {li}: these rows cannot join the batch: {err}; no layer was changed") from err
        raise
