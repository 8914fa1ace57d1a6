"""The memory tier of PersistentPromptCache, and zero-copy cache views.

A *view* of a prompt cache is a list of fresh layer objects whose arrays are
fresh ``mx.array`` objects over the same evaluated buffers: nothing is
copied. It matters because mlx-lm writes into a cache in place
(``KVCache.update_and_fetch`` does ``self.keys[..., prev:offset, :] = k``):
that rebinds the data of the very ``mx.array`` object the layer holds, so
anyone holding the same object sees the write. A fresh object over the same
buffer does not: mlx copies a buffer on write when another array shares it.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Set, Tuple

import mlx.core as mx
import numpy as np

from promptstore.codecs import decode_layer, detached, encode_layer, is_trimmable, layer_coverage, trim_floor
from promptstore.errors import CoverageMismatch

__all__ = ["view", "MemoryTier", "MemEntry", "usable"]


def view(cache: List[Any], n_tokens: Optional[int] = None) -> Tuple[List[Any], int, bool, int]:
    """Fresh layer objects over the same evaluated arrays; no array data is copied.

    Args:
        cache: per-layer cache objects whose classes have a registered codec.
        n_tokens: when given, every layer that reports coverage must cover
            exactly this many tokens.

    Returns:
        ``(layers, nbytes, trimmable, floor)``: the view; the bytes it keeps
        alive (a view of a KV buffer that mlx-lm grows 256 positions at a
        time keeps the whole buffer, not only the positions it covers);
        whether every layer can be trimmed (``codecs.is_trimmable``); and the
        fewest tokens it can be trimmed to (``codecs.trim_floor``: a chunked
        window past its first chunk no longer holds its first tokens).

    Raises:
        UnknownStorageKind: a layer's class has no codec.
        CoverageMismatch: a layer covers another number of tokens.
        CodecError: the codec refuses the layer (e.g. an open verify round).
    """
    encoded = detached([encode_layer(layer) for layer in cache])
    layers = [decode_layer(enc.kind, enc.version, enc.arrays, enc.meta) for enc in encoded]
    if n_tokens is not None:
        for i, layer in enumerate(layers):
            cov = layer_coverage(layer)
            if cov is not None and cov != n_tokens:
                raise CoverageMismatch(f"layer {i} covers {cov} tokens, but the cache was inserted for {n_tokens} tokens")
    nbytes = max(sum(int(a.nbytes) for enc in encoded for a in enc.arrays.values()), held_bytes(cache))
    return layers, nbytes, is_trimmable(layers), trim_floor((enc.kind, enc.meta) for enc in encoded)


def held_bytes(cache: Any) -> int:
    """The bytes of every distinct mlx array ``cache``'s layer objects hold
    (their attributes, through lists, tuples, dicts and inner layers)."""
    seen: Set[int] = set()
    total = 0
    todo: List[Any] = list(cache)
    while todo:
        x = todo.pop()
        if isinstance(x, mx.array):
            if id(x) not in seen:
                seen.add(id(x))
                total += int(x.nbytes)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif hasattr(x, "__dict__") and id(x) not in seen:
            seen.add(id(x))
            todo.extend(vars(x).values())
    return total


def checkout(cache: List[Any], viewable: bool) -> List[Any]:
    """A copy of a held cache that the caller may mutate: a view when the
    layers have codecs, else ``copy.deepcopy`` (what mlx-lm's own cache does)."""
    if viewable:
        return view(cache)[0]
    return copy.deepcopy(cache)


def usable(tokens: np.ndarray, trimmable: bool, query: np.ndarray, floor: int = 0) -> Optional[Tuple[int, int]]:
    """How a held cache of ``tokens`` serves ``query``: ``(matched, 1)`` when
    its tokens are a prefix of the query, ``(matched, 0)`` when it is
    trimmable and shares ``matched > 0`` tokens with it, at least its trim
    ``floor``, else None. The pairs order the candidates: more tokens
    first, then no trim."""
    m = min(len(tokens), len(query))
    same = tokens[:m] == query[:m]
    c = m if same.all() else int(np.argmin(same))
    if c == len(tokens):
        return c, 1
    if trimmable and c > 0 and c >= floor:
        return c, 0
    return None


@dataclass
class MemEntry:
    """One cache held in memory."""

    model: Hashable
    tokens: np.ndarray  # int64
    cache: List[Any]
    nbytes: int
    cache_type: str
    trimmable: bool
    viewable: bool  # layers have codecs: checkout is a zero-copy view
    floor: int = 0  # the fewest tokens it can be trimmed to


class MemoryTier:
    """An LRU of prompt caches with a count and a byte budget.

    Like mlx-lm's LRUPromptCache, inserting a trimmable cache drops the held
    prefixes of it (the longer cache serves them by trimming). Thread-safe.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: "OrderedDict[Tuple[Hashable, bytes], MemEntry]" = OrderedDict()
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats_by_type(self, types=("assistant", "user", "system")) -> Dict[str, Dict[str, int]]:
        out = {t: {"n_sequences": 0, "n_bytes": 0} for t in types}
        with self._lock:
            for e in self._entries.values():
                s = out.setdefault(e.cache_type, {"n_sequences": 0, "n_bytes": 0})
                s["n_sequences"] += 1
                s["n_bytes"] += e.nbytes
        return out

    @staticmethod
    def _key(model: Hashable, tokens: np.ndarray) -> Tuple[Hashable, bytes]:
        return model, tokens.tobytes()

    def best(self, model: Hashable, query: np.ndarray) -> Optional[Tuple[MemEntry, int]]:
        """The entry serving the longest prefix of ``query``: ``(entry, matched)``.

        An entry whose tokens are a prefix of the query serves all of them; a
        trimmable entry serves its common prefix with the query. Ties prefer
        the entry that needs no trim. The entry becomes most recently used.
        """
        found: Optional[Tuple[MemEntry, int]] = None
        rank = (0, 0)
        with self._lock:
            for key, e in self._entries.items():
                if key[0] != model:
                    continue
                r = usable(e.tokens, e.trimmable, query, e.floor)
                if r is not None and r > rank:
                    found, rank = (e, r[0]), r
            if found is not None:
                self._entries.move_to_end(self._key(model, found[0].tokens))
        return found

    def add(self, entry: MemEntry) -> None:
        """Hold ``entry`` (replacing one for the same tokens), then evict to the budgets."""
        key = self._key(entry.model, entry.tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            if entry.trimmable:  # the prefixes it can be trimmed to (no shorter than its floor) go
                n = len(entry.tokens)
                for k in [k for k, e in self._entries.items()
                          if k[0] == entry.model and entry.floor <= len(e.tokens) < n
                          and np.array_equal(e.tokens, entry.tokens[: len(e.tokens)])]:
                    self._nbytes -= self._entries.pop(k).nbytes
            self._entries[key] = entry
            self._nbytes += entry.nbytes
            self._evict(self.max_size, self.max_bytes)

    def trim_to(self, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """Evict least recently used entries until both limits hold."""
        with self._lock:
            self._evict(
                max(0, n_sequences) if n_sequences is not None else 1 << 63,
                max(0, n_bytes) if n_bytes is not None else 1 << 63,
            )

    def _evict(self, n_sequences: int, n_bytes: int) -> None:
        while self._entries and (len(self._entries) > n_sequences or self._nbytes > n_bytes):
            _, e = self._entries.popitem(last=False)
            self._nbytes -= e.nbytes
