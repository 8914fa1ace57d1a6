"""Run mlx-lm's own HTTP server with a PersistentPromptCache.

``mlx_lm.server.main()`` parses its options, then calls the module-level
``run(host, port, model_provider)``, which builds an ``LRUPromptCache``
itself and offers no way to pass one in. So, for the duration of ``main()``
only, ``mlx_lm.server.run`` is replaced by :func:`_run`, which does what
mlx-lm's ``run`` does with our cache instead, and flushes the cache when the
HTTP server stops. Nothing else of mlx-lm is changed. SIGTERM stops the
server the way Ctrl-C does (mlx-lm handles KeyboardInterrupt by shutting the
HTTP server down and joining its generation thread), so pending writes are
committed before the process exits. SIGKILL loses only the writes not yet
committed; LMDB never exposes a partial entry.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Dict, Optional, Sequence

from promptstore.serving._cache import PersistentPromptCache
from promptstore.serving._history import DEFAULT_CHECKPOINTS, checkpoint_limit
from promptstore.store import PromptStore

__all__ = ["serve"]

log = logging.getLogger("promptstore")


def serve(model_dir: str, server_args: Sequence[str] = (), store: Optional[PromptStore] = None,
          stats: Optional[Dict[str, Any]] = None, checkpoints: Optional[int] = DEFAULT_CHECKPOINTS) -> Dict[str, Any]:
    """Run ``mlx_lm.server`` on ``model_dir`` with a persistent prompt cache until stopped.

    Args:
        model_dir: the mlx-lm model directory (its fingerprint keys the entries).
        server_args: further ``mlx_lm.server`` options (``--port``, ``--host``,
            ``--prompt-cache-size``, ``--prompt-cache-bytes``, ...).
        store: the PromptStore (None: the default store).
        stats: a dict that receives the cache's counters on exit.
        checkpoints: the checkpoint history kept per conversation of a model
            whose cache cannot be trimmed (see :class:`PersistentPromptCache`);
            0 or None keeps every checkpoint.

    Returns:
        The cache's counters (:meth:`PersistentPromptCache.stats`) at exit.

    Raises:
        InvalidInput: ``checkpoints`` is not None or an integer >= 0 (before
            anything is loaded).

    Must run in the main thread (it installs a SIGTERM handler).
    """
    keep = checkpoint_limit(checkpoints)
    from mlx_lm import server as mlx_server

    out: Dict[str, Any] = stats if stats is not None else {}
    argv = ["mlx_lm.server", "--model", str(model_dir), *server_args]

    def run(host: str, port: int, model_provider, *args, **kwargs) -> None:
        _run(mlx_server, host, port, model_provider, store, out, keep)

    saved_run, saved_argv = mlx_server.run, sys.argv
    stopping = threading.Event()

    def on_term(signum, frame):
        if stopping.is_set():
            log.warning("promptstore: already stopping; committing pending prompt caches")
            return
        stopping.set()
        raise KeyboardInterrupt

    saved_term = signal.signal(signal.SIGTERM, on_term)
    mlx_server.run, sys.argv = run, argv
    try:
        mlx_server.main()
    except KeyboardInterrupt:  # before the HTTP server ran (e.g. during model load)
        pass
    finally:
        mlx_server.run, sys.argv = saved_run, saved_argv
        signal.signal(signal.SIGTERM, saved_term)
    return out


def _run(mlx_server, host: str, port: int, model_provider, store: Optional[PromptStore], out: Dict[str, Any],
         checkpoints: int = DEFAULT_CHECKPOINTS) -> None:
    """mlx-lm's ``run`` with a PersistentPromptCache in place of LRUPromptCache."""
    import mlx.core as mx

    cli = model_provider.cli_args
    cache = PersistentPromptCache(store, max_size=cli.prompt_cache_size, max_bytes=cli.prompt_cache_bytes,
                                  checkpoints=checkpoints)
    log.info("promptstore: persistent prompt cache in %s (checkpoint history: %s)", cache.store.path,
             cache.checkpoints or "unbounded")
    try:
        group = mx.distributed.init()
        generator = _generator_class(mlx_server)(model_provider, cache)
        try:
            if group.rank() == 0:
                mlx_server._run_http_server(host, port, generator)
            else:
                generator.join()
        finally:
            generator.stop_and_join()  # no insert_cache may race the final flush
    finally:
        cache.close()
        out.update(cache.stats())
        log.info("promptstore: prompt cache closed: %s", out)


def _generator_class(mlx_server):
    """mlx-lm's ResponseGenerator whose generation thread frees its mlx streams
    when it ends: a thread's stream left alive aborts the process at exit
    ("terminate called without an active exception"; mlx-lm's own server
    does that on Ctrl-C with mlx 0.32)."""
    import mlx.core as mx

    class ResponseGenerator(mlx_server.ResponseGenerator):
        def _run_generate(self):
            try:
                super()._run_generate()
            finally:
                if hasattr(mx, "clear_streams"):
                    mx.clear_streams()

    return ResponseGenerator
