"""Shared blocks measured by ``promptstore bench``: what sharing stores, reads and costs.

* :func:`shared_prompt`: conversations that share one system prompt, put
  one by one: stored bytes against the system prompt once plus each
  conversation's own tokens;
* :func:`entry_reads`: put and get of one long trimmable entry, and a lookup
  that hits a prefix of it: the bytes the lookup read against the prefix's,
  and the restored prefix against the stored rows, bit for bit;
* :func:`block_sizes`: both of those and the multi-turn chat
  (``_chat.serve_chat``) at several ``block_tokens``: the figures behind
  the choice of ``format._blocks.BLOCK_TOKENS``.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from promptstore.bench import _data as data
from promptstore.bench._cases import MODEL, _found, median_time
from promptstore.bench._chat import Chat, serve_chat, stored_bytes
from promptstore.format._blocks import BLOCK_TOKENS
from promptstore.store import PromptStore

__all__ = ["shared_prompt", "entry_reads", "block_sizes"]

def shared_prompt(
    path: Path,
    shape: data.Shape,
    conversations: int,
    system: int,
    system_entry: bool = True,
    own: Tuple[int, int] = (200, 500),
    block_tokens: int = BLOCK_TOKENS,
    seed: int = 0,
) -> Dict[str, Any]:
    """``conversations`` caches of one ``system``-token system prompt plus
    ``own`` (a range) tokens each, put one by one with ``PromptStore.put``
    into a new store at ``path``. Every conversation continues the same
    system-prompt rows, as one that started from the cached system prompt
    does.

    With ``system_entry`` the system prompt's own cache is put first, as
    mlx-lm's server stores it (the ``"system"`` segment of the first
    request); without, only whole conversations are put, as a warm-up job of
    whole prompts does: then the block holding the end of the system prompt
    is not shared (it also holds the first conversation's own tokens).

    Returns the store's bytes (``_chat.stored_bytes``), ``unique`` (the
    system prompt once plus every conversation's own tokens) and the median
    ``put_s``.
    """
    grower = data.Grower(shape, seed)
    rng = np.random.default_rng(seed)
    head = data.token_ids(rng, system)
    base = grower.cache(system)
    lengths = [int(n) for n in rng.integers(own[0], own[1] + 1, size=conversations)]
    times: List[float] = []
    with PromptStore(path, block_tokens=block_tokens) as store:
        if system_entry:
            store.put(MODEL, head, base, meta={"cache_type": "system"})
        for n in lengths:
            cache = data.fork(base)
            grower.extend(cache, n)
            toks = head + data.token_ids(rng, n)
            t0 = time.perf_counter()
            store.put(MODEL, toks, cache)
            times.append(time.perf_counter() - t0)
        held = stored_bytes(store)
    return {
        **held,
        "conversations": conversations,
        "system": system,
        "system_entry": system_entry,
        "own_tokens": sum(lengths),
        "unique": shape.kv_per_token * (system + sum(lengths)),
        "put_s": statistics.median(times),
    }


def entry_reads(
    path: Path,
    shape: data.Shape,
    n_tokens: int,
    prefix: int,
    repeats: int,
    block_tokens: int = BLOCK_TOKENS,
    seed: int = 0,
) -> Dict[str, Any]:
    """One ``n_tokens``-token trimmable entry of ``shape`` in a new store at ``path``.

    Measures a durable ``put`` (``repeats`` entries, each of new bytes, the
    median), a ``get`` of the last one and a ``lookup`` whose query shares
    its first ``prefix`` tokens and then differs: ``bytes_read`` (blocks and
    payload the lookup read), whether the restored cache equals the stored
    one's first ``prefix`` rows bit for bit, and the size of one manifest.
    """
    grower = data.Grower(shape, seed)
    rng = np.random.default_rng(seed)
    puts: List[float] = []
    with PromptStore(path, block_tokens=block_tokens) as store:
        for _ in range(repeats):
            cache = grower.cache(n_tokens)
            toks = data.token_ids(rng, n_tokens)
            gc.collect()
            t0 = time.perf_counter()
            store.put(MODEL, toks, cache)
            puts.append(time.perf_counter() - t0)
        query = toks[:prefix] + [(toks[prefix] + 1) % data.VOCAB + 3] + data.token_ids(rng, 63)

        def fresh() -> None:
            gc.collect()
            mx.clear_cache()

        hit = _found(store.lookup(MODEL, query))
        exact = hit.matched == prefix and data.same_rows(cache, hit.cache, prefix)
        bytes_read = hit.bytes_read
        del hit
        t_lookup = median_time(lambda: store.lookup(MODEL, query), repeats, fresh)
        t_get = median_time(lambda: store.get(MODEL, toks), repeats, fresh)
        held = stored_bytes(store)
    return {
        "tokens": n_tokens,
        "prefix": prefix,
        "bytes": shape.kv_per_token * n_tokens,
        "prefix_bytes": shape.kv_per_token * prefix,
        "bytes_read": bytes_read,
        "bit_exact": exact,
        "put_s": statistics.median(puts),
        "get_s": t_get,
        "lookup_s": t_lookup,
        "manifest": held["manifests"] // max(1, held["entries"]),
        "stored": held["stored"],
        "file": held["file"],
    }


def block_sizes(
    workdir: Path,
    shape: data.Shape,
    sizes: Sequence[int],
    chat: Chat,
    shared: Tuple[int, int],
    entry: Tuple[int, int],
    repeats: int,
) -> List[Dict[str, Any]]:
    """The chat, shared-prompt and long-entry cases at each ``block_tokens`` in ``sizes``.

    ``shared``: (conversations, system tokens); ``entry``: (tokens, prefix).
    """
    out = []
    for b in sizes:
        work = workdir / f"blocks-{b}"
        work.mkdir()
        try:
            c = serve_chat(work / "chat", shape, chat, block_tokens=b)
            s = [shared_prompt(work / f"shared-{first}", shape, *shared, first, block_tokens=b) for first in (True, False)]
            e = entry_reads(work / "entry", shape, *entry, repeats, block_tokens=b)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out.append({
            "block_tokens": b,
            "block_bytes": b * shape.kv_per_token // max(1, 2 * shape.attn_layers),  # one block of one array
            "chat_ratio": c["stored"] / c["unique"],
            "chat_written_median": c["written_median"],
            "shared_ratio": s[0]["stored"] / s[0]["unique"],
            "shared_whole_ratio": s[1]["stored"] / s[1]["unique"],
            "entry": e,
        })
    return out
