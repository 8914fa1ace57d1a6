"""Run mlx-lm's own HTTP server with a PersistentPromptCache.

``mlx_lm.server.main()`` parses its options, then calls the module-level
``run(host, port, model_provider)``, which builds an ``LRUPromptCache``
itself and offers no way to pass one in. So, for the duration of ``main()``
only, ``mlx_lm.server.run`` is replaced by :func:`_run`, which does what
mlx-lm's ``run`` does with our cache instead, and flushes the cache when the
HTTP server stops. With a draft model (``--draft-model``), mlx-lm's server
serves requests one at a time through ``stream_generate``, whose speculative
step refuses hybrid caches; for the same duration ``mlx_lm.server.stream_generate``
is :func:`promptstore.serving._speculative.make_stream_generate`'s, which serves
them through verify rounds (requests without a draft still go to mlx-lm's
own). Nothing else of mlx-lm is changed. SIGTERM stops the
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from promptstore.codecs import codec_for_layer
from promptstore.errors import InvalidInput, PromptStoreError
from promptstore.jobs.prefill import encode_prompt
from promptstore.serving._cache import PersistentPromptCache, gated_by_config
from promptstore.serving._history import DEFAULT_CHECKPOINTS, checkpoint_limit
from promptstore.serving._speculative import NO_QUANTIZED_KV, DraftCounters, make_stream_generate, refusal, window_refusal
from promptstore.ssm import gated_delta_layers
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
        The cache's counters (:meth:`PersistentPromptCache.stats`) at exit,
        plus the speculative ones (:meth:`DraftCounters.snapshot`: requests,
        rounds, draft tokens, accepted draft tokens, acceptance; all 0
        without ``--draft-model``).

    Raises:
        InvalidInput: ``checkpoints`` is not None or an integer >= 0 (before
            anything is loaded).

    Must run in the main thread (it installs a SIGTERM handler).
    """
    keep = checkpoint_limit(checkpoints)
    from mlx_lm import server as mlx_server

    out: Dict[str, Any] = stats if stats is not None else {}
    argv = ["mlx_lm.server", "--model", str(model_dir), *server_args]

    counters = DraftCounters()

    def run(host: str, port: int, model_provider, *args, **kwargs) -> None:
        _run(mlx_server, host, port, model_provider, store, out, keep, counters)

    saved_run, saved_argv, saved_stream = mlx_server.run, sys.argv, mlx_server.stream_generate
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
        mlx_server.run, sys.argv, mlx_server.stream_generate = saved_run, saved_argv, saved_stream
        signal.signal(signal.SIGTERM, saved_term)
        out.update(counters.snapshot())
    return out


class _Parsed(Exception):
    """mlx_lm.server's parser accepted the arguments (ends the dry parse)."""


class _Refused(Exception):
    """mlx_lm.server's parser refused the arguments: argparse's message."""


def check_server_args(model_dir: str, server_args: Sequence[str]) -> Optional[Dict[str, Any]]:
    """Parse ``server_args`` as ``mlx_lm.server`` will, loading nothing, so
    that a caller can refuse them before it opens a store or a model; the
    tokenizer config the server will load the tokenizer with (None with ``--help``).

    mlx-lm builds its parser inside ``main()``: that runs here with
    argparse's ``parse_args`` ending it once parsed and ``error`` raising
    instead of printing the usage and exiting. ``--help`` is left to the
    real run.

    Raises:
        InvalidInput: argparse's message (an unknown option, a bad value).
    """
    import argparse

    from mlx_lm import server as mlx_server

    if "-h" in server_args or "--help" in server_args:
        return None
    real_parse, real_error, saved_argv = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.error, sys.argv

    def parse_args(self, *args, **kwargs):
        raise _Parsed(real_parse(self, *args, **kwargs))

    def error(self, message):
        raise _Refused(message)

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]  # restored below
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    sys.argv = ["mlx_lm.server", "--model", str(model_dir), *server_args]
    try:
        mlx_server.main()
    except _Parsed as parsed:
        args = parsed.args[0]
        port = getattr(args, "port", None)
        if isinstance(port, int) and not 0 <= port <= 65535:  # argparse takes any int; the socket would not
            raise InvalidInput(f"mlx_lm.server refuses its options: --port {port} is not a TCP port (0-65535)") from None
        step = getattr(args, "prefill_step_size", None)
        if isinstance(step, int) and step < 1:  # argparse takes any int; every request would then loop or fail
            raise InvalidInput(f"mlx_lm.server refuses its options: --prefill-step-size {step} must be at least 1") from None
        if getattr(args, "draft_model", None) and getattr(args, "kv_bits", None) is not None:  # every request would be refused
            raise InvalidInput(f"--draft-model and --kv-bits: {NO_QUANTIZED_KV}") from None
        config: Dict[str, Any] = {"trust_remote_code": bool(getattr(args, "trust_remote_code", False))}  # as its ModelProvider
        if getattr(args, "chat_template", None):
            config["chat_template"] = args.chat_template
        return config
    except _Refused as err:
        raise InvalidInput(f"mlx_lm.server refuses its options: {err}") from None
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.error = real_parse, real_error  # type: ignore[method-assign]
        sys.argv = saved_argv
    return None  # its main() parsed nothing


def _run(mlx_server, host: str, port: int, model_provider, store: Optional[PromptStore], out: Dict[str, Any],
         checkpoints: int = DEFAULT_CHECKPOINTS, counters: Optional[DraftCounters] = None) -> None:
    """mlx-lm's ``run`` with a PersistentPromptCache in place of LRUPromptCache
    (and, inside it, speculative requests served by our ``stream_generate``)."""
    import mlx.core as mx

    cli = model_provider.cli_args
    cache = PersistentPromptCache(store, max_size=cli.prompt_cache_size, max_bytes=cli.prompt_cache_bytes,
                                  checkpoints=checkpoints, gated_layers=_gated_layers(model_provider))
    log.info("promptstore: persistent prompt cache in %s (checkpoint history: %s)", cache.store.path,
             cache.checkpoints or "unbounded")
    fetches = _Fetches(cache)
    mlx_server.stream_generate = make_stream_generate(
        mlx_server.stream_generate, counters if counters is not None else DraftCounters(), fetches.checkpoint,
        fetches.breaks,
    )
    try:
        group = mx.distributed.init()
        generator = _generator_class(mlx_server)(model_provider, fetches)
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


class _Fetches:
    """The PersistentPromptCache as the server sees it, remembering on each
    thread the model key, prompt and cached prefix of its last
    ``fetch_nearest_cache``, and where that prompt's segments end, so
    that a request served alone can checkpoint its prompt and where its
    segments end, as a batched one is (mlx-lm's ``_serve_single`` caches
    only prompt + answer)."""

    def __init__(self, cache: PersistentPromptCache):
        self._cache = cache
        self._last = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __len__(self) -> int:
        return len(self._cache)

    def note_segments(self, prompt: List[int], segments: List[List[int]], types: List[str]) -> None:
        """``prompt`` (about to be fetched) splits into ``segments`` of
        ``types``, as mlx-lm's batched path checkpoints it: at the end of each
        but the last, typed as the segment that ends there, and the prompt but
        its last token, typed as the last segment."""
        ends, n = {}, 0
        for seg, kind in zip(segments[:-1], types):
            n += len(seg)
            ends[n] = kind
        self._last.segments = (list(prompt), ends, types[-1] if types else "assistant")

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        toks = list(tokens)
        cache, rest = self._cache.fetch_nearest_cache(model, toks)
        noted = getattr(self._last, "segments", None)
        self._last.segments = None
        ends, last = (noted[1], noted[2]) if noted is not None and noted[0] == toks else ({}, "assistant")
        self._last.query = (model, toks, len(toks) - len(rest), ends, last)
        return cache, rest

    def breaks(self) -> List[int]:
        """Where, in what the last fetch left to process, its segments end."""
        query = getattr(self._last, "query", None)
        return [] if query is None else sorted(n - query[2] for n in query[3] if n > query[2])

    def checkpoint(self, layers: List[Any], done: int) -> None:
        """Insert ``layers``, covering ``done`` tokens past the last fetch's
        cached prefix, typed as mlx-lm's batched path types a checkpoint
        there (:meth:`note_segments`; a prompt whose segments were not noted,
        as one segment of type ``assistant``); refused, logged, if they cover
        other."""
        query = getattr(self._last, "query", None)
        if query is None:
            return
        model, toks, cached, ends, last = query
        n = cached + done
        if 0 < n < len(toks):
            self._cache.insert_cache(model, toks[:n], layers, cache_type=ends.get(n, last))


def _gated_layers(model_provider) -> Callable[[Any], Union[None, bool, Sequence[bool]]]:
    """The gated-DeltaNet layers of the caches of a model key, asked of the
    models the server has loaded (the target's layers, then the draft's);
    for another key, from the model directories' config."""

    def flags(key: Any) -> Union[None, bool, Sequence[bool]]:
        model = model_provider.model
        if model is None or key != model_provider.model_key:
            return gated_by_config(key)
        out = gated_delta_layers(model)
        if model_provider.draft_model is not None:
            out += gated_delta_layers(model_provider.draft_model)
        return out

    return flags


def _generator_class(mlx_server):
    """mlx-lm's ResponseGenerator whose generation thread frees its mlx streams
    when it ends: a thread's stream left alive aborts the process at exit
    ("terminate called without an active exception"; mlx-lm's own server
    does that on Ctrl-C with mlx 0.32); and which, for a model whose cache
    cannot always be trimmed (hybrid), checkpoints a chat at the end of its
    messages too (:func:`split_at_messages_end`); and which refuses an empty
    prompt as the request's error (mlx-lm 0.32's BatchGenerator raised on it
    in the generation thread, which then served no request again)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    class ResponseGenerator(mlx_server.ResponseGenerator):
        def _run_generate(self):
            try:
                super()._run_generate()
            finally:
                if hasattr(mx, "clear_streams"):
                    mx.clear_streams()

        def _serve_single(self, request, stream):
            rqueue, _, args = request
            if self.model_provider.draft_model is not None:
                why = refusal(args.max_tokens, mlx_server._make_logits_processors(args), self.cli_args.kv_bits,
                              args.num_draft_tokens) or window_refusal(self.model_provider.draft_model, args.num_draft_tokens)
                if why is not None:  # answered before the request's 200, as mlx-lm's own errors are
                    rqueue.put(ValueError(why))
                    return
            super()._serve_single(request, stream)

        def _tokenize(self, tokenizer, request, args):
            prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            if not prompt:  # mlx-lm's batch would raise on it outside any try: its generation thread died
                raise ValueError("the prompt is empty: there is nothing to generate from")
            trimmable = self._always_trimmable()
            if request.request_type == "chat" and vision is None and not trimmable:
                segments, types = split_at_messages_end(tokenizer, request.messages, prompt, segments, types)
            if isinstance(self.prompt_cache, _Fetches):  # for _serve_single, which drops them
                # a cache that trims needs no checkpoint inside the prompt: only the last type is noted
                self.prompt_cache.note_segments(prompt, [prompt] if trimmable else segments, types[-1:] if trimmable else types)
            return prompt, segments, types, state, vision

        def _always_trimmable(self) -> bool:
            provider = self.model_provider
            known = getattr(self, "_ps_trimmable", None)
            if known is None or known[0] != provider.model_key:
                cache = make_prompt_cache(provider.model) if provider.model is not None else []
                if provider.draft_model is not None:  # the key's caches hold the draft's layers too
                    cache += make_prompt_cache(provider.draft_model)
                known = self._ps_trimmable = (provider.model_key, _always_trimmable(cache))
            return known[1]

    return ResponseGenerator


def _always_trimmable(cache: List[Any]) -> bool:
    """Every layer's exact-class codec trims at any length (False for an
    unregistered class: fail closed, which only adds a checkpoint)."""
    try:
        return all(codec_for_layer(c).always_trimmable for c in cache)
    except PromptStoreError:
        return False


def split_at_messages_end(tokenizer: Any, messages: List[Any], prompt: List[int], segments: List[List[int]],
                          types: List[str]) -> Tuple[List[List[int]], List[str]]:
    """mlx-lm's prompt segments with the ``user`` segment that spans the end
    of the messages (the chat templated without a generation prompt, as
    ``promptstore get/put --messages`` encode it) cut there, so the server
    checkpoints that boundary too. mlx-lm checkpoints the end of each segment
    but the last, and the prompt but its last token: for a cache that cannot
    be trimmed (hybrid), neither is what ``get --messages`` of the same chat
    asks for. Unchanged when the messages' tokens are not a prefix of the
    prompt (tools, template arguments) or end at a boundary already.
    """
    try:
        end_tokens = encode_prompt(tokenizer, None, messages)
    except Exception:  # a template that refuses them unprompted: no extra checkpoint
        return segments, types
    end = len(end_tokens)
    if not 0 < end < len(prompt) - 1 or list(prompt[:end]) != end_tokens:
        return segments, types
    start = 0
    for i, seg in enumerate(segments):
        if start < end < start + len(seg):
            if types[i] != "user":
                break
            cut = end - start
            return segments[:i] + [seg[:cut], seg[cut:]] + segments[i + 1:], types[:i] + ["user", "user"] + types[i + 1:]
        start += len(seg)
    return segments, types
