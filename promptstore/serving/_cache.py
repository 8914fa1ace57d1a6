"""PersistentPromptCache: mlx-lm server's prompt cache, backed by the store.

It implements the interface of ``mlx_lm.models.cache.LRUPromptCache``
(``fetch_nearest_cache``, ``insert_cache``, ``trim_to``, ``nbytes``,
``stats_by_type``, ``len``) with two tiers:

* memory: an LRU of caches with a count and a byte budget, as mlx-lm's;
* the store: every inserted cache is also put into a :class:`PromptStore`
  by a background thread, so the serving loop never waits on the disk, and a
  restarted server (or ``promptstore get``) finds it again.

Lookups try memory, then the store; a store hit is promoted to memory.
Entries of recurrent (hybrid) models match only at their exact length;
trimmable entries may be trimmed to a shorter common prefix, as in mlx-lm.
A fetch always leaves at least one token of the query to process (the
model needs one to produce logits), so an exactly matching entry is used
through the longest stored prefix of all but the last token.

Model keys: mlx-lm passes ``(model_path, adapter_path, draft_path)``. It is
mapped to ``fingerprint(model_path)``, the identity that ``promptstore
put/get --model DIR`` use, so the server and the CLI share entries; entries
an older release stored under the folder-named identity are read too (as
put/get read them), never written. A key that cannot be fingerprinted (an
adapter, a Hugging Face id not in the local cache) is served from memory
only, with a warning.

Checkpoint history: recurrent state cannot be shared between coverages, so
every stored checkpoint of a hybrid conversation carries all of it. After
the writer thread commits an entry that cannot be trimmed, it prunes that
entry's chain (the stored entries of the model that are prefixes of it):
of the checkpoints this cache wrote, it keeps the ``checkpoints`` longest
plus the system-prompt checkpoint, and deletes the superseded rest. Pinned
entries, trimmable entries and entries written by anyone else are never
touched (the policy in full: ``promptstore.serving._history``). The memory
tier is left to its own LRU.

Hybrid models: mlx-lm's server makes ``ArraysCache`` for gated-DeltaNet
layers, which cannot tell how many tokens they hold. At insert those layers
become SSMCache covering the tokens given, so the store keeps them as
``ssm.gated_delta`` with coverage; a stored ``arrays`` entry of such a model
(written before) is converted the same way when it is read, and rewritten
as ``ssm.gated_delta``. Which layers are gated-DeltaNet: ``gated_layers``
(``promptstore serve`` asks the loaded models), else the model directories'
``config.json`` (:func:`promptstore.ssm.is_gated_delta_model_dir`). Caches
handed back to the caller hold mlx-lm's ArraysCache in those layers (mlx-lm's
server batches them with fresh caches of its own), or SSMCache with
``ssm_layers=True``.

Damaged or incompatible stored entries are logged and treated as misses;
no error of the cache ever reaches the serving loop.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import numpy as np

from promptstore.codecs import codec_for_layer, trim_cache
from promptstore.ssm import SSMCache, is_gated_delta_model_dir, to_ssm
from promptstore.store import _keys
from promptstore.serving._history import DEFAULT_CHECKPOINTS, SOURCE, History, checkpoint_limit
from promptstore.serving._memory import MemEntry, MemoryTier, checkout, held_bytes, view
from promptstore.serving._writer import Job, Writer
from promptstore.errors import CoverageMismatch, InvalidInput, PromptStoreError, RoundError
from promptstore.identity import fingerprint, legacy_fingerprint
from promptstore.store import EntryInfo, PromptStore

__all__ = ["PersistentPromptCache", "model_identity", "legacy_identities"]

log = logging.getLogger("promptstore")

CACHE_TYPES = ("assistant", "user", "system")
_KNOWN_MAX = 1 << 16


def model_identity(key: Any) -> str:
    """The store identity of an mlx-lm server model key.

    Args:
        key: ``(model_path, adapter_path, draft_path)`` as mlx-lm's server
            passes it, a model directory, or an identity string
            (``name@digest``, e.g. from :func:`fingerprint`).

    Returns:
        ``fingerprint(model_path)``; with a draft model,
        ``fingerprint(model) + "+draft:" + fingerprint(draft)`` (the cache
        then holds the draft model's layers too).

    Raises:
        InvalidInput: the key names an adapter, or a path that is not a
            model directory (hub ids are not resolved).
    """
    if isinstance(key, tuple):
        path, adapter, draft = (tuple(key) + (None, None, None))[:3]
    else:
        path, adapter, draft = key, None, None
    if adapter is not None:
        raise InvalidInput(f"adapter {adapter!r}: caches of adapted models are not persisted (memory only)")
    if isinstance(path, str) and "@" in path and not os.path.isdir(path):
        ident = path
    elif isinstance(path, (str, os.PathLike)):
        ident = fingerprint(path)
    else:
        raise InvalidInput(f"model key {key!r} is neither a model directory nor an identity string")
    if draft is not None:
        ident += "+draft:" + fingerprint(draft)
    return ident


class PersistentPromptCache:
    """A drop-in for mlx-lm's ``LRUPromptCache`` that persists into a PromptStore.

    Args:
        store: a :class:`PromptStore` (left open by :meth:`close`), or a store
            path, or None for the default store (both opened and closed here).
        max_size: the most caches held in memory (mlx-lm's
            ``--prompt-cache-size``).
        max_bytes: the memory tier's byte budget (``--prompt-cache-bytes``).
        model_id: maps a model key to a store identity; default
            :func:`model_identity`. Return or raise PromptStoreError for
            memory-only.
        persist: False keeps inserts in memory (lookups still read the store).
        max_pending_bytes: bytes that may wait for the disk; past it new
            writes are dropped rather than making the server wait.
        checkpoints: the bounded checkpoint history of caches that cannot be
            trimmed (hybrid models, sliding windows past their window). After
            such an entry is committed, of the stored entries that are
            prefixes of it (its conversation so far), those this cache wrote
            are pruned to the ``checkpoints`` longest (the new one included),
            plus every system-prompt checkpoint (``cache_type="system"``).
            Pinned entries, trimmable entries and entries written by others
            (``promptstore put``, warm-up) are never deleted. A turn usually
            leaves two checkpoints (the prompt up to its last token, and the
            prompt plus the answer; under ``promptstore serve`` a third at
            the end of the chat's messages). 0 or None keeps every checkpoint.
            Pruning runs on the writer thread and its errors are logged.
            The memory tier is not pruned: it has its own LRU and budgets.
        gated_layers: maps a model key to one flag per layer of its caches
            (True: a gated-DeltaNet layer, whose ArraysCache becomes an
            SSMCache), True for every ArraysCache layer, or None for none.
            Default: True when every model directory of the key is of a
            gated-DeltaNet type (:data:`promptstore.ssm.GATED_DELTA_MODEL_TYPES`),
            else None.
        ssm_layers: hand fetched caches out with SSMCache in gated-DeltaNet
            layers (for loops that run verify rounds); default mlx-lm's
            ArraysCache, which mlx-lm's server batches with its own.
        older_ids: maps a model key to older identities whose stored entries
            lookups also read (never written, pruned or rewritten; the
            identity covering more of the query wins, ties to the current
            one). Default: with the default ``model_id``,
            :func:`legacy_identities` (the folder-named identity of older
            releases), else none.

    Raises:
        InvalidInput: ``checkpoints`` is not None or an integer >= 0.

    Call :meth:`close` (or use ``with``) to flush pending writes; an atexit
    hook does it too for an orderly interpreter exit.
    """

    def __init__(
        self,
        store: Union[PromptStore, str, os.PathLike, None] = None,
        *,
        max_size: int = 10,
        max_bytes: Optional[int] = None,
        model_id: Optional[Callable[[Any], Optional[str]]] = None,
        persist: bool = True,
        max_pending_bytes: int = 4 << 30,
        checkpoints: Optional[int] = DEFAULT_CHECKPOINTS,
        gated_layers: Optional[Callable[[Any], Union[None, bool, Sequence[bool]]]] = None,
        ssm_layers: bool = False,
        older_ids: Optional[Callable[[Any], Sequence[str]]] = None,
    ):
        keep = checkpoint_limit(checkpoints)  # before opening anything
        self._gated_layers = gated_layers or gated_by_config
        self._flags: Dict[Any, Union[None, bool, Sequence[bool]]] = {}
        self.ssm_layers = ssm_layers
        self._owns_store = not isinstance(store, PromptStore)
        self.store = store if isinstance(store, PromptStore) else PromptStore(store)
        self._memory = MemoryTier(max_size, max_bytes if max_bytes is not None else 1 << 63)
        self._model_id = model_id or model_identity
        self._older_ids = older_ids or (legacy_identities if model_id is None else _no_older)
        self._ids: Dict[Hashable, Optional[str]] = {}
        self._older: Dict[Hashable, List[str]] = {}
        self._known: "OrderedDict[bytes, None]" = OrderedDict()
        self._lock = threading.Lock()
        self.persist = persist
        self._history = History(self.store, keep, on_removed=self._unremember)
        self._writer = Writer(self.store, max_pending_bytes, on_error=self._forget, on_written=self._written)
        self._counts = {"memory_hits": 0, "store_hits": 0, "misses": 0, "errors": 0}
        self._closed = False
        atexit.register(self.close)

    # -- the LRUPromptCache interface -------------------------------------------

    @property
    def max_size(self) -> int:
        return self._memory.max_size

    @property
    def max_bytes(self) -> int:
        return self._memory.max_bytes

    def __len__(self) -> int:
        return len(self._memory)

    @property
    def nbytes(self) -> int:
        """Bytes held by the memory tier."""
        return self._memory.nbytes

    def stats_by_type(self) -> Dict[str, Dict[str, int]]:
        """Memory-tier ``{cache_type: {"n_sequences", "n_bytes"}}``, as mlx-lm reports."""
        return self._memory.stats_by_type(CACHE_TYPES)

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """Evict from memory until both limits hold (the store keeps its entries).

        Raises:
            InvalidInput: a limit is not None or an integer.
        """
        for name, limit in (("n_sequences", n_sequences), ("n_bytes", n_bytes)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
                raise InvalidInput(f"trim_to: {name} must be an integer or None, not {limit!r}")
        self._memory.trim_to(n_sequences, n_bytes)

    def fetch_nearest_cache(self, model: Any, tokens: List[int]) -> Tuple[Optional[List[Any]], List[int]]:
        """The cache of the longest usable prefix of ``tokens``, and the rest.

        Returns:
            ``(cache, rest)``: a cache the caller owns and may extend, covering
            ``len(tokens) - len(rest)`` tokens, or ``(None, tokens)``. ``rest``
            is never empty for a non-empty query. Tokens that are not
            integers find nothing.

        Raises:
            InvalidInput: ``tokens`` is not a sequence.
        """
        try:
            toks = list(tokens)
        except TypeError:
            raise InvalidInput(f"tokens must be a list of token ids, not {type(tokens).__name__}") from None
        try:
            q = np.asarray(toks[:-1])
        except (TypeError, ValueError, OverflowError):
            return None, toks
        if q.size and (q.dtype.kind not in "iu" or (q.dtype.kind == "u" and q.max() > np.iinfo(np.int64).max)):
            return None, toks  # not token ids: floats would be truncated into another prompt's ids
        q = q.astype(np.int64, copy=False)
        if q.ndim != 1 or q.size == 0:
            self._count("misses")
            return None, toks
        try:
            return self._fetch(model, toks, q)
        except Exception as err:  # a cache must never take the server down
            self._count("errors")
            if isinstance(err, PromptStoreError):
                log.warning("promptstore: lookup failed, serving without a cache: %s", err)
            else:
                log.exception("promptstore: unexpected lookup error, serving without a cache")
            return None, toks

    def _fetch(self, model: Any, toks: List[int], q: np.ndarray) -> Tuple[Optional[List[Any]], List[int]]:
        ident = self._identity(model)
        mkey = ident if ident is not None else ("memory-only", model)
        found = self._memory.best(mkey, q)
        m = found[1] if found else 0
        queued = self._writer.best(ident, q) if ident is not None and m < len(q) else None
        if queued is not None and queued[1] > m:
            # Evicted from memory while its write waits: it is still here, and not yet in the store.
            job, m = queued
            ctype = job.meta.get("cache_type")
            entry = MemEntry(mkey, job.tokens, job.cache, job.nbytes, ctype if ctype in CACHE_TYPES else "assistant",
                             job.trimmable, True, job.floor)
            self._memory.add(entry)
            found = entry, m
        src, n = self._best_stored(model, ident, q) if ident is not None and m < len(q) and not self._closed else (None, 0)
        if src is not None and n > m:
            hit = self.store.lookup(src, q)
            if hit is not None and hit.matched > m:
                cache = self._to_ssm(model, hit.cache, hit.matched)
                layers, nbytes, trimmable, floor = view(cache, hit.matched)
                ctype = hit.info.meta.get("cache_type") if isinstance(hit.info.meta, dict) else None
                entry = MemEntry(mkey, q[: hit.matched].copy(), layers, nbytes,
                                 ctype if ctype in CACHE_TYPES else "assistant", trimmable, True, floor)
                self._memory.add(entry)
                if src == ident:  # an entry under an older identity is not one under this one
                    self._remember(ident, entry.tokens)
                self._count("store_hits")
                if (src == ident and any(a is not b for a, b in zip(cache, hit.cache)) and self.persist
                        and hit.matched == hit.info.n_tokens):
                    # An ``arrays`` entry written before: rewritten as ``ssm.gated_delta``.
                    meta = dict(hit.info.meta) if isinstance(hit.info.meta, dict) else {}
                    self._writer.submit(Job(ident, entry.tokens, layers, nbytes, meta, replace=True, trimmable=trimmable, floor=floor))
                return self._hand_out(checkout(layers, True)), toks[hit.matched:]
        if found is None:
            self._count("misses")
            return None, toks
        entry, c = found
        if ident is not None and self.persist and not self._closed:
            try:  # the store's eviction order must see the uses the memory tier served
                self.store.touch(ident, entry.tokens)
            except PromptStoreError as err:
                log.debug("promptstore: a use not recorded: %s", err)
        cache = checkout(entry.cache, entry.viewable)
        if c < len(entry.tokens):
            if entry.viewable:  # through the codecs, as a stored entry is trimmed (a concatenated KV drops its rows)
                trim_cache(cache, len(entry.tokens) - c)
            else:
                from mlx_lm.models.cache import trim_prompt_cache

                trim_prompt_cache(cache, len(entry.tokens) - c)
        self._count("memory_hits")
        return self._hand_out(cache), toks[c:]

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *, cache_type: str = "assistant") -> None:
        """Hold ``prompt_cache`` (covering exactly ``tokens``) and persist it in the background.

        Returns as soon as the cache is held: the write happens on the writer
        thread. A cache whose layers cover another number of tokens is
        refused (logged); one whose layers have no codec is held in memory only.
        """
        try:
            self._insert(model, tokens, prompt_cache, cache_type)
        except Exception as err:
            self._count("errors")
            if isinstance(err, PromptStoreError):
                log.warning("promptstore: not caching a prompt: %s", err)
            else:
                log.exception("promptstore: unexpected error caching a prompt")

    def _insert(self, model: Any, tokens: List[int], prompt_cache: List[Any], cache_type: str) -> None:
        toks = _keys.as_tokens(list(tokens)).astype(np.int64)
        ident = self._identity(model)
        mkey = ident if ident is not None else ("memory-only", model)
        prompt_cache = self._to_ssm(model, prompt_cache, len(toks))
        try:
            layers, nbytes, trimmable, floor = view(prompt_cache, len(toks))
            viewable = True
        except (CoverageMismatch, RoundError):
            # A layer in an open verify round: its state is about to be rolled
            # back in place, so no snapshot of it can be held (insert_cache logs it).
            raise
        except PromptStoreError as err:
            from mlx_lm.models.cache import can_trim_prompt_cache

            log.info("promptstore: holding a cache in memory only: %s", err)
            # A snapshot: the caller goes on writing into its own layers (the serial path inserts prompt[:-1], then generates).
            layers, viewable, floor = copy.deepcopy(list(prompt_cache)), False, 0
            nbytes = held_bytes(layers)
            trimmable = can_trim_prompt_cache(layers)
        self._memory.add(MemEntry(mkey, toks, layers, nbytes, cache_type, trimmable, viewable, floor))
        if ident is None or not viewable or not self.persist or self._closed:
            return
        if not self._remember(ident, toks) and self._stored(ident, toks):
            return  # written before and still stored (one evicted since is written again)
        meta = {"source": SOURCE, "cache_type": cache_type}
        self._writer.submit(Job(ident, toks, layers, nbytes, meta, trimmable=trimmable, floor=floor))

    # -- persistence -------------------------------------------------------------

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every pending write is committed; False on timeout."""
        return self._writer.flush(timeout)

    @property
    def checkpoints(self) -> int:
        """The bound on each chain's checkpoint history; 0: unbounded."""
        return self._history.keep

    @property
    def pending(self) -> int:
        """Writes not yet committed."""
        return self._writer.pending

    def close(self, timeout: Optional[float] = None) -> None:
        """Commit pending writes, stop the writer, close an owned store.
        Idempotent; never raises. With ``timeout``, returns within about
        that many seconds: writes still pending then are logged, and an
        owned store whose writer is still busy closes when its write ends."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._writer.close(timeout):
            log.warning("promptstore: %d prompt-cache writes were still pending at close", self._writer.pending)
        if not self._owns_store:
            return

        def close_store() -> None:
            try:  # publishes what the remote tier queued, records last uses (LMDB's write lock has no timeout)
                self.store.close()
            except PromptStoreError as err:
                log.warning("promptstore: the store did not close now: %s", err)

        if deadline is None:
            close_store()
            return
        closing = threading.Thread(target=close_store, name="promptstore-close", daemon=True)
        closing.start()
        closing.join(max(0.0, deadline - time.monotonic()))
        if closing.is_alive():
            log.warning("promptstore: the store is still closing after %.1f s; it closes in the background", timeout)

    def __enter__(self) -> "PersistentPromptCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> Dict[str, Any]:
        """Counters: memory and store hits, misses, writes (done, pending, failed,
        dropped), checkpoints pruned and prunes that failed."""
        with self._lock:
            counts = dict(self._counts)
        w = self._writer
        return {
            **counts,
            "memory_entries": len(self._memory),
            "memory_bytes": self._memory.nbytes,
            "written": w.written,
            "pending": w.pending,
            "write_failed": w.failed,
            "write_dropped": w.dropped,
            "write_skipped": w.skipped,
            "write_seconds": round(w.write_seconds, 6),
            "pruned": self._history.pruned,
            "prune_failed": self._history.failed,
        }

    # -- helpers -------------------------------------------------------------------

    def _to_ssm(self, model: Any, cache: List[Any], coverage: int) -> List[Any]:
        """``cache`` with its gated-DeltaNet ArraysCache layers as SSMCache
        covering ``coverage`` tokens (the same list when there are none)."""
        try:
            flags = self._flags[model]
        except KeyError:
            flags = self._flags[model] = self._gated_layers(model)
        except TypeError:  # unhashable key
            flags = self._gated_layers(model)
        if flags is None or flags is False:
            return cache
        if flags is True:
            return to_ssm(cache, coverage)
        if len(flags) != len(cache):
            log.warning("promptstore: %d layer flags for a cache of %d layers; gated-DeltaNet layers not converted",
                        len(flags), len(cache))
            return cache
        return to_ssm(cache, coverage, flags)

    def _hand_out(self, cache: List[Any]) -> List[Any]:
        """What fetch returns: SSMCache layers as mlx-lm's ArraysCache unless ``ssm_layers``."""
        if self.ssm_layers:
            return cache
        return [codec_for_layer(c).to_mlx_lm(c) if type(c) is SSMCache else c for c in cache]

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _identity(self, model: Any) -> Optional[str]:
        try:
            return self._ids[model]
        except KeyError:
            pass
        except TypeError:  # unhashable key
            return None
        try:
            ident = self._model_id(model)
        except (PromptStoreError, OSError) as err:
            log.warning("promptstore: model %r is cached in memory only: %s", model, err)
            ident = None
        self._ids[model] = ident
        return ident

    def _best_stored(self, model: Any, ident: str, q: np.ndarray) -> Tuple[str, int]:
        """The identity (``ident`` or an older one of ``model``) whose stored
        entries cover the most of ``q``, and how much (manifests only; ties
        go to ``ident``)."""
        try:
            older = self._older[model]
        except KeyError:
            try:
                older = self._older[model] = list(self._older_ids(model))
            except (PromptStoreError, OSError) as err:
                log.warning("promptstore: older identities of model %r not read: %s", model, err)
                older = self._older[model] = []
        return max(((i, self.store.peek(i, q)) for i in [ident, *older]), key=lambda found: found[1])

    @staticmethod
    def _known_key(ident: str, toks: np.ndarray) -> bytes:
        h = hashlib.blake2b(ident.encode(), digest_size=16)
        h.update(np.ascontiguousarray(toks, dtype="<u4").tobytes())
        return h.digest()

    def _remember(self, ident: str, toks: np.ndarray) -> bool:
        """Mark (ident, toks) as stored; False when it already was."""
        k = self._known_key(ident, toks)
        with self._lock:
            if k in self._known:
                self._known.move_to_end(k)
                return False
            self._known[k] = None
            while len(self._known) > _KNOWN_MAX:
                self._known.popitem(last=False)
        return True

    def _stored(self, ident: str, toks: np.ndarray) -> bool:
        """Whether the store holds (ident, toks); True when it cannot tell."""
        try:
            return self.store.exists(ident, toks)
        except PromptStoreError:
            return True

    def _unremember(self, ident: str, toks: np.ndarray) -> None:
        """Unmark (ident, toks): the next insert of it is written again."""
        with self._lock:
            self._known.pop(self._known_key(ident, toks), None)

    def _forget(self, job: Job) -> None:
        self._unremember(job.model, job.tokens)

    def _written(self, job: Job, info: EntryInfo) -> None:
        """On the writer thread, after a commit: bound the checkpoint history."""
        self._history.prune(job.tokens, info)



def legacy_identities(key: Any) -> List[str]:
    """The folder-named identity that releases before content-named
    identities gave a model directory (:func:`promptstore.identity.legacy_fingerprint`),
    when it differs from :func:`model_identity`; none for a key with an
    adapter or a draft, or that names no directory or cached Hugging Face id.
    ``promptstore put/get`` read entries under it the same way."""
    if isinstance(key, tuple):
        path, adapter, draft = (tuple(key) + (None, None, None))[:3]
    else:
        path, adapter, draft = key, None, None
    if adapter is not None or draft is not None or not isinstance(path, (str, os.PathLike)):
        return []
    if isinstance(path, str) and "@" in path and not os.path.isdir(path):
        return []  # an identity string
    try:
        old = legacy_fingerprint(path)
        return [] if old == fingerprint(path) else [old]
    except PromptStoreError:
        return []


def _no_older(key: Any) -> List[str]:
    return []


def gated_by_config(key: Any) -> Union[None, bool, Sequence[bool]]:
    """Default ``gated_layers``: True (every ArraysCache layer is gated-DeltaNet)
    when every model directory of ``key`` is of such a type, else None."""
    if isinstance(key, tuple):
        path, _, draft = (tuple(key) + (None, None, None))[:3]
        paths = [path] if draft is None else [path, draft]
    else:
        paths = [key]
    if all(isinstance(p, (str, os.PathLike)) and is_gated_delta_model_dir(p) for p in paths):
        return True
    return None
