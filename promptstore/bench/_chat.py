"""The multi-turn serving workload of ``promptstore bench``.

A conversation of ``turns`` turns goes through :class:`PersistentPromptCache`
the way mlx-lm's server drives its prompt cache (``mlx_lm/server.py``):

1. ``fetch_nearest_cache(model, prompt)``: the prompt is the conversation so
   far, the new user message and the generation prompt (``tail``: the
   template's assistant header, mlx-lm's last segment);
2. the cache is extended over the rest of the prompt; at the end of each
   segment but the last, ``insert_cache`` with its type: ``"system"`` (the
   first turn only) and ``"user"`` (the prompt up to the tail);
3. the answer is generated (the cache extended over it) and the cache is
   inserted with ``cache_type="assistant"``.

Each turn then flushes the writer and reads ``/proc/self/io``: ``written``
is what the turn passed to write calls (``wchar``: LMDB writes with
``pwrite``, blob files with ``write``), ``dirtied`` what the kernel accounted
as sent to storage (``write_bytes``). The two differ on Linux >= 6.16, whose
ext4 page cache holds large folios: ``write_bytes`` counts every folio a
write touches, whole, so a 4 KiB page rewritten inside a cached 2 MiB folio
counts 2 MiB, while the device is sent 4 KiB. The targets use ``written``.
Of it, ``files`` is the bytes of the block and blob files the turn created
(each written once, never appended to); ``written - files`` is what LMDB
wrote: its pages and meta.
The cache is extended, never recomputed, so each turn's KV rows are
byte-identical to the previous turn's; recurrent state is new at every
insert. What a turn adds: the KV of its new tokens plus one recurrent state
per insert (none on a dense model).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from promptstore.bench import _data as data
from promptstore.bench._cases import MODEL, _found, io_written
from promptstore.format import _blobs, _packs
from promptstore.format._blocks import BLOCK_TOKENS
from promptstore.serving import PersistentPromptCache
from promptstore.store import PromptStore

__all__ = ["Chat", "serve_chat", "stored_bytes", "FULL_CHAT"]


@dataclass(frozen=True)
class Chat:
    """The shape of the conversation: tokens of each part."""

    turns: int
    system: int  # the system prompt (first turn)
    user: int  # each user message, its template included
    tail: int  # the generation prompt after it (mlx-lm's "assistant" segment)
    answer: int  # each answer

    @property
    def per_turn(self) -> int:
        """New tokens of each turn (the first adds the system prompt too)."""
        return self.user + self.tail + self.answer


#: The full bench's chat (``_run.FULL``).
FULL_CHAT = Chat(turns=20, system=1024, user=250, tail=6, answer=256)


def stored_bytes(store: PromptStore) -> Dict[str, int]:
    """What ``store`` holds: ``stored`` (``usage()``: payloads, manifests and
    blocks counted once), ``manifests`` (of those, manifest bytes),
    ``logical`` (the entries' array bytes, as if nothing were shared),
    ``file`` (``file_size()``) and ``entries``."""
    entries = list(store.entries())
    manifests = 0
    with store.env.read() as txn:  # manifests are not in the public API: read the table
        for _key, raw in txn.cursor(db=store.env.db.entries):
            manifests += len(raw)
    return {
        "stored": store.usage(),
        "manifests": manifests,
        "logical": sum(e.nbytes for e in entries),
        "file": store.file_size(),
        "entries": len(entries),
    }


def _files(root: Path) -> Dict[str, int]:
    """Size of every pack and blob file of the store folder ``root``."""
    return {**_packs.Packs(root).files.sizes(), **_blobs.Blobs(root).sizes()}


def serve_chat(workdir: Path, shape: data.Shape, chat: Chat, block_tokens: int = BLOCK_TOKENS, seed: int = 0) -> Dict[str, Any]:
    """Run ``chat`` through a PersistentPromptCache over a new store at
    ``workdir`` (removed by the caller); ``block_tokens`` as ``PromptStore``'s.

    Returns the store's bytes (:func:`stored_bytes`), ``unique`` (the final
    KV once, plus one recurrent state per entry kept: the history policy
    decides how many), and per turn the tokens fetched and added, ``new``
    bytes and ``written`` bytes.
    """
    grower = data.Grower(shape, seed)
    rng = np.random.default_rng(seed)

    def toks(n: int) -> List[int]:
        return data.token_ids(rng, n)

    key = (MODEL, None, None)  # mlx-lm's model key: (model, adapter, draft)
    store = PromptStore(workdir, block_tokens=block_tokens)
    # The memory tier holds a few caches (mlx-lm's default is 10): it only
    # decides where fetches come from, not what is stored.
    pc = PersistentPromptCache(store, max_size=4)
    turns: List[Dict[str, Any]] = []
    history: List[int] = []
    cache: List[Any] = []
    try:
        system = toks(chat.system)
        for t in range(chat.turns):
            prompt = (history or system) + toks(chat.user) + toks(chat.tail)
            files0 = _files(workdir)
            io0 = io_written()
            fetched, rest = pc.fetch_nearest_cache(key, prompt)
            have = hit = len(prompt) - len(rest)
            cache = fetched if fetched is not None else grower.empty()
            cuts = [(len(system), "system")] if t == 0 else []
            inserts = 0
            for end, kind in cuts + [(len(prompt) - chat.tail, "user")]:
                if end > have:
                    grower.extend(cache, end - have)
                    have = end
                    pc.insert_cache(key, prompt[:end], cache, cache_type=kind)
                    inserts += 1
            everything = prompt + toks(chat.answer)
            grower.extend(cache, len(everything) - have)
            pc.insert_cache(key, everything, cache, cache_type="assistant")
            inserts += 1
            t0 = time.perf_counter()
            pc.flush()
            waited = time.perf_counter() - t0
            io1 = io_written()
            files1 = _files(workdir)
            added = len(everything) - hit
            turns.append({
                "turn": t + 1, "tokens": len(everything), "hit": hit, "added": added, "inserts": inserts,
                "new": shape.kv_per_token * added + shape.state_bytes * inserts,
                "written": io1[1] - io0[1], "dirtied": io1[0] - io0[0], "flush_s": waited,
                "files": sum(size for name, size in files1.items() if name not in files0),
            })
            history = everything
        stats = pc.stats()
        checkpoints = pc.checkpoints
    finally:
        pc.close()
    try:
        held = stored_bytes(store)
        # What a restarted server would find: the whole conversation, bit-exact.
        found = _found(store.lookup(MODEL, history + [1]))
        exact = found.matched == len(history) and data.same_rows(cache, found.cache)
    finally:
        store.close()
    ratios = [r["written"] / r["new"] for r in turns]
    dirtied = [r["dirtied"] / r["new"] for r in turns]
    lmdb = [(r["written"] - r["files"]) / r["new"] for r in turns]
    return {
        **held,
        "turns": turns,
        "final_tokens": len(history),
        "unique": shape.kv_per_token * len(history) + shape.state_bytes * held["entries"],
        "written_median": statistics.median(ratios),
        "written_max": max(ratios),
        "files_median": statistics.median(r["files"] / r["new"] for r in turns),
        "lmdb_median": statistics.median(lmdb),
        "lmdb_max": max(lmdb),
        "dirtied_median": statistics.median(dirtied),
        "dirtied_max": max(dirtied),
        "hits": sum(1 for r in turns if r["hit"]),
        "checkpoints": checkpoints,
        "pruned": stats.get("pruned", 0),
        "put_s": stats["write_seconds"] / max(1, stats["written"]),
        "bit_exact": exact,
        "chat": asdict(chat),
    }

