"""SSMCache: the recurrent cache of gated-DeltaNet layers (Qwen3-Next, Qwen3.5).

Slot 0 holds the causal-conv state ``[B, K-1, conv_dim]``, slot 1 the
recurrent state ``[B, Hv, Dv, Dk]`` (float32). The class is a drop-in for
mlx-lm's ``ArraysCache(size=2)``: mlx-lm's models, ``generate``,
``stream_generate`` and ``BatchGenerator`` run on it unchanged. On top it keeps
per-row coverage, compact row moves, and speculative verify rounds for a cache
that cannot ``trim``:

* ``begin_round()`` before a verify forward; that forward's window call
  snapshots the pre-round slots (by reference: MLX arrays are immutable) and
  records its position-local inputs;
* ``commit()`` on full accept, or ``rollback(keep)`` (an int or one per row):
  the snapshot comes back and the first ``keep`` recorded positions stay
  *pending*. Rollback builds no graph;
* pending positions fold in the next time anything reads the state: a forward,
  ``state``, a slot read, a row move, or persistence. The fold replays the
  verify forward's arithmetic, so the result is bit-identical to a fresh
  forward over the accepted tokens.

Rounds need the recurrence to go through the cache (``recur_window`` /
``recur_decode``): install the adapter with :func:`adapt`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.cache import make_prompt_cache as _mlx_make_prompt_cache

from promptstore.ssm import _recur
from promptstore.ssm._adapter import adapt, is_gated_delta_layer, unadapt
from promptstore.ssm._round import RoundError, Rounds, as_list, is_int
from promptstore.errors import InvalidInput

__all__ = ["SSMCache", "SSMState", "RoundError", "make_prompt_cache", "adapt", "unadapt"]

class SSMCache(Rounds):
    """Recurrent cache of one gated-DeltaNet layer, serial (B=1) or batched.

    Args:
        left_padding: per-row left padding of a batch (as for ArraysCache);
            None for a serial cache.
    """

    storage_kind = "ssm.gated_delta"

    def __init__(self, left_padding: Optional[List[int]] = None):
        padding = as_list(left_padding) or None  # InvalidInput: not ints
        self._slots: List[Optional[mx.array]] = [None, None]
        self._offsets: List[int] = [0] * (len(padding) if padding else 1)
        self._left_padding: Optional[List[int]] = padding
        self._lengths: Optional[List[int]] = None
        self._round = None
        self._pending = None

    # -- coverage --------------------------------------------------------------

    @property
    def batch_size(self) -> int:  # type: ignore[override]  # Rounds declares `batch_size: int` only for its own reads; here it is derived, read-only
        """Number of rows."""
        return len(self._offsets)

    @property
    def offset(self) -> int:
        """Tokens absorbed by a serial cache.

        Raises:
            InvalidInput: the cache holds more than one row (use ``row_offset``).
        """
        if len(self._offsets) != 1:
            raise InvalidInput(
                f"SSMCache.offset is defined on a serial cache; this one holds "
                f"{len(self._offsets)} rows: use row_offset(i)"
            )
        return self._offsets[0]

    @property
    def offsets(self) -> List[int]:
        """Tokens absorbed by each row."""
        return list(self._offsets)

    def row_offset(self, i: int) -> int:
        """Tokens absorbed by row ``i``.

        Raises:
            InvalidInput: no row ``i``.
        """
        if not is_int(i) or not -len(self._offsets) <= i < len(self._offsets):
            raise InvalidInput(f"row {i!r} out of range for a batch of {len(self._offsets)}")
        return self._offsets[int(i)]

    def bytes_per_token(self) -> int:
        """0: the recurrent state does not grow with the sequence."""
        return 0

    # -- ArraysCache protocol --------------------------------------------------

    def __getitem__(self, idx: int) -> Optional[mx.array]:
        self._fold()
        return self._slots[idx]

    def __setitem__(self, idx: int, value: Optional[mx.array]) -> None:
        if self._round is not None:
            raise RoundError(
                "a slot of an SSMCache was written during an open round, so the round "
                "cannot be recorded: install the adapter with promptstore.ssm.adapt(model)"
            )
        self._fold()
        self._slots[idx] = value

    @property
    def cache(self) -> List[Optional[mx.array]]:
        """The two slots (folded), as ArraysCache exposes them."""
        self._fold()
        return list(self._slots)

    @property
    def lengths(self) -> Optional[mx.array]:
        return None if self._lengths is None else mx.array(self._lengths)

    @lengths.setter
    def lengths(self, value) -> None:
        self._lengths = as_list(value)

    @property
    def left_padding(self) -> Optional[mx.array]:
        return None if self._left_padding is None else mx.array(self._left_padding)

    @left_padding.setter
    def left_padding(self, value) -> None:
        self._left_padding = as_list(value)

    @property
    def state(self) -> "SSMState":
        """``(slots, left_padding, lengths)`` as ArraysCache, carrying the per-row
        coverage as ``.offsets``; folds pending rows first.

        It is a 3-tuple, so mlx-lm's ``ArraysCache.from_state`` and
        ``save_prompt_cache`` take it as they take an ArraysCache's state.
        """
        return SSMState((self.cache, self.left_padding, self.lengths), offsets=list(self._offsets))

    @state.setter
    def state(self, v) -> None:
        """Replace the slots. Coverage comes from ``v.offsets`` when ``v`` is an
        SSMCache's state; a plain ArraysCache state carries none, so the offsets
        are kept when the row count is unchanged, else reset to 0.

        Raises:
            RoundError: a speculative round is open (setting the slots would
                drop it silently).
            InvalidInput: not three fields, or offsets that disagree with the rows.
        """
        self._check_no_round("setting SSMCache.state")
        try:
            slots, left_padding, lengths = v
        except (TypeError, ValueError) as err:
            raise InvalidInput(
                f"SSMCache.state takes (slots, left_padding, lengths), got {type(v).__name__}"
            ) from err
        slots = list(slots)
        if len(slots) != 2:
            raise InvalidInput(f"SSMCache.state takes two slots (conv, recurrent state), got {len(slots)}")
        if any(s is not None and not isinstance(s, mx.array) for s in slots):
            raise InvalidInput(f"SSMCache.state: slots must be mx.array or None, not {[type(s).__name__ for s in slots]}")
        if (slots[0] is None) != (slots[1] is None):
            raise InvalidInput("SSMCache.state: the conv and recurrent-state slots are set together or not at all")
        rows = {s.shape[0] if s.ndim else 0 for s in slots if s is not None}
        if len(rows) > 1:  # a row past one slot's end would be read out of bounds (mx.take does not check)
            raise InvalidInput(f"SSMCache.state: the slots hold different numbers of rows ({sorted(rows)})")
        b = next(iter(rows), None)
        offsets = getattr(v, "offsets", None)
        if offsets is not None:
            offsets = list(offsets)
            if not offsets or not all(is_int(o) and o >= 0 for o in offsets) or (b is not None and b != len(offsets)):
                raise InvalidInput(f"SSMCache.state: offsets {offsets!r} do not fit slots of {b} rows")
        elif b is not None and b != len(self._offsets):
            offsets = [0] * b
        self._pending = None
        self._slots = slots
        self._left_padding = as_list(left_padding)
        self._lengths = as_list(lengths)
        if offsets is not None:
            self._offsets = [int(o) for o in offsets]

    @classmethod
    def from_parts(
        cls,
        conv: Optional[mx.array],
        state: Optional[mx.array],
        offsets: Sequence[int],
        *,
        left_padding: Optional[List[int]] = None,
        lengths: Optional[List[int]] = None,
    ) -> "SSMCache":
        """A cache from its slots and per-row coverage (what a codec restores).

        Raises:
            InvalidInput: offsets are not non-negative ints, the slots disagree
                with the number of rows, or only one slot is given.
        """
        offsets = list(offsets)
        if not offsets or not all(is_int(o) and o >= 0 for o in offsets):
            raise InvalidInput(f"SSMCache.from_parts: malformed offsets {offsets!r}")
        if (conv is None) != (state is None):
            raise InvalidInput("SSMCache.from_parts: conv and recurrent state go together")
        for s in (conv, state):
            if s is not None and (not isinstance(s, mx.array) or s.ndim < 2):
                raise InvalidInput(f"SSMCache.from_parts: a slot must be an mx.array of rows, not {type(s).__name__}")
            if s is not None and s.shape[0] != len(offsets):
                raise InvalidInput(
                    f"SSMCache.from_parts: a slot holds {s.shape[0]} rows, offsets {len(offsets)}"
                )
        cache = cls()
        cache._slots = [conv, state]
        cache._offsets = [int(o) for o in offsets]
        cache._left_padding = as_list(left_padding)
        cache._lengths = as_list(lengths)
        return cache

    @classmethod
    def from_state(cls, state) -> "SSMCache":
        """The cache whose ``state`` is ``state``; the coverage comes with an
        SSMCache's state (a plain ArraysCache state has none: use
        :meth:`from_arrays_cache` and give it)."""
        obj = cls()
        obj.state = state
        return obj

    @classmethod
    def from_arrays_cache(cls, layer: ArraysCache, offsets: Union[int, Sequence[int]]) -> "SSMCache":
        """mlx-lm's ``ArraysCache(2)`` of a gated-DeltaNet layer as an SSMCache
        covering ``offsets`` tokens (one int for every row, or one per row).
        The slot arrays are shared, not copied.

        Raises:
            InvalidInput: not an ArraysCache of two slots, only one slot
                filled, empty slots with a coverage above 0, a batch caught
                between prepare() and finalize(), or offsets that do not fit
                its rows.
        """
        if type(layer) is not ArraysCache or len(layer.cache) != 2:
            raise InvalidInput(
                f"SSMCache.from_arrays_cache takes mlx-lm's ArraysCache of two slots, got {layer!r}"
            )
        if layer.lengths is not None:
            raise InvalidInput("SSMCache.from_arrays_cache: the batch is between prepare() and finalize()")
        conv, state = layer.cache
        rows = int(layer.batch_size)
        if not is_int(offsets) and (isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence)):
            raise InvalidInput(f"SSMCache.from_arrays_cache: offsets must be an int or a list of ints, not {offsets!r}")
        offs = [offsets] * rows if is_int(offsets) else list(cast(Sequence[int], offsets))
        if conv is None and any(o != 0 for o in offs if is_int(o)):
            raise InvalidInput(
                f"SSMCache.from_arrays_cache: an empty ArraysCache cannot cover {offs} tokens"
            )
        return cls.from_parts(conv, state, offs, left_padding=as_list(layer.left_padding))

    def is_trimmable(self) -> bool:
        """False: a recurrent state cannot drop tokens; use rounds instead."""
        return False

    def size(self) -> int:
        return 0

    def empty(self) -> bool:
        """True before the first forward."""
        self._fold()
        return self._slots[0] is None

    @property
    def nbytes(self) -> int:
        """Bytes of the two slots."""
        self._fold()
        return sum(s.nbytes for s in self._slots if s is not None)

    def prepare(self, lengths=None, **kwargs) -> None:
        """Set per-row real lengths of the coming right-padded prefill."""
        self._lengths = as_list(lengths)

    def finalize(self) -> None:
        self._lengths = None
        self._left_padding = None

    def advance(self, N: int) -> None:
        """Account ``N`` window positions: each row's offset grows by its real count."""
        self._offsets = [o + n for o, n in zip(self._offsets, self._real_counts(N))]
        if self._lengths is not None:
            self._lengths = [x - N for x in self._lengths]
        if self._left_padding is not None:
            self._left_padding = [x - N for x in self._left_padding]

    def make_mask(self, N: int) -> Optional[mx.array]:
        pos = mx.arange(N)
        mask = None
        left_padding = self.left_padding
        if left_padding is not None:
            mask = pos >= left_padding[:, None]
        lengths = self.lengths
        if lengths is not None:
            in_length = pos < lengths[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask

    def _real_counts(self, N: int) -> List[int]:
        lp = self._left_padding or [0] * len(self._offsets)
        ln = self._lengths or [N] * len(self._offsets)
        return [max(0, min(N, n) - max(0, p)) for p, n in zip(lp, ln)]

    # -- row moves ---------------------------------------------------------------

    def filter(self, batch_indices) -> None:
        """Keep only the rows ``batch_indices``, in place."""
        self._check_no_round("filter")
        B = self.batch_size
        try:
            rows = as_list(batch_indices)
        except (TypeError, ValueError):
            rows = None
        if rows is None or not all(is_int(i) and -B <= i < B for i in rows):
            raise InvalidInput(f"SSMCache.filter: rows {batch_indices!r} out of range for a batch of {B}")
        rows = [i % B for i in rows]
        self._fold()
        idx = mx.array(rows, dtype=mx.int32)
        self._slots = [None if s is None else mx.take(s, idx, axis=0) for s in self._slots]
        self._offsets = [self._offsets[i] for i in rows]
        if self._left_padding is not None:
            self._left_padding = [self._left_padding[i] for i in rows]
        if self._lengths is not None:
            self._lengths = [self._lengths[i] for i in rows]

    def extend(self, other: "SSMCache") -> None:
        """Append ``other``'s rows, in place."""
        if not isinstance(other, SSMCache):
            raise InvalidInput(f"SSMCache.extend: cannot append a {type(other).__name__}")
        self._check_no_round("extend")
        other._check_no_round("extend")
        self._fold()
        other._fold()
        a, b = self.batch_size, other.batch_size
        self._slots = [_cat_rows([x, y], [a, b]) for x, y in zip(self._slots, other._slots)]
        self._left_padding = _cat_meta(self._left_padding, other._left_padding, a, b, 0)
        # A row with no length limit reads every position of the window.
        self._lengths = _cat_meta(self._lengths, other._lengths, a, b, 1 << 30)
        self._offsets = self._offsets + other._offsets

    def extract(self, idx: int) -> "SSMCache":
        """Row ``idx`` as a fresh serial cache with compact storage.

        Holding the result keeps none of this batch's arrays alive.
        """
        self._check_no_round("extract")
        self._fold()
        offset = self.row_offset(idx)
        rows = mx.array([int(idx) % self.batch_size], dtype=mx.int32)
        cache = SSMCache()
        cache._slots = [None if s is None else mx.take(s, rows, axis=0) for s in self._slots]
        # Evaluated here: an unevaluated take would keep the whole batch alive.
        mx.eval([s for s in cache._slots if s is not None])
        cache._offsets = [offset]
        return cache

    @classmethod
    def merge(cls, caches, *more) -> "SSMCache":
        """Join the rows of several caches into one batch, in order.

        Accepts mlx-lm's form ``merge([c0, c1, ...])`` and the pair form
        ``merge(prev, solo)`` (``prev`` may be None or hold no rows). The result
        owns fresh arrays, or takes the arrays of the only cache with rows when
        there is nothing to concatenate.
        """
        given: List[Any] = [caches] if isinstance(caches, SSMCache) or caches is None else list(caches)
        parts: List[SSMCache] = []
        for c in [c for c in given + list(more) if c is not None]:
            if not isinstance(c, SSMCache):
                raise InvalidInput(f"SSMCache.merge: cannot merge a {type(c).__name__}")
            c._check_no_round("merge")
            c._fold()
            parts.append(c)
        parts = [c for c in parts if c.batch_size > 0]
        if not parts:
            raise InvalidInput("SSMCache.merge: nothing to merge")
        if all(c.empty() for c in parts):
            rows = sum(c.batch_size for c in parts)
            cache = cls(left_padding=[0] * rows)
            cache._offsets = [o for c in parts for o in c._offsets]
            return cache
        cache = cls()
        if len(parts) == 1:
            cache._slots = list(parts[0]._slots)
        else:
            sizes = [c.batch_size for c in parts]
            cache._slots = [_cat_rows([c._slots[e] for c in parts], sizes) for e in range(2)]
        cache._offsets = [o for c in parts for o in c._offsets]
        return cache

    # -- phase-named recurrence ----------------------------------------------------

    def recur_decode(self, layer: Any, qkv: mx.array, a: mx.array, b: mx.array, mask=None) -> mx.array:
        """One new position per row: conv step and gated delta rule.

        Args:
            layer: the gated-DeltaNet block (its conv1d, A_log, dt_bias and head sizes).
            qkv: the pre-conv q/k/v projection ``[B, 1, conv_dim]``.
            a, b: the gate projections ``[B, 1, Hv]``.
            mask: the model's SSM mask ``[B, 1]`` or None.

        Returns:
            The recurrence output ``[B, 1, Hv, Dv]``.

        Raises:
            InvalidInput: more than one position was given.
            RoundError: the open round already holds a verify window.
        """
        if qkv.shape[1] != 1:
            raise InvalidInput(f"recur_decode takes one position per row, got {qkv.shape[1]}")
        return self._recur(layer, qkv, a, b, mask, window=False)

    def recur_window(self, layer: Any, qkv: mx.array, a: mx.array, b: mx.array, mask=None) -> mx.array:
        """S positions per row: a prefill chunk or tail, or a verify window.

        With prefill padding prepared, padded positions change neither slot,
        each row's conv tail ends at its last real position and each row's
        offset grows by its real count. Inside a round, the pre-round slots are
        snapshotted and the window's position-local inputs recorded.

        Returns:
            The recurrence output ``[B, S, Hv, Dv]``.

        Raises:
            RoundError: a second recorded call in one round that holds a window,
                or padding prepared during a round.
        """
        return self._recur(layer, qkv, a, b, mask, window=True)

    def _recur(self, layer, qkv, a, b, mask, window: bool) -> mx.array:
        self._fold()
        rnd = self._round
        if rnd is not None:
            self._open_call(rnd, layer, window)
        S = qkv.shape[1]
        qkv, conv, conv_out = _recur.conv_step(layer, self._slots[0], qkv, mask, self.lengths)
        q, k, v, g, beta = _recur.heads(layer, conv_out, a, b)
        use_kernel = not layer.training
        y, state = _recur.recurrence(q, k, v, g, beta, self._slots[1], mask, use_kernel)
        self._slots = [conv, state]
        if rnd is not None:
            rnd.chunks.append(_recur.Chunk(qkv, q, k, v, g, beta, mask))
            rnd.use_kernel = use_kernel
        self.advance(S)
        return y

    # -- speculative rounds ------------------------------------------------------
    def __repr__(self) -> str:
        return f"SSMCache(rows={self.batch_size}, offsets={self._offsets}, in_round={self.in_round})"


class SSMState(tuple):
    """An SSMCache's ``state``: ArraysCache's ``(slots, left_padding, lengths)``
    plus the per-row coverage as ``offsets`` (None: unknown, as in a state
    that mlx-lm's own classes produce). mlx-lm's tree utilities rebuild it
    with the coverage dropped, which a state setter then treats as unknown."""

    offsets: Optional[List[int]]

    def __new__(cls, fields: Any = (), offsets: Optional[List[int]] = None) -> "SSMState":
        obj = super().__new__(cls, fields)
        obj.offsets = offsets
        return obj


# mlx-lm's save_prompt_cache names each layer by ``type(layer).__name__`` and
# load_prompt_cache resolves that name in mlx-lm's own cache module: an
# SSMCache is written as the ArraysCache(2) it mirrors (its state is that
# class's 3-tuple), so any mlx-lm reads the file back, as ArraysCache. The
# qualified name (repr, pickling, promptstore's error messages) stays SSMCache.
SSMCache.__name__ = "ArraysCache"


def make_prompt_cache(model: Any, max_kv_size: Optional[int] = None) -> List[Any]:
    """mlx-lm's prompt cache for ``model``, with SSMCache in its gated-DeltaNet layers.

    Every other layer keeps mlx-lm's own cache class. The model is not modified;
    call :func:`adapt` to route the recurrence through the caches (needed for
    speculative rounds).
    """
    cache = _mlx_make_prompt_cache(model, max_kv_size=max_kv_size)
    layers = list(getattr(model, "layers", []))
    if len(layers) != len(cache):
        return cache
    return [
        SSMCache() if type(c) is ArraysCache and is_gated_delta_layer(layer) else c
        for c, layer in zip(cache, layers)
    ]


def _cat_rows(xs: List[Optional[mx.array]], sizes: List[int]) -> Optional[mx.array]:
    """Concatenate row blocks; an absent block reads as zeros (a fresh state).

    Raises:
        InvalidInput: blocks of other shapes past the rows, or other dtypes
            (mlx would raise its own error, or promote the whole batch).
    """
    ref = next((x for x in xs if x is not None), None)
    if ref is None:
        return None
    for x in xs:
        if x is not None and (x.shape[1:] != ref.shape[1:] or x.dtype != ref.dtype):
            raise InvalidInput(
                f"SSMCache: rows of slot shape {tuple(x.shape[1:])} {x.dtype} cannot join rows of "
                f"{tuple(ref.shape[1:])} {ref.dtype} (another model's, or another dtype)"
            )
    full = [mx.zeros((n,) + ref.shape[1:], ref.dtype) if x is None else x for x, n in zip(xs, sizes)]
    return mx.concatenate(full, axis=0)


def _cat_meta(a, b, na: int, nb: int, fill: int):
    if a is None and b is None:
        return None
    return (a if a is not None else [fill] * na) + (b if b is not None else [fill] * nb)
