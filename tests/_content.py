"""What the reliability tests and their workers (``_workers.py``) put:
deterministic entries, the same tokens and cache in every process, so a test
can check any entry a worker stored bit-exactly.

``make_entry(seed, i)``'s entries share nothing; ``chat_entry(conv, turn)``'s
share shared blocks (entry format 3), as a growing chat's do. mlx is imported
inside the functions: a worker on mlx's CUDA backend must import it only after
its fork (``_workers.WARM``).
"""

from __future__ import annotations

import functools

import numpy as np


def make_entry(seed: int, i: int, big_every: int = 6):
    """``(tokens, cache)``: a real mlx-lm KVCache (plus an ArraysCache layer on
    odd i), about 4.5 MB (two payload chunks) every ``big_every``-th entry."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    rng = np.random.default_rng([seed, i])
    n = 4400 if big_every and i % big_every == big_every - 1 else int(rng.integers(4, 120))
    tokens = [seed % 50000, i % 50000] + rng.integers(0, 50000, n - 2).tolist()
    k = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float16))
    kv = KVCache()
    kv.update_and_fetch(k, v)
    layers = [kv]
    if i % 2:
        ac = ArraysCache(2)
        ac[0] = mx.array(rng.standard_normal((1, 3, 16)).astype(np.float32))
        ac[1] = mx.array(rng.integers(0, 1 << 15, (1, 4, 8)).astype(np.int32))
        layers.append(ac)
    return tokens, layers


# Tokens of the system prompt every chat starts with: longer than a block
# (format._blocks.BLOCK_TOKENS, 512; not imported: that imports mlx), so every
# chat's first block lies inside it and is shared by all of them.
SYSTEM = 556
TURNS = 4  # turns of a chat


@functools.lru_cache(maxsize=32)
def _chat(conv: int):
    """Token ids, keys and values (numpy) of a whole chat, and the token count
    at the end of each turn: a system prompt all chats share (the same ids and
    KV bytes), then ``TURNS`` turns of its own (of ~1100 tokens in every fifth
    chat, spanning several blocks; of 20-120 tokens in the others)."""
    system = np.random.default_rng([424242])
    rng = np.random.default_rng([conv, 4242])
    lens = rng.integers(900, 1300, TURNS) if conv % 5 == 4 else rng.integers(20, 120, TURNS)
    n = SYSTEM + int(lens.sum())
    tokens = system.integers(0, 50000, SYSTEM).tolist() + rng.integers(0, 50000, n - SYSTEM).tolist()
    keys = np.concatenate([system.standard_normal((1, 2, SYSTEM, 64)), rng.standard_normal((1, 2, n - SYSTEM, 64))], axis=2)
    values = np.concatenate([system.standard_normal((1, 2, SYSTEM, 64)), rng.standard_normal((1, 2, n - SYSTEM, 64))], axis=2)
    return tokens, keys.astype(np.float32), values.astype(np.float16), (SYSTEM + np.cumsum(lens)).tolist()


def chat_entry(conv: int, turn: int):
    """``(tokens, cache)`` after turn ``turn`` of chat ``conv``: a real mlx-lm
    KVCache whose positions are a prefix of the chat's, so entries stored turn
    after turn share blocks along the chat, and every chat's first block (the
    system prompt's) with every other chat's. Every third chat also has an
    ArraysCache layer, a state of each turn's own (kept in the entry's payload)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    tokens, keys, values, ends = _chat(conv)
    n = ends[turn]
    kv = KVCache()
    kv.update_and_fetch(mx.array(keys[..., :n, :]), mx.array(values[..., :n, :]))
    layers = [kv]
    if conv % 3 == 1:
        rng = np.random.default_rng([conv, turn, 77])
        ac = ArraysCache(2)
        ac[0] = mx.array(rng.standard_normal((1, 3, 16)).astype(np.float32))
        ac[1] = mx.array(rng.integers(0, 1 << 15, (1, 4, 8)).astype(np.int32))
        layers.append(ac)
    return tokens[:n], layers


def entry_of(content: str, a: int, b: int, big_every: int = 6):
    """The entry a worker reports as ``a b``: ``make_entry(a, b)`` or, for ``chats``, ``chat_entry(a, b)``."""
    return chat_entry(a, b) if content == "chats" else make_entry(a, b, big_every)


def nth(content: str, seed: int, i: int, first_chat: int = 0, chats: int = 10):
    """What a worker puts ``i``-th: ``(seed, i)``, or turn ``i % TURNS`` of one
    of ``chats`` chats, taken in turn from ``first_chat`` on (numbered from ``seed * 100``)."""
    if content != "chats":
        return seed, i
    return seed * 100 + (first_chat + i // TURNS) % chats, i % TURNS


def same_cache(a, b) -> bool:
    """Bit-exact equality of two caches: class, codec meta and every array."""
    from _bits import bits_equal
    from promptstore.codecs import encode_layer

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if type(x) is not type(y):
            return False
        ex, ey = encode_layer(x), encode_layer(y)
        if ex.kind != ey.kind or ex.meta != ey.meta or set(ex.arrays) != set(ey.arrays):
            return False
        for name, p in ex.arrays.items():
            q = ey.arrays[name]
            if p.dtype != q.dtype or p.shape != q.shape or not bits_equal(p, q).item():
                return False
    return True


MODEL = "reliability@0"
