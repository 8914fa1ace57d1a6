"""Which mlx backend this process computes on."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["backend"]


def backend() -> str:
    """The mlx backend of the default device: ``cpu``, ``metal`` or ``cuda``."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"
