"""``ssm.gated_delta``: promptstore's SSMCache (gated-DeltaNet conv + recurrent state).

Encoding folds pending rows of a rolled-back speculative round first, so the
entry holds exactly the accepted state, and refuses a cache whose round is
still open. Meta: per-row ``offsets``, whether the two slots are present, and
the batch bookkeeping (``left_padding``, ``lengths``) when set.

Capabilities: row moves (``row_offset``/``extract``), batched warm-up
(left-padded rows, per-row coverage), speculative verify rounds instead of
trim, and an mlx-lm file as ``ArraysCache(2)``.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_lm.models.cache import ArraysCache

from promptstore.codecs._registry import Codec, array, register, require
from promptstore.codecs._rows import Rows, slot_signature
from promptstore.errors import CorruptEntry, CoverageMismatch, InvalidInput, RoundError
from promptstore.ssm import SSMCache

_MAX_ROWS = 1 << 16
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


class SSMRows(Rows):
    """SSMCache keeps per-row coverage and extracts compact rows itself."""

    serial = SSMCache

    def count(self, layer):
        return int(layer.batch_size)

    def coverage(self, layer, i, where):
        return int(layer.row_offset(i))

    def extract(self, layer, i, where):
        return layer.extract(i)

    def slot_signature(self, layer):
        return slot_signature(layer)

    def check_settled(self, layer, where):
        """Refuse a batch layer in an open verify round before any layer is
        extended (``SSMCache.extend`` refuses it too, after the layers before it)."""
        try:
            layer._check_no_round("extend")
        except RoundError as err:
            raise RoundError(f"{where}: {err}") from err


class SSMCodec(Codec):
    kind = SSMCache.storage_kind
    version = 1
    types = (SSMCache,)
    rows = SSMRows()
    rounds = True
    batchable = True
    mlx_lm_class = ArraysCache

    def batch_layer(self, layer, pads):
        """Rows left-padded by ``pads``: each row's offset counts its real tokens."""
        return SSMCache(left_padding=list(pads))

    def to_mlx_lm(self, layer):
        """mlx-lm resolves a file's classes by name in its own module: written
        as the ``ArraysCache(2)`` it mirrors (pending rows folded by the slot
        reads). An open verify round is refused, as :meth:`encode` refuses it."""
        layer.check_persistable()
        if layer.batch_size != 1:
            raise InvalidInput(f"an SSMCache batch of {layer.batch_size} rows cannot be written to one mlx-lm file")
        out = ArraysCache(2)
        out.cache = [layer[0], layer[1]]
        return out

    def encode(self, layer):
        layer.check_persistable()
        conv, state = layer[0], layer[1]  # slot reads fold pending rows
        arrays = {}
        if conv is not None:
            arrays["conv"] = conv
        if state is not None:
            arrays["state"] = state
        meta = {
            "offsets": layer.offsets,
            "conv": conv is not None,
            "state": state is not None,
            "left_padding": _list(layer.left_padding),
            "lengths": _list(layer.lengths),
        }
        # What decode would refuse is refused here, before anything is
        # written: a put never replaces a stored entry by an unreadable one.
        _checked(arrays, meta, self.kind, InvalidInput)
        return arrays, meta

    def decode(self, arrays, meta, version):
        conv, state, offsets, padding = _checked(arrays, meta, self.kind, CorruptEntry)
        return SSMCache.from_parts(
            conv, state, offsets, left_padding=padding["left_padding"], lengths=padding["lengths"]
        )

    def coverage(self, layer):
        """The serial offset.

        Raises:
            CoverageMismatch: a batch has no single coverage; ``extract(i)`` a row.
        """
        if layer.batch_size != 1:
            raise CoverageMismatch(
                f"an SSMCache batch of {layer.batch_size} rows covers {layer.offsets} tokens "
                "per row, not one token list: extract(i) the row to store"
            )
        return layer.offset


def _checked(arrays, meta, kind: str, error):
    """``(conv, state, offsets, padding)`` of an entry's arrays and meta, or
    ``error`` (CorruptEntry reading, InvalidInput writing) naming what is wrong."""
    offsets = meta.get("offsets") if isinstance(meta, dict) else None
    if not isinstance(offsets, list) or not 1 <= len(offsets) <= _MAX_ROWS or not all(_nonneg_int(o) for o in offsets):
        raise error(f"kind {kind!r}: meta field 'offsets' is malformed")
    rows = len(offsets)
    has_conv = require(meta, "conv", bool, kind)
    has_state = require(meta, "state", bool, kind)
    if has_conv != has_state:
        raise error(f"kind {kind!r}: conv and recurrent state must be stored together")
    if not has_conv and any(offsets):
        raise error(f"kind {kind!r}: offsets {offsets} but no state stored")
    padding = {}
    for name in ("left_padding", "lengths"):
        value = require(meta, name, (list, type(None)), kind)
        if value is not None and (
            len(value) != rows or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise error(f"kind {kind!r}: meta field {name!r} is malformed")
        padding[name] = value
    conv = state = None
    if has_conv:
        conv = _slot(arrays, "conv", 3, rows, kind, error)
        state = _slot(arrays, "state", 4, rows, kind, error)
    return conv, state, offsets, padding


def _slot(arrays, name: str, ndim: int, rows: int, kind: str, error=CorruptEntry) -> mx.array:
    x = array(arrays, name, kind)
    if not isinstance(x, mx.array) or x.ndim != ndim or x.shape[0] != rows or x.dtype not in _FLOATS:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        raise error(
            f"kind {kind!r}: array {name!r} has shape {shape} and dtype {dtype}, "
            f"expected {ndim} dims with {rows} rows of floats"
        )
    return x


def _nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _list(x):
    return None if x is None else x.tolist()


register(SSMCodec())
