"""Bit-exact array comparison: what "bit-identical" means here (tests, bench).

``mx.array_equal`` compares values: -0.0 equals +0.0 and NaN never equals
NaN. Restores and folds promise the same BITS, so compare same-width
unsigned views instead (same dtype and shape required).
"""

from __future__ import annotations

import mlx.core as mx

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def bits_equal(a: mx.array, b: mx.array) -> mx.array:
    """A boolean scalar array: same dtype, same shape, same bits."""
    if not isinstance(a, mx.array) or not isinstance(b, mx.array):
        return mx.array(False)
    if a.dtype != b.dtype or a.shape != b.shape:
        return mx.array(False)
    if a.dtype == mx.bool_:
        return mx.array_equal(a, b)
    if a.dtype == mx.complex64:
        a, b = a.view(mx.uint64), b.view(mx.uint64)
    else:
        u = _UINT[a.dtype.size]
        a, b = a.view(u), b.view(u)
    return mx.array_equal(a, b)
