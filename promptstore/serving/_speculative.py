"""Speculative decoding inside mlx-lm's server, for hybrid (gated-DeltaNet) models too.

mlx-lm's server, given ``--draft-model``, serves every request alone
(``_serve_single``: a draft makes its model provider unbatchable) through
``stream_generate(..., draft_model=...)``, whose speculative step refuses a
cache that cannot trim (mlx-lm #1446), i.e. every hybrid. :func:`stream_generate`
here takes its place in the server: without a draft it is mlx-lm's own; with
one it runs :func:`promptstore.ssm.speculative.speculative_generate_step`, whose
gated-DeltaNet layers (SSMCache) take verify rounds instead of trim.

The server hands over one list: the target's layers, then the draft's. Their
gated-DeltaNet ``ArraysCache`` layers (a fresh cache, or one the persistent
cache handed out) are replaced, in that same list, by SSMCache covering what
the layers that can tell report, so the list the server inserts afterwards
holds the state that generation reached: the prompt and every token the
server took, the tokens it inserts the cache under. Both models absorb the
last token before it is yielded. The server may also stop in the middle of
a verify round (a stop string matched, a client gone, both after the token
that triggered them): dropping this generator closes the verify rounds'
generator, which resolves the open round to the tokens taken (rollback,
trim, window resolve; ``speculative_generate_step`` with ``absorb_last``),
so the cache covers exactly those tokens, as greedy decoding of them leaves
it.

Checkpoints: mlx-lm's ``_serve_single`` inserts only the prompt + answer. The
serving cache also gets the list once it covers the prompt but its last
token and where a batched request's segments end (the system prompt, the
messages): with a draft, both models' prefill pauses there
(``prefill_breaks``), so the list then covers exactly the system prompt, in
the target's layers and the draft's; without one, the prompt up to there is
prefilled before mlx-lm's ``stream_generate`` runs the rest. On a model whose
cache cannot be trimmed (hybrid, sliding window), whose entries match only
at their exact length, that checkpoint is what the next request with the
same system prompt and another conversation starts from, as it is for the
server's batched requests.

Sliding-window models (gemma3's RotatingKVCache layers) run too: a verify
round drops the ring's rejected tail for real (``promptstore.ssm._window``),
so greedy answers equal those without a draft, and the caches stored hold
what greedy decoding leaves, as the next forward sees them.

Refused with a draft (ValueError, which the server returns to the client):

* logits processors (repetition/presence penalties, logit bias): the verify
  rounds here do not apply them (each would need the window's tokens
  position by position);
* ``--kv-bits``: the verify rounds here do not quantize the cache;
* images (input embeddings): the draft model takes tokens only;
* ``num_draft_tokens`` < 1;
* cache layers whose kind can neither trim at any length, nor run verify
  rounds, nor drop a window's rejected tail (``kv.chunked``, ``kv.concat``,
  ``list``, a plain ``ArraysCache``) or whose class has no codec: refused
  before the first round, naming the layer, its class and kind;
* a draft whose sliding window has fewer rotating positions than
  ``num_draft_tokens - 1`` (a round's draft decodes would overwrite their
  own slots).

Requests are served one at a time (mlx-lm's server does so with any draft),
so per-row acceptance in a batch does not arise here.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, cast

import mlx.core as mx

from promptstore.codecs import layer_coverage
from promptstore.ssm import gated_delta_layers, make_prompt_cache, to_ssm
from promptstore.errors import PromptStoreError, UnknownStorageKind
from promptstore.ssm.speculative import SpeculativeStats, check_caches, speculative_generate_step

__all__ = ["DraftCounters", "make_stream_generate"]


class DraftCounters:
    """Totals of the speculative requests a server ran (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0

    def add(self, stats: SpeculativeStats) -> None:
        with self._lock:
            self.requests += 1
            self.rounds += stats.rounds
            self.drafted += stats.drafted
            self.accepted += stats.accepted

    def snapshot(self) -> Dict[str, Any]:
        """``{"speculative_requests", "draft_rounds", "draft_tokens",
        "accepted_draft_tokens", "acceptance"}`` (acceptance: accepted /
        drafted, 0.0 before any draft)."""
        with self._lock:
            return {
                "speculative_requests": self.requests,
                "draft_rounds": self.rounds,
                "draft_tokens": self.drafted,
                "accepted_draft_tokens": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            }


def make_stream_generate(mlx_stream_generate: Any, counters: DraftCounters,
                         checkpoint: Optional[Callable[[List[Any], int], None]] = None,
                         breaks: Optional[Callable[[], Sequence[int]]] = None) -> Any:
    """mlx-lm's ``stream_generate`` with speculative requests served here.

    mlx-lm's server calls it for the requests it serves one at a time (a
    draft model, a seed, ``--kv-bits``); its batched path does not.

    Args:
        mlx_stream_generate: mlx-lm's own function (requests without a draft).
        counters: receives each speculative request's rounds and acceptance.
        checkpoint: called with the server's cache list and the number of
            tokens of the prompt it was given (what follows the cached
            prefix) that the list covers: once it covers the prompt but its
            last token (what mlx-lm's batched path caches as the ``user``
            checkpoint, so a repeated prompt is a hit: on a hybrid model,
            whose prompt + answer entry cannot be trimmed back, the only
            one), and at each of ``breaks`` before that.
        breaks: the offsets into that prompt where the prefill pauses for
            ``checkpoint`` (e.g. the end of the system prompt, the
            checkpoint mlx-lm's batched path writes there); none by default.
            Without a draft, the prompt up to each is prefilled here, then
            mlx-lm's own prefill takes the rest (:func:`_plain`).
    """

    def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, draft_model=None, **kwargs):
        if draft_model is None:
            if checkpoint is not None and kwargs.get("input_embeddings") is None and kwargs.get("prompt_cache") is not None:
                return _plain(mlx_stream_generate, model, tokenizer, prompt, max_tokens, checkpoint,
                              () if breaks is None else breaks(), kwargs)
            return mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)
        return _speculative(model, tokenizer, prompt, max_tokens, draft_model, counters, checkpoint,
                            () if breaks is None else breaks(), **kwargs)

    return stream_generate


def _plain(mlx_stream_generate: Any, model: Any, tokenizer: Any, prompt: Any, max_tokens: int,
           checkpoint: Callable[[List[Any], int], None], breaks: Sequence[int],
           kwargs: Dict[str, Any]) -> Generator[Any, None, None]:
    """mlx-lm's ``stream_generate`` of a request without a draft, checkpointing
    its cache once it covers the prompt but its last token and, before that,
    at each of ``breaks`` inside the prompt (where its segments end: the
    system prompt, the messages), up to which it is prefilled here first, step by step as
    ``generate_step`` prefills (``prefill_step_size`` tokens a step, the
    cache quantized after each under ``--kv-bits``, evaluated), on the
    request's stream; mlx-lm's own prefill takes the rest. Without a break
    inside the prompt, with logits processors (penalties see the tokens
    ``generate_step`` prefilled itself), or under ``--kv-bits`` once the
    prompt reaches ``quantized_kv_start`` (:func:`_unquantized`), mlx-lm's alone. The server's
    progress callback is told the whole prompt's counts either way (the
    responses' ``prompt_tokens`` and ``prompt_tps``, which the server does
    not read, count what ``generate_step`` got)."""
    cache = kwargs["prompt_cache"]
    progress = kwargs.get("prompt_progress_callback")
    tokens: List[int] = []
    cut = 0
    if not isinstance(prompt, str) and not kwargs.get("logits_processors"):
        given = cast(List[Any], prompt.tolist()) if isinstance(prompt, mx.array) else prompt
        tokens = [int(t) for t in given]
        if _unquantized(cache, len(tokens) - 1, kwargs):
            for b in sorted({b for b in breaks if 0 < b < len(tokens) - 1}):
                if not cut and progress is not None:
                    progress(0, len(tokens))  # as generate_step starts
                _prefill(model, tokens[cut:b], cache, progress, cut, len(tokens), kwargs)
                checkpoint(cache, b)
                cut = b
    if cut:
        prompt = tokens[cut:]
    kwargs["prompt_progress_callback"] = _checkpointing(progress, cache, checkpoint, cut)
    yield from mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)


def _unquantized(cache: List[Any], n: int, kwargs: Dict[str, Any]) -> bool:
    """Whether prefilling ``n`` more tokens leaves every layer unquantized:
    under ``--kv-bits`` a layer is quantized after the prefill step that takes
    it to ``quantized_kv_start`` tokens, so a pause there would move that step,
    and what the rest of the prompt attends to."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    if kwargs.get("kv_bits") is None:
        return True
    start = kwargs.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START)
    return all(c.offset + n < start for c in cache if hasattr(c, "to_quantized"))


def _prefill(model: Any, tokens: List[int], cache: List[Any], progress: Optional[Callable[[int, int], None]],
             before: int, total: int, kwargs: Dict[str, Any]) -> None:
    """Run ``tokens`` through ``model`` into ``cache`` as ``generate_step``'s
    prefill loop does, reporting ``(before + done, total)`` after each step."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream, maybe_quantize_kv_cache, wired_limit

    step = int(kwargs.get("prefill_step_size") or 2048)
    quantize = {"quantized_kv_start": kwargs.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START),
                "kv_group_size": kwargs.get("kv_group_size", 64), "kv_bits": kwargs.get("kv_bits")}
    stream = kwargs.get("stream") or generation_stream
    with wired_limit(model, [cast(mx.Stream, stream)]), mx.stream(stream):  # as stream_generate runs generate_step
        done = 0
        while done < len(tokens):
            n = min(step, len(tokens) - done)
            model(mx.array(tokens[done:done + n])[None], cache=cache)
            if quantize.get("kv_bits") is not None:
                maybe_quantize_kv_cache(cache, **quantize)
            mx.eval([c.state for c in cache])
            done += n
            if progress is not None:
                progress(before + done, total)
            mx.clear_cache()


def _checkpointing(progress: Optional[Callable[[int, int], None]], cache: List[Any],
                   checkpoint: Callable[[List[Any], int], None], before: int = 0) -> Callable[[int, int], None]:
    """mlx-lm's prompt progress callback that also checkpoints ``cache`` when
    it reports all but the prompt's last token done: ``generate_step`` calls
    it after each prefill step, once the step's cache is evaluated (and
    quantized under ``--kv-bits``), before the last token is fed. ``before``:
    the prompt's tokens prefilled before ``generate_step`` got the rest,
    added to what it reports."""

    def report(done: int, total: int) -> None:
        if 0 < done == total - 1:
            checkpoint(cache, before + done)
        if progress is not None and (done or not before):  # (before, ...) was reported when it was reached
            progress(before + done, before + total)

    return report


#: Why a draft model and --kv-bits do not go together (per request, and at the server's start).
NO_QUANTIZED_KV = "speculative decoding does not quantize the KV cache: serve without --kv-bits"


def refusal(max_tokens: int, logits_processors: Any, kv_bits: Any, num_draft_tokens: int,
            input_embeddings: Any = None) -> Optional[str]:
    """Why a request cannot be served with a draft model, or None. The
    server asks before it answers (``_server``'s ``_serve_single``): raised
    from inside the generator, the reason reached only the server's log
    (the client had its 200 and then an empty answer)."""
    if max_tokens == 0:
        return "Maximum number of tokens must be non-zero (use -1 for no limit)."
    if logits_processors:
        return ("speculative decoding (promptstore serve --draft-model) takes no logits "
                "processors: drop repetition/presence penalties and logit bias from the request")
    if kv_bits is not None:
        return NO_QUANTIZED_KV
    if input_embeddings is not None:
        return "Speculative decoding does not support input embeddings."
    if num_draft_tokens < 1:
        return f"num_draft_tokens must be >= 1 with a draft model, got {num_draft_tokens}"
    return None


def window_refusal(draft_model: Any, num_draft_tokens: int) -> Optional[str]:
    """Why ``draft_model``'s sliding windows cannot run rounds of
    ``num_draft_tokens``, or None (:func:`check_caches` on a new cache of
    it). Asked with :func:`refusal`, before the request's 200."""
    try:
        check_caches([], make_prompt_cache(draft_model), num_draft_tokens)
    except PromptStoreError as err:  # a window too short, or a layer no round can run on
        return str(err)
    return None


def _speculative(model, tokenizer, prompt, max_tokens: int, draft_model, counters: DraftCounters,
                 checkpoint: Optional[Callable[[List[Any], int], None]], breaks: Sequence[int], *, prompt_cache: Optional[List[Any]] = None, sampler=None, logits_processors=None,
                 num_draft_tokens: int = 2, prefill_step_size: int = 2048, input_embeddings=None,
                 kv_bits=None, stream=None, **_ignored) -> Generator[Any, None, None]:
    """What mlx-lm's ``stream_generate`` yields, from verify rounds."""
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    why = refusal(max_tokens, logits_processors, kv_bits, num_draft_tokens, input_embeddings)
    if why is not None:
        raise ValueError(why)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if not isinstance(prompt, mx.array):
        prompt = mx.array(list(prompt))
    limit = sys.maxsize if max_tokens < 0 else max_tokens
    cache = prompt_cache if prompt_cache is not None else []
    n_target = len(model.layers)
    if prompt_cache is None or len(cache) <= n_target:
        raise ValueError("speculative decoding: the server's cache must hold the target's layers, then the draft's")
    target = _as_ssm(model, cache[:n_target])
    draft = _as_ssm(draft_model, cache[n_target:])
    try:
        check_caches(target, draft, num_draft_tokens)
    except UnknownStorageKind as err:  # not a ValueError: the server would not answer it as one
        raise ValueError(f"speculative decoding (promptstore serve --draft-model) cannot run on this cache: {err}") from err
    cache[:] = target + draft  # the list the server inserts afterwards

    stats = SpeculativeStats()
    steps = speculative_generate_step(
        prompt, model, draft_model, num_draft_tokens=num_draft_tokens, max_tokens=limit, sampler=sampler,
        prompt_cache=target, draft_cache=draft, prefill_step_size=prefill_step_size, stats=stats,
        stop_tokens=tokenizer.eos_token_ids, absorb_last=True,
        on_prefilled=None if checkpoint is None else lambda n: checkpoint(cache, n), prefill_breaks=breaks,
    )
    detokenizer = tokenizer.detokenizer
    try:
        tic = time.perf_counter()
        prompt_tps = 0.0
        token, logprobs, from_draft, n = 0, mx.zeros((0,)), False, -1  # set by the first step
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps = prompt.size / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if (n + 1) == max_tokens:
                break
            yield GenerationResponse(
                text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
                prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
                generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None,
            )
        detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
        )
    finally:
        steps.close()
        counters.add(stats)


def _as_ssm(model: Any, layers: List[Any]) -> List[Any]:
    """``layers`` (one model's part of the server's cache) with their
    gated-DeltaNet ArraysCache layers as SSMCache covering what the other
    layers report (0 for a fresh cache)."""
    flags = gated_delta_layers(model)
    if len(flags) != len(layers) or not any(flags):
        return list(layers)
    known = {c for c in (layer_coverage(x) for x, f in zip(layers, flags) if not f) if c is not None}
    if len(known) > 1:
        raise ValueError(f"speculative decoding: the cache's layers cover different numbers of tokens: {sorted(known)}")
    if not known and any(f and not x.empty() for x, f in zip(layers, flags)):
        raise ValueError("speculative decoding: no layer of the cache reports how many tokens it covers")
    return to_ssm(layers, known.pop() if known else 0, flags)
