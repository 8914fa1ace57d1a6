"""Synthetic data for ``promptstore bench``: caches of real shapes and dtypes.

The bench cache is shaped like Qwen3-Next-80B: gated-DeltaNet layers whose
cache is mlx-lm's ``ArraysCache(size=2)`` (conv state ``[1, 3, 8192]`` bf16,
recurrent state ``[1, 32, 128, 128]`` f32) and full-attention layers as
``KVCache`` (2 KV heads of 256 dims, bf16), one attention layer every fourth
layer as in the real model. :data:`DENSE` is the cache of the dense fixture
model (``fixtures/models/llama``). Values are random; only shapes and dtypes
matter. :class:`Grower` extends a cache as a model would, token by token.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx
import numpy as np

from promptstore.codecs import encode_layer
from promptstore.format._bits import bits_equal
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

    @property
    def kv_per_token(self) -> int:
        """KV bytes one token adds (keys and values of every attention layer, bf16)."""
        return self.attn_layers * 2 * self.kv_heads * self.head_dim * 2

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent layers' state (conv bf16 + recurrent f32): one checkpoint's worth."""
        return self.ssm_layers * (math_prod(self.conv) * 2 + math_prod(self.state) * 4)

    def nbytes(self, n_tokens: int) -> int:
        return self.state_bytes + self.kv_per_token * n_tokens


VOCAB = 150_000  # token ids drawn from [3, VOCAB)

QWEN3_NEXT_80B = Shape()
QUICK = Shape(ssm_layers=3, attn_layers=1)
DENSE = Shape(ssm_layers=0, attn_layers=2, kv_heads=2, head_dim=64)  # fixtures/models/llama: 1 KiB per token
# Dense caches of real models' widths, for the chat's written bytes at their sizes (``_chat``'s command line).
QWEN25_05B = Shape(ssm_layers=0, attn_layers=24, kv_heads=2, head_dim=64)  # Qwen2.5-0.5B: 12 KiB per token
LLAMA3_8B = Shape(ssm_layers=0, attn_layers=32, kv_heads=8, head_dim=128)  # Llama-3-8B: 128 KiB per token


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
    """``cache`` with one value of every token of its KV layers changed (by
    ``r``): no stored block matches, whatever the block size, so a put of it
    writes all its bytes, as a put of a new prompt would."""
    from mlx_lm.models.cache import KVCache

    out: List[Any] = []
    for layer in cache:
        if type(layer) is not KVCache or layer.keys is None:
            out.append(layer)
            continue
        n, width = layer.keys.shape[-2:]
        mark = np.zeros((n, width), dtype=np.float32)
        mark[:, 0] = float(r)
        delta = mx.array(mark).astype(layer.keys.dtype)
        new = KVCache()
        new.keys, new.values, new.offset = layer.keys + delta, layer.values + delta, layer.offset
        mx.eval(new.keys, new.values)
        out.append(new)
    return out


class Grower:
    """Extends caches of ``shape`` as a model reading new tokens would.

    KV layers (mlx-lm ``KVCache``) get new random rows through their own
    ``update_and_fetch``, so the rows already there keep their bytes;
    recurrent layers (``ArraysCache(size=2)``) get a whole new state, different
    from every earlier one (a base state plus a per-call constant: as large as
    a real one, cheaper to make than fresh random numbers).
    """

    def __init__(self, shape: Shape, seed: int = 0):
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        key = mx.random.key(seed)
        k1, k2 = mx.random.split(key)
        self._conv = _random(shape.conv, mx.bfloat16, k1)
        self._state = _random(shape.state, mx.float32, k2)

    def empty(self) -> List:
        """A cache before its first token (what ``make_prompt_cache`` returns)."""
        from mlx_lm.models.cache import ArraysCache, KVCache

        return [KVCache() if self.shape.is_attention(i) else ArraysCache(size=2) for i in range(self.shape.layers)]

    def _kv(self, n: int) -> mx.array:
        bits = self.rng.integers(0, 1 << 16, size=(1, self.shape.kv_heads, n, self.shape.head_dim), dtype=np.uint16)
        return mx.array(bits).view(mx.bfloat16)  # any bits: only bytes are stored and compared

    def extend(self, cache: Sequence, n: int) -> None:
        """Add ``n`` tokens to ``cache`` in place, evaluated."""
        from mlx_lm.models.cache import KVCache

        self.calls += 1
        out: List[mx.array] = []
        for layer in cache:
            if type(layer) is KVCache:
                k, v = layer.update_and_fetch(self._kv(n), self._kv(n))
                out += [k, v]
            else:
                layer[0] = self._conv + self.calls
                layer[1] = self._state + self.calls
                out += [layer[0], layer[1]]
        mx.eval(out)

    def cache(self, n: int) -> List:
        """A new cache of ``n`` random tokens."""
        cache = self.empty()
        self.extend(cache, n)
        return cache


def token_ids(rng: np.random.Generator, n: int) -> List[int]:
    """``n`` random token ids."""
    return rng.integers(3, VOCAB, size=n).tolist()


def fork(cache: Sequence) -> List:
    """New ``KVCache`` layers over the same covered rows: extending the fork
    leaves ``cache`` as it is, and the shared rows keep their bytes (how a
    conversation continues from a cached system prompt)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in cache:
        if type(layer) is not KVCache:
            raise TypeError(f"fork: {type(layer).__name__} layers are not forked here (KV caches only)")
        new = KVCache()
        new.keys, new.values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        new.offset = layer.offset
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


def covered(layer) -> Tuple[str, List[mx.array]]:
    """The storage kind and arrays promptstore stores for ``layer`` (its
    codec's encoding, arrays in name order): a KV layer's covered rows, not
    the spare rows of its buffer."""
    enc = encode_layer(layer)
    return enc.kind, [enc.arrays[name] for name in sorted(enc.arrays)]


def same_rows(stored: Sequence, restored: Sequence, n: Optional[int] = None) -> bool:
    """Whether every array of ``restored`` equals ``stored``'s, bit for bit
    (with ``n``: the first ``n`` rows of each of ``stored``'s ``kv`` arrays)."""
    for x, y in zip(stored, restored, strict=True):
        kind, xs = covered(x)
        for a, b in zip(xs, covered(y)[1], strict=True):
            if n is not None and kind == "kv":
                a = a[..., :n, :]
            if a.dtype != b.dtype or a.shape != b.shape or not bits_equal(a, b).item():
                return False
    return True


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
