"""Verify rounds of a sliding window (mlx-lm's RotatingKVCache): trim with bypass.

A RotatingKVCache can ``trim`` only until it wraps: past that, mlx-lm's trim
moves ``_idx`` back but leaves the rejected keys in the ring, where the next
single-token forward attends to them. In a speculative round the rejected
positions are removed for real instead:

* a verify window (one forward of S > 1 tokens, mlx-lm's ``_update_concat``)
  leaves the ring in temporal order with the window's S positions last
  (``_idx`` == buffer length). What it trimmed before appending depends only
  on the pre-round buffer, so dropping the last ``S - keep`` positions
  physically leaves exactly what a concat of the ``keep`` accepted positions
  alone would have left;
* single-position decodes (the draft's side, ``_update_in_place``) overwrite
  ring slots. :func:`WindowRound.record` notes the slot each decode wrote;
  a rollback reads the ``keep`` accepted keys and values from those slots,
  restores the pre-round buffer and replays ``_update_in_place`` for them:
  the same function on the same inputs, hence the same buffer, ``offset``
  and ``_idx`` as decoding them alone. Slots stay put within a round (the
  ring only trims, moving slots, at the first decode after a window, before
  its slot is noted; it grows at its end), so the slots hold the decodes'
  values at the end of the round, provided no slot is written twice: the
  round must be shorter than the ring (:func:`check_window`).

Cost: the pre-round buffer is kept, so the first write of a round copies the
ring once (mlx cannot write in place into a buffer still referenced); a
rollback replays at most the round's length of single-slot writes.

The pre-round buffer survives the round because :class:`WindowRound` hands
the layer new array objects (``a[...]``: same values, no copy until written)
and keeps the old ones: mlx's in-place slice assignment rebinds the object it
is applied to, never another object that shared its values.

Which layers take these rounds is a capability of their codec
(``window_rounds``), like every other per-kind capability.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from promptstore.codecs import codec_for_layer
from promptstore.errors import InvalidInput, RoundError

__all__ = ["WindowRound", "check_window", "runs_window_rounds"]

def runs_window_rounds(layer: Any) -> bool:
    """Whether ``layer``'s codec declares :class:`WindowRound` rounds (``window_rounds``)."""
    return codec_for_layer(layer).window_rounds


def check_window(layer: Any, decodes: int, where: str) -> None:
    """Refuse a ring too small for rounds of ``decodes`` single-position forwards.

    Raises:
        InvalidInput: ``decodes`` exceeds the ring's rotating slots (``max_size - keep``).
    """
    slots = int(layer.max_size) - int(layer.keep)
    if decodes > slots:
        raise InvalidInput(
            f"speculative decoding: {where} is a sliding window of {slots} rotating positions, fewer than "
            f"the {decodes} draft decodes of a round, which would overwrite their own slots: "
            f"use at most {slots + 1} draft tokens"
        )


class WindowRound:
    """One speculative round of one RotatingKVCache (serial, B=1).

    Opened before the round's first forward; the layer is then used as usual
    by the model, with :meth:`record` after each single-position forward, and
    :meth:`resolve` once the accepted count is known.

    Raises:
        InvalidInput: the layer is not an mlx-lm RotatingKVCache.
    """

    def __init__(self, layer: Any) -> None:
        if type(layer) is not RotatingKVCache:
            raise InvalidInput(f"a window round takes an mlx-lm RotatingKVCache, not a {type(layer).__name__}")
        self._layer = layer
        self._keys: Optional[mx.array] = layer.keys
        self._values: Optional[mx.array] = layer.values
        self._offset = int(layer.offset)
        self._idx = int(layer._idx)
        self._slots: List[int] = []  # the slot each recorded decode wrote
        if layer.keys is not None:  # in-place writes must not reach the snapshot
            layer.keys, layer.values = layer.keys[...], layer.values[...]

    def record(self) -> None:
        """Note the slot the last single-position forward wrote.

        Raises:
            RoundError: the layer did not advance by exactly one position since
                the round opened or the last record, or it wrote a slot the
                round had written already (a ring shorter than the round).
        """
        layer = self._layer
        if int(layer.offset) != self._offset + len(self._slots) + 1 or layer.keys is None:
            raise RoundError(
                f"a window round recorded a decode, but the RotatingKVCache went from offset "
                f"{self._offset + len(self._slots)} to {layer.offset}: record after every "
                "single-position forward of the round, and only then"
            )
        i = int(layer._idx) - 1  # _update_in_place wrote at _idx, then advanced it by one
        if i in self._slots:
            raise RoundError(f"a window round wrote ring slot {i} twice: the round is longer than the ring "
                             f"({layer.max_size - layer.keep} rotating positions)")
        self._slots.append(i)

    def resolve(self, recorded: int, keep: int) -> None:
        """Keep the first ``keep`` of the round's ``recorded`` positions.

        Raises:
            InvalidInput: ``keep`` is outside ``[0, recorded]``.
            RoundError: the layer did not advance by ``recorded`` positions in
                one window or in recorded decodes.
        """
        layer = self._layer
        if not 0 <= keep <= recorded:
            raise InvalidInput(f"a window round keeps 0 to {recorded} positions, not {keep}")
        if int(layer.offset) != self._offset + recorded:
            raise RoundError(f"a window round of {recorded} positions saw the RotatingKVCache go from "
                             f"offset {self._offset} to {layer.offset}")
        if keep == recorded:
            return
        if self._slots:
            if len(self._slots) != recorded:
                raise RoundError(f"a window round recorded {len(self._slots)} decodes of {recorded} positions")
            kept = [(layer.keys[..., i : i + 1, :], layer.values[..., i : i + 1, :]) for i in self._slots[:keep]]
            self._restore()
            for k, v in kept:
                layer._update_in_place(k, v)
            return
        if recorded < 2 or layer.keys is None or int(layer._idx) != layer.keys.shape[2]:
            raise RoundError(f"a window round of {recorded} positions with no recorded decode was not one "
                             "verify window (record() after each single-position forward)")
        if keep == 0:
            self._restore()
            return
        end = layer.keys.shape[2] - (recorded - keep)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        layer.offset = self._offset + keep
        layer._idx = end

    def _restore(self) -> None:
        layer = self._layer
        layer.keys, layer.values, layer.offset, layer._idx = self._keys, self._values, self._offset, self._idx
