"""Row moves of one batch cache class: the capability ``promptstore.rows`` reaches
through the registry (``rows_for_layer``), one ``Rows`` per exact class, kept in
that class's codec module.

A batch layer holds B rows. ``extract`` gives row ``i`` as a serial (B=1) layer
of class ``serial`` with compact storage: left padding and unused capacity
stripped, arrays copied, so holding the row keeps none of the batch alive.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx

from promptstore.codecs._registry import rows_for_layer
from promptstore.errors import InvalidInput

Signature = Optional[Tuple[Any, ...]]


class Rows:
    """Row moves of one exact cache class. Subclasses set ``serial`` and
    implement ``count``, ``coverage`` and ``extract``."""

    #: The class of one extracted row (and of the rows a batch layer takes).
    serial: type = type(None)

    def count(self, layer: Any) -> int:
        """Number of rows ``layer`` holds."""
        raise NotImplementedError

    def coverage(self, layer: Any, i: int, where: str) -> Optional[int]:
        """Tokens row ``i`` has absorbed, or None when the layer cannot tell."""
        raise NotImplementedError

    def extract(self, layer: Any, i: int, where: str) -> Any:
        """Row ``i`` as a serial layer of class ``serial`` (arrays not yet evaluated)."""
        raise NotImplementedError

    def check_settled(self, layer: Any, where: str) -> None:
        """Refuse a batch caught between ``prepare()`` and ``finalize()``."""

    def check_join(self, batch_layer: Any, row_layer: Any, where: str) -> None:
        """Refuse a ``serial`` row that cannot join ``batch_layer`` (beyond its class)."""

    def parts(self, layer: Any) -> List[Any]:
        """The objects whose attributes an ``extend`` of batch ``layer``
        rebinds: the layer itself (a CacheList adds its inner caches'). mlx-lm's
        ``extend`` (and SSMCache's) never writes into an array, so putting back
        these objects' attributes undoes an extend that failed halfway."""
        return [layer]

    def kv_signature(self, layer: Any) -> Signature:
        """KV heads, head dims and dtype that rows must share (None: no KV arrays)."""
        return None

    def slot_signature(self, layer: Any) -> Signature:
        """Shapes and dtypes of every recurrent slot, None where a slot is
        empty, that rows must share (None: no slots)."""
        return None


def own(x: Optional[mx.array]) -> Optional[mx.array]:
    """A copy of a slice that shares no buffer with the batch (evaluated later)."""
    return None if x is None else mx.contiguous(x)


def refuse_unsettled(pending: bool, where: str) -> None:
    """Refuse a batch whose offsets still count right padding."""
    if pending:
        raise InvalidInput(
            f"{where}: the batch is between prepare() and finalize() (a right-padded window is "
            "in progress); take rows between forward calls"
        )


def kv_signature(layer: Any) -> Signature:
    """``(heads, key dim, value dim, dtype)`` of a KV layer, None while empty."""
    keys = layer.keys
    if not isinstance(keys, mx.array):
        return None
    return (keys.shape[1], keys.shape[3], layer.values.shape[3], keys.dtype)


def slot_signature(layer: Any) -> Signature:
    """Per-row shape and dtype of every slot the layer has (one slot for
    LFM2's conv state, two for Mamba or gated DeltaNet, four for Kimi
    Linear's), None for an empty slot."""
    return tuple(None if x is None else (tuple(x.shape[1:]), str(x.dtype)) for x in layer.cache)


def check_joinable(batch_layer: Any, row_layer: Any, where: str) -> None:
    """Refuse a serial ``row_layer`` that cannot join ``batch_layer``.

    Raises:
        InvalidInput: the row is not the batch's row class, or its kind's own
            check refuses it (another window size, another inner layout).
        MissingCapability: the batch layer's exact class has no row moves.
    """
    rows = rows_for_layer(batch_layer, where)
    if type(row_layer) is not rows.serial:
        raise InvalidInput(
            f"{where}: a {type(row_layer).__qualname__} row cannot join a {type(batch_layer).__qualname__} layer "
            f"(expected a {rows.serial.__qualname__})"
        )
    rows.check_join(batch_layer, row_layer, where)
