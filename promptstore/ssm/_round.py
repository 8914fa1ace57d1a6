"""Speculative verify rounds of SSMCache: snapshot, record, rollback, lazy fold.

A mixin over the cache's slots and per-row bookkeeping (``_slots``,
``_offsets``, ``_left_padding``, ``_lengths``); ``promptstore.ssm`` documents
the protocol.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, TypeGuard, Union, cast

import mlx.core as mx
import numpy as np

from promptstore.ssm import _recur as _recur
from promptstore.errors import InvalidInput, RoundError


Keep = Union[int, Sequence[int]]


@dataclass
class _Round:
    """An open round: the pre-round snapshot (taken at the first call) and the record."""

    started: bool = False
    window: bool = False
    slots: List[Optional[mx.array]] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    left_padding: Optional[List[int]] = None
    chunks: List[_recur.Chunk] = field(default_factory=list)
    n_keep: int = 0
    use_kernel: bool = True

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class _Pending:
    """Recorded positions left to fold into the restored snapshot."""

    chunks: List[_recur.Chunk]
    keeps: List[int]
    n_keep: int
    use_kernel: bool


class Rounds:
    """The round API of SSMCache (``begin_round``, ``commit``, ``rollback``)."""

    _slots: List[Optional[mx.array]]
    _offsets: List[int]
    _left_padding: Optional[List[int]]
    _lengths: Optional[List[int]]
    _round: Optional[_Round]
    _pending: Optional[_Pending]

    batch_size: int

    @property
    def in_round(self) -> bool:
        """True between ``begin_round()`` and ``commit()``/``rollback()``."""
        return self._round is not None

    @property
    def has_pending(self) -> bool:
        """True while accepted positions of a rolled-back round wait to be folded."""
        return self._pending is not None

    def begin_round(self) -> None:
        """Open a round: the recurrence calls until ``commit``/``rollback`` are recorded.

        A round holds one verify window (``recur_window``), or successive
        single-position decodes (``recur_decode``, the draft model's side).

        Raises:
            RoundError: a round is already open.
        """
        if self._round is not None:
            raise RoundError("begin_round: a round is already open; commit() or rollback() it first")
        self._round = _Round()

    def commit(self) -> None:
        """Accept every position of the open round.

        Raises:
            RoundError: no round is open.
        """
        if self._round is None:
            raise RoundError("commit without begin_round")
        self._round = None

    def rollback(self, keep: Keep) -> None:
        """Restore the pre-round slots and leave the first ``keep`` positions pending.

        Args:
            keep: accepted positions, one int for every row or one per row, each
                in ``[0, S]`` where S is the number of recorded positions.

        Raises:
            RoundError: no round is open.
            InvalidInput: a keep is not an int, outside ``[0, S]``, or the list
                length differs from the batch size. The round stays open.
        """
        rnd = self._round
        if rnd is None:
            raise RoundError("rollback without begin_round")
        keeps = self._keeps(keep, rnd.length)
        self._round = None
        if not rnd.started or all(k == rnd.length for k in keeps):
            return  # nothing recorded, or everything accepted: the live slots stand
        self._slots = rnd.slots
        self._offsets = [o + k for o, k in zip(rnd.offsets, keeps)]
        if rnd.left_padding is not None:
            self._left_padding = [p - k for p, k in zip(rnd.left_padding, keeps)]
        if any(keeps):
            self._pending = _Pending(rnd.chunks, keeps, rnd.n_keep, rnd.use_kernel)

    def check_persistable(self) -> None:
        """Raise RoundError when a round is open (its outcome is not decided)."""
        if self._round is not None:
            raise RoundError(
                "cannot persist an SSMCache while a speculative round is open: "
                "commit() or rollback() it first"
            )

    def _keeps(self, keep: Keep, S: int) -> List[int]:
        B = self.batch_size
        if isinstance(keep, (mx.array, np.ndarray)):
            keep = keep.tolist()
        keeps = [keep] * B if is_int(keep) else keep
        if not isinstance(keeps, (list, tuple)) or len(keeps) != B:
            raise InvalidInput(f"rollback: keep must be an int or a list of {B} ints, got {keep!r}")
        for k in keeps:
            if not is_int(k) or not 0 <= k <= S:
                raise InvalidInput(
                    f"rollback: keep {k!r} is outside [0, {S}] (the round recorded {S} positions)"
                )
        return [int(k) for k in keeps]

    def _open_call(self, rnd: _Round, layer: Any, window: bool) -> None:
        if rnd.window or (window and rnd.chunks):
            raise RoundError(
                "a second recurrence call in a round that holds a verify window: "
                "commit() or rollback() before the next forward"
            )
        if self._lengths is not None or any(p > 0 for p in (self._left_padding or [])):
            raise RoundError("rounds take no prefill padding: finalize() the prefill before begin_round()")
        if not rnd.started:
            rnd.started = True
            rnd.slots = list(self._slots)
            rnd.offsets = list(self._offsets)
            rnd.left_padding = None if self._left_padding is None else list(self._left_padding)
            rnd.n_keep = layer.conv_kernel_size - 1
        rnd.window = window

    def _check_no_round(self, what: str) -> None:
        if self._round is not None:
            raise RoundError(f"{what}: a speculative round is open; commit() or rollback() it first")

    def _fold(self) -> None:
        p = self._pending
        if p is None:
            return
        self._pending = None
        conv, state = _recur.fold(self._slots[0], self._slots[1], p.chunks, p.keeps, p.n_keep, p.use_kernel)
        self._slots = [conv, state]


def is_int(x: object) -> TypeGuard[int]:
    """An integer: Python's or numpy's (``numbers.Integral``), not a bool; store ``int(x)``."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def as_list(value) -> Optional[List[int]]:
    """``value`` (None, an integer mx.array, or a sequence of ints) as a list of ints.

    Raises:
        InvalidInput: anything else (a float, a string, a bool: ``int()``
            would truncate or raise a raw error).
    """
    if value is None:
        return None
    if isinstance(value, mx.array):
        if not mx.issubdtype(value.dtype, mx.integer):
            raise InvalidInput(f"expected integers, got an array of {value.dtype}")
        return cast(List[int], value.tolist())
    if isinstance(value, (str, bytes)):
        raise InvalidInput(f"expected a list of ints, got {type(value).__name__}")
    try:
        items = list(value)
    except TypeError as err:
        raise InvalidInput(f"expected a list of ints, got {type(value).__name__}") from err
    out = []
    for x in items:
        if isinstance(x, mx.array) and x.ndim == 0 and mx.issubdtype(x.dtype, mx.integer):
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise InvalidInput(f"expected a list of ints, got {x!r} in it")
        out.append(int(x))
    return out
