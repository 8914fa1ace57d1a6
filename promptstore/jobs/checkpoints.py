"""Checkpoints at message boundaries for caches that cannot be trimmed.

A hybrid model's recurrent layers (and a sliding-window layer once it has
wrapped) cannot drop tokens, so a stored entry serves only queries that
extend it exactly. A chat grows by turns: storing a snapshot at the end of
the system message and at the end of every user turn lets the next turn's
prompt hit at the last boundary it shares.

The snapshot is taken by ``store.put`` at the boundary, before prefill goes
on: ``put`` evaluates the covered arrays and copies their bytes into LMDB
synchronously, while continuing prefill writes into the KV buffers in place.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from promptstore.codecs import codec_for_layer
from promptstore.jobs.prefill import CacheOptions, make_cache, prefill

__all__ = ["BOUNDARY_ROLES", "message_boundaries", "needs_checkpoints", "prefill_with_checkpoints"]

BOUNDARY_ROLES = ("system", "developer", "user")

log = logging.getLogger("promptstore")


def message_boundaries(tokenizer: Any, messages: List[Dict[str, Any]], tokens: Sequence[int]) -> List[int]:
    """Token counts at the end of each system/user message that are a true prefix of ``tokens``.

    Each count comes from templating the first k messages (no generation
    prompt); a count whose tokens are not exactly a prefix of the full list
    (a template that rewrites earlier turns) is dropped, and so is one the
    template refuses to render (one that requires a user message, say). The
    full length itself is not a boundary.
    """
    out = set()
    full = list(tokens)
    for k in range(1, len(messages)):
        if messages[k - 1].get("role") not in BOUNDARY_ROLES:
            continue
        try:
            part = list(tokenizer.apply_chat_template(messages[:k], add_generation_prompt=False))
        except Exception as err:  # the template's own refusal (Qwen3's: "No user query found in messages.")
            log.info("promptstore: no checkpoint after message %d: the chat template refuses the first %d messages: %s", k, k, err)
            continue
        if 0 < len(part) < len(full) and full[: len(part)] == part:
            out.add(len(part))
    return sorted(out)


def needs_checkpoints(model: Any, n_tokens: Optional[int] = None, options: Optional[CacheOptions] = None) -> bool:
    """True when a cache of ``n_tokens`` on ``model`` could not be trimmed:
    a recurrent layer, or a sliding window no longer than the prompt (any
    sliding window when ``n_tokens`` is None). Such entries only serve
    queries that extend them exactly, so chats need boundary checkpoints.
    Each layer's codec decides (a kind that does not say needs them).
    ``options`` are the cache options prefill will use (``max_kv_size``
    makes sliding windows).

    Raises:
        UnknownStorageKind: a layer's exact class has no codec.
    """
    return any(codec_for_layer(layer).needs_checkpoints(layer, n_tokens) for layer in make_cache(model, options))


def prefill_with_checkpoints(
    store: Any,
    fingerprint: str,
    model: Any,
    tokens: Sequence[int],
    boundaries: Sequence[int],
    meta: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[int, int, float], None]] = None,
    options: Optional[CacheOptions] = None,
) -> Tuple[Any, List[Any]]:
    """Prefill ``tokens`` segment by segment, storing an entry at each boundary and at the end.

    ``options``: mlx-lm's cache options (:class:`CacheOptions`).

    Returns:
        ``(final EntryInfo, [checkpoint EntryInfo, ...])``.
    """
    import time

    total = len(tokens)
    start = time.perf_counter()
    cache = make_cache(model, options)
    checkpoints = []
    done = 0
    cuts = [b for b in sorted(set(boundaries)) if 0 < b < total] + [total]
    for i, cut in enumerate(cuts):
        base = done

        def seg_progress(n, _total, _secs, base=base):
            if progress is not None:
                progress(base + n, total, time.perf_counter() - start)

        prefill(model, tokens[done:cut], cache=cache, progress=seg_progress, options=options)
        done = cut
        if cut == total:
            break
        ck_meta = dict(meta or {})
        ck_meta["checkpoint"] = f"boundary {i + 1} of {len(cuts) - 1}"
        checkpoints.append(store.put(fingerprint, tokens[:cut], cache, meta=ck_meta))
    final = store.put(fingerprint, tokens, cache, meta=meta)
    return final, checkpoints
