"""Serving: a persistent prompt cache for mlx-lm's server and custom serving loops.

* ``_cache``: :class:`PersistentPromptCache`, mlx-lm's ``LRUPromptCache`` interface over the store;
* ``_memory``: the in-memory LRU tier (zero-copy views of live caches);
* ``_writer``: the background writer that keeps the serving loop off the disk;
* ``_history``: the bounded checkpoint history of caches that cannot be trimmed;
* ``_server``: ``promptstore serve``, mlx-lm's HTTP server with this cache.
* ``_speculative``: ``serve --draft-model``: speculative requests through verify rounds (hybrids too).

Checkpoint history. KV layers are stored as shared blocks, so the entries of
a growing conversation store each token's KV once; recurrent state (hybrid
models) cannot be shared, and every checkpoint carries all of it. So after
the writer thread commits an entry that cannot be trimmed, the entries of
the same model that are prefixes of it (its chain: the conversation so far)
are pruned: of those the serving cache wrote, the ``checkpoints`` longest
are kept (default :data:`DEFAULT_CHECKPOINTS`; the new entry is one of them)
and so is every system-prompt checkpoint; the superseded rest is deleted.
Pinned entries, trimmable entries and entries written by anyone else
(``promptstore put``, warm-up) are never touched; a conversation branching
off a shared prefix is pruned only by its own writes; the memory tier keeps
its own LRU. ``checkpoints=0`` keeps everything (``promptstore serve
--checkpoints 0``).
"""

from promptstore.serving._cache import PersistentPromptCache, model_identity
from promptstore.serving._history import DEFAULT_CHECKPOINTS

__all__ = ["PersistentPromptCache", "model_identity", "DEFAULT_CHECKPOINTS"]
