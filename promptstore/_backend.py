"""Which mlx backend this process computes on."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["backend", "shape_exact"]


def backend() -> str:
    """The mlx backend of the default device: ``cpu``, ``metal`` or ``cuda``."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def shape_exact() -> bool:
    """Whether this backend computes the same bits whatever the call shape:
    the CPU does; GPU kernels (Metal, CUDA) may not, so there speculative
    decoding is not promised to equal plain greedy decoding (README,
    "Fidelity contract")."""
    return backend() == "cpu"
