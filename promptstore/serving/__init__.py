"""Serving: a persistent prompt cache for mlx-lm's server and custom serving loops.

* ``_cache``: :class:`PersistentPromptCache`, mlx-lm's ``LRUPromptCache`` interface over the store;
* ``_memory``: the in-memory LRU tier (zero-copy views of live caches);
* ``_writer``: the background writer that keeps the serving loop off the disk;
* ``_server``: ``promptstore serve``, mlx-lm's HTTP server with this cache.
"""

from promptstore.serving._cache import PersistentPromptCache, model_identity

__all__ = ["PersistentPromptCache", "model_identity"]
