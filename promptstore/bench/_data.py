"""Synthetic data for ``promptstore bench``: caches of real shapes and dtypes.

The bench cache is shaped like Qwen3-Next-80B: gated-DeltaNet layers whose
cache is mlx-lm's ``ArraysCache(size=2)`` (conv state ``[1, 3, 8192]`` bf16,
recurrent state ``[1, 32, 128, 128]`` f32) and full-attention layers as
``KVCache`` (2 KV heads of 256 dims, bf16), one attention layer every fourth
layer as in the real model. Values are random; only shapes and dtypes matter.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, List, Sequence, Tuple, Union, cast

import mlx.core as mx
import numpy as np

from promptstore.ssm import SSMCache


@dataclass(frozen=True)
class Shape:
    """Layer counts and dimensions of a hybrid cache."""

    ssm_layers: int = 36
    attn_layers: int = 12
    conv: Tuple[int, ...] = (1, 3, 8192)
    state: Tuple[int, ...] = (1, 32, 128, 128)
    kv_heads: int = 2
    head_dim: int = 256

    @property
    def layers(self) -> int:
        return self.ssm_layers + self.attn_layers

    def is_attention(self, i: int) -> bool:
        """Qwen3-Next puts full attention on every fourth layer."""
        every = max(1, self.layers // max(1, self.attn_layers))
        return i % every == every - 1 and (i // every) < self.attn_layers

    def nbytes(self, n_tokens: int) -> int:
        ssm = math_prod(self.conv) * 2 + math_prod(self.state) * 4
        kv = 2 * self.kv_heads * n_tokens * self.head_dim * 2
        return self.ssm_layers * ssm + self.attn_layers * kv


QWEN3_NEXT_80B = Shape()
QUICK = Shape(ssm_layers=3, attn_layers=1)


def math_prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _random(shape: Sequence[int], dtype, key) -> mx.array:
    return mx.random.normal(shape, key=key).astype(dtype)


def hybrid_cache(shape: Shape, n_tokens: int, seed: int = 0) -> List:
    """A full prompt cache of ``n_tokens`` tokens, evaluated.

    KV buffers hold exactly ``n_tokens`` positions (``n_tokens`` a multiple of
    mlx-lm's 256-step, so this is the buffer mlx-lm itself would have).
    """
    from mlx_lm.models.cache import ArraysCache, KVCache

    key = mx.random.key(seed)
    cache = []
    layer: Union[KVCache, ArraysCache]
    for i in range(shape.layers):
        key, k1, k2 = mx.random.split(key, 3)
        if shape.is_attention(i):
            layer = KVCache()
            kv = (1, shape.kv_heads, n_tokens, shape.head_dim)
            layer.keys = _random(kv, mx.bfloat16, k1)
            layer.values = _random(kv, mx.bfloat16, k2)
            layer.offset = n_tokens
        else:
            layer = ArraysCache(size=2)
            layer[0] = _random(shape.conv, mx.bfloat16, k1)
            layer[1] = _random(shape.state, mx.float32, k2)
        cache.append(layer)
        mx.eval(_layer_arrays(layer))
    return cache


def vary(cache: Sequence, r: int) -> List:
    """``cache`` with one value of every 64 tokens of its KV layers changed
    (by ``r``), the rest shared: stored blocks no longer match, so a put of
    it writes all its bytes, as a put of a new prompt would."""
    from mlx_lm.models.cache import KVCache

    out: List[Any] = []
    for layer in cache:
        if type(layer) is not KVCache or layer.keys is None:
            out.append(layer)
            continue
        n, width = layer.keys.shape[-2:]
        mark = np.zeros((n, width), dtype=np.float32)
        mark[::64, 0] = float(r)
        delta = mx.array(mark).astype(layer.keys.dtype)
        new = KVCache()
        new.keys, new.values, new.offset = layer.keys + delta, layer.values + delta, layer.offset
        mx.eval(new.keys, new.values)
        out.append(new)
    return out


def batch_cache(shape: Shape, rows: int, n_tokens: int, seed: int = 0) -> Tuple[List, List[int]]:
    """A batch of ``rows`` left-padded rows (row ``i`` holds ``n_tokens - 32*i``
    tokens): ``BatchKVCache`` for attention layers, promptstore's ``SSMCache``
    for the recurrent ones. Returns the cache and the per-row token counts."""
    from mlx_lm.models.cache import BatchKVCache

    padding = [32 * i for i in range(rows)]
    lengths = [n_tokens - p for p in padding]
    key = mx.random.key(seed)
    cache = []
    layer: Any  # BatchKVCache or SSMCache
    for i in range(shape.layers):
        key, k1, k2 = mx.random.split(key, 3)
        if shape.is_attention(i):
            layer = BatchKVCache(padding)
            kv = (rows, shape.kv_heads, n_tokens, shape.head_dim)
            layer.update_and_fetch(_random(kv, mx.bfloat16, k1), _random(kv, mx.bfloat16, k2))
        else:
            conv = _random((rows,) + shape.conv[1:], mx.bfloat16, k1)
            state = _random((rows,) + shape.state[1:], mx.float32, k2)
            layer = SSMCache.from_parts(conv, state, lengths)
        cache.append(layer)
        mx.eval(_layer_arrays(layer))
    return cache, lengths


def _layer_arrays(layer) -> List[mx.array]:
    from mlx.utils import tree_flatten

    # Without a destination, tree_flatten returns the list of pairs.
    pairs = cast(List[Tuple[str, Any]], tree_flatten(layer.state))
    return [v for _, v in pairs if isinstance(v, mx.array)]


def cache_nbytes(cache: Sequence) -> int:
    """Bytes of every array a cache holds (its ``state``)."""
    return sum(a.nbytes for layer in cache for a in _layer_arrays(layer))


def tiny_kv(n_tokens: int):
    """A trimmable one-layer cache of ``n_tokens`` positions, 2 bytes per token:
    lookup-store filler whose cost is the index, not the payload."""
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.keys = mx.zeros((1, 1, n_tokens, 1), dtype=mx.uint8)
    layer.values = mx.zeros((1, 1, n_tokens, 1), dtype=mx.uint8)
    layer.offset = n_tokens
    return [layer]


class LookupCorpus:
    """Realistic token lists for a lookup store: 16 shared system prompts
    (512-2048 tokens) continued by random turns, total lengths log-uniform in
    [256, 32768]. Two target entries give the 1K and 32K queries a hit deep in
    the store (900 and 31000 stored tokens)."""

    def __init__(self, seed: int = 0, vocab: int = 150_000, max_len: int = 32768):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.max_len = max_len
        self.systems = [self._toks(int(n)) for n in self.rng.integers(512, 2049, size=16)]
        base = self.systems[0]
        self.targets = {
            1024: np.concatenate([base, self._toks(900 - len(base))]) if len(base) < 900 else base[:900],
            32768: np.concatenate([base, self._toks(31000 - len(base))]),
        }
        self.queries = {
            1024: np.concatenate([self.targets[1024], self._toks(1024 - len(self.targets[1024]))]),
            32768: np.concatenate([self.targets[32768], self._toks(32768 - 31000)]),
        }

    def _toks(self, n: int) -> np.ndarray:
        return self.rng.integers(3, self.vocab, size=max(0, n), dtype=np.uint32)

    def entries(self, n: int) -> Iterator[np.ndarray]:
        """``n`` filler token lists."""
        for _ in range(n):
            length = int(np.exp(self.rng.uniform(np.log(256), np.log(self.max_len))))
            sys_toks = self.systems[int(self.rng.integers(len(self.systems)))]
            if length <= len(sys_toks):
                yield np.concatenate([sys_toks[: length - 1], self._toks(1)])
            else:
                yield np.concatenate([sys_toks, self._toks(length - len(sys_toks))])


@contextlib.contextmanager
def unsynced_lmdb() -> Iterator[None]:
    """Open LMDB environments without fsync while this is active.

    Setup only (filling lookup stores with thousands of entries): the
    entries go through the ordinary ``PromptStore.put``, but the store is
    opened with ``sync=False`` so setup does not pay one fsync per entry.
    Measurements always reopen the store normally.
    """
    import lmdb

    original = lmdb.open
    lmdb.open = functools.partial(original, sync=False, metasync=False)  # type: ignore[assignment]  # a patch
    try:
        yield
    finally:
        lmdb.open = original
