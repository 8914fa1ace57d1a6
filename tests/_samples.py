"""Deterministic, populated sample layers for every storage kind, and layer comparison.

``SAMPLES[kind]`` builds realistic layers (mid-stream states, padded buffers,
rotated rings, trimmed offsets). A codec registered without a sample here
fails ``test_every_kind_has_samples``: a new codec is covered by the existing
round-trip tests once it adds its builders.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from _bits import bits_equal
from promptstore.ssm import SSMCache


def det(shape, dtype=mx.bfloat16, seed: int = 0) -> mx.array:
    """Deterministic values from integer arithmetic (stable across library versions)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64) + seed * 7919
    vals = ((i * 2654435761) % 2003 - 1001).astype(np.float32) / 257.0
    return mx.array(vals.reshape(shape)).astype(dtype)


def _feed(cache, steps, heads=2, dim=64, dtype=mx.bfloat16, seed=0):
    for j, s in enumerate(steps):
        k = det((1, heads, s, dim), dtype, seed + 2 * j)
        v = det((1, heads, s, dim), dtype, seed + 2 * j + 1)
        cache.update_and_fetch(k, v)
    return cache


def kv_samples() -> List[Any]:
    trimmed = _feed(KVCache(), [20, 1, 1])
    trimmed.trim(3)
    return [
        _feed(KVCache(), [37, 5]),
        _feed(KVCache(), [256, 3], dtype=mx.float16, seed=3),
        trimmed,
        _feed(KVCache(), [9], dtype=mx.float32, heads=1, dim=32, seed=5),
    ]


def concat_samples() -> List[Any]:
    # Not trimmed: mlx-lm's ConcatenateKVCache.trim only lowers offset and keeps
    # serving the trimmed keys, so a trimmed one has no well-defined continuation.
    return [_feed(ConcatenateKVCache(), [10, 1, 1]), _feed(ConcatenateKVCache(), [33], dtype=mx.float32, seed=4)]


def chunked_samples() -> List[Any]:
    c = _feed(ChunkedKVCache(16), [10, 1])
    d = _feed(ChunkedKVCache(16), [30])
    d.maybe_trim_front()
    _feed(d, [1, 1], seed=9)
    return [c, d]


def quantized_samples() -> List[Any]:
    q = _feed(KVCache(), [40]).to_quantized(group_size=64, bits=4)
    _feed(q, [1, 1], seed=11)
    r = _feed(QuantizedKVCache(group_size=32, bits=8), [300], seed=13)
    return [q, r]


def rotating_samples() -> List[Any]:
    return [
        _feed(RotatingKVCache(max_size=16, keep=4), [10]),  # not yet full
        _feed(RotatingKVCache(max_size=16, keep=4), [10] + [1] * 13),  # rotated in place
        _feed(RotatingKVCache(max_size=16, keep=0), [30], seed=2),  # concat beyond max
        _feed(RotatingKVCache(max_size=16, keep=2), [5, 1, 1, 20, 1], seed=4),
    ]


def arrays_samples() -> List[Any]:
    a = ArraysCache(2)
    a[0] = det((1, 3, 24), mx.bfloat16, 1)
    a[1] = det((1, 2, 8, 8), mx.float32, 2)
    b = ArraysCache(2)
    b[1] = det((1, 4, 16, 16), mx.float32, 3)
    c = ArraysCache(2, left_padding=[2, 0])
    c[0] = det((2, 3, 24), mx.float16, 4)
    c[1] = det((2, 2, 8, 8), mx.float32, 5)
    return [a, b, c]


def ssm_samples() -> List[Any]:
    return [
        SSMCache.from_parts(det((1, 3, 24), mx.bfloat16, 21), det((1, 2, 8, 8), mx.float32, 22), [37]),
        SSMCache.from_parts(det((1, 3, 64), mx.float32, 23), det((1, 4, 16, 16), mx.float32, 24), [300]),
    ]


def list_samples() -> List[Any]:
    return [
        CacheList(_feed(KVCache(), [21]), _feed(RotatingKVCache(max_size=32, keep=0), [21], seed=6)),
        CacheList(_feed(KVCache(), [7], seed=8), _feed(ChunkedKVCache(64), [7], seed=10)),
    ]


SAMPLES: Dict[str, Callable[[], List[Any]]] = {
    "kv": kv_samples,
    "kv.concat": concat_samples,
    "kv.chunked": chunked_samples,
    "kv.quantized": quantized_samples,
    "kv.rotating": rotating_samples,
    "arrays": arrays_samples,
    "list": list_samples,
    "ssm.gated_delta": ssm_samples,
}


def _eq(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(bits_equal(a, b).item())


def visible_state(layer) -> Dict[str, Any]:
    """What a layer exposes to attention, independent of buffer padding."""
    out: Dict[str, Any] = {"type": type(layer)}
    if isinstance(layer, CacheList):
        out["inner"] = [visible_state(c) for c in layer.caches]
        return out
    # exact class: SSMCache is named "ArraysCache" for mlx-lm's file format
    if type(layer) is SSMCache:
        out["slots"] = [layer[0], layer[1]]
        out["offsets"] = layer.offsets
        return out
    if isinstance(layer, ArraysCache):
        out["slots"] = list(layer.cache)
        out["left_padding"] = layer.left_padding
        out["lengths"] = layer.lengths
        return out
    for attr in ("offset", "keep", "max_size", "_idx", "chunk_size", "start_position", "group_size", "bits"):
        if hasattr(layer, attr):
            out[attr] = getattr(layer, attr)
    if getattr(layer, "keys", None) is None:
        out["keys"] = None
        return out
    if isinstance(layer, RotatingKVCache):
        n = min(layer.offset, layer.keys.shape[2])
        out["keys"], out["values"] = layer.keys[..., :n, :], layer.values[..., :n, :]
    elif isinstance(layer, ChunkedKVCache):
        out["keys"], out["values"] = layer.keys_and_values()
    elif isinstance(layer, QuantizedKVCache):
        out["keys"] = [x[..., : layer.offset, :] for x in layer.keys]
        out["values"] = [x[..., : layer.offset, :] for x in layer.values]
    else:
        out["keys"], out["values"] = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
    return out


def assert_same(a, b, path="layer") -> None:
    """Bit-exact comparison of two visible states (== on every array and scalar)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: fields differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, mx.array) or isinstance(b, mx.array):
        assert _eq(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def continue_both(a, b) -> None:
    """Feed the same new step to two layers and require identical outputs."""
    if isinstance(a, ArraysCache) or type(a) is SSMCache:
        return
    if isinstance(a, CacheList):
        for x, y in zip(a.caches, b.caches):
            continue_both(x, y)
        return
    if getattr(a, "keys", None) is None:
        return
    quantized = isinstance(a.keys, (tuple, list))
    keys = a.keys[0] if quantized else a.keys
    heads = keys.shape[1]
    dim = keys.shape[3] * 32 // a.bits if isinstance(a, QuantizedKVCache) else keys.shape[3]
    dtype = a.keys[1].dtype if quantized else keys.dtype
    for step in (1, 3):
        k = det((1, heads, step, dim), dtype, 99 + step)
        v = det((1, heads, step, dim), dtype, 199 + step)
        out_a = a.update_and_fetch(k, v)
        out_b = b.update_and_fetch(k, v)
        assert_same(list(out_a), list(out_b), f"{type(a).__name__} continued")
