"""Speculative decoding with a draft model, for hybrid (gated-DeltaNet) models too.

mlx-lm refuses speculative decoding on Qwen3-Next / Qwen3.5 because their
recurrent layers cannot ``trim`` (mlx-lm #1446). Here every layer that cannot
trim is an :class:`~promptstore.ssm.SSMCache` and takes part in verify rounds:
``begin_round()`` before the forward whose tokens may be rejected, then
``commit()`` or ``rollback(keep)``. Sliding windows (RotatingKVCache), which
stop being trimmable once they wrap, take a
:class:`~promptstore.ssm._window.WindowRound` that drops the rejected positions
from the ring for real. Layers trimmable at any length (KVCache...) are
trimmed as in mlx-lm. The target model verifies ``num_draft + 1`` tokens in
one window; the draft model records its own decode steps in a round of its own.

Invariant: when the generator is exhausted, both caches cover the prompt and
every yielded token but the last (the same state plain generation leaves);
with ``absorb_last=True`` the last one too (what mlx-lm's ``generate_step``
leaves once its consumer stops: its pipeline has fed every token it
yielded). Generation ends at ``max_tokens`` or after the first of
``stop_tokens``. A consumer that stops early and closes the generator
(``close()``, or dropping it) leaves them covering the prompt and the tokens
it took, but the last one without ``absorb_last``: a round's caches stay
open while its tokens are yielded, and the close resolves them to the count
taken (rollback, trim, window resolve), then feeds what the rounds do not
hold (the target's correction token, the draft's last ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Generator, List, Optional, Tuple, cast

import mlx.core as mx
import mlx.nn as nn

from promptstore.codecs import codec_for_layer
from promptstore.errors import InvalidInput
from promptstore.ssm._cache import adapt, make_prompt_cache
from promptstore.ssm._window import WindowRound, check_window, runs_window_rounds

__all__ = ["SpeculativeStats", "SpeculativeResult", "check_caches", "speculative_generate_step", "speculative_generate"]

Sampler = Callable[[mx.array], mx.array]


@dataclass
class SpeculativeStats:
    """Running counts of one speculative generation (updated in place)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    per_round: List[Tuple[int, int]] = field(default_factory=list)  # (drafted, accepted)

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True)
class SpeculativeResult:
    """What :func:`speculative_generate` produced."""

    tokens: List[int]
    from_draft: List[bool]
    rounds: int
    drafted: int
    accepted: int
    per_round: Tuple[Tuple[int, int], ...]  # (drafted, accepted) per round

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _check_cache(cache: List[Any], which: str) -> None:
    """Every layer's exact-class codec must trim at any length or run rounds,
    or its kind take window rounds (:mod:`promptstore.ssm._window`).

    Raises:
        UnknownStorageKind: a layer's exact class has no codec (a subclass of
            SSMCache included: its extra state would escape the rounds).
        InvalidInput: a layer's kind can do none of these.
    """
    for i, c in enumerate(cache):
        codec = codec_for_layer(c)
        if not (codec.always_trimmable or codec.rounds or runs_window_rounds(c)):
            raise InvalidInput(
                f"speculative decoding: layer {i} of the {which} cache is a "
                f"{type(c).__name__} (kind {codec.kind!r}), which can neither always trim, nor run "
                "verify rounds, nor drop a sliding window's rejected tail; build the cache with "
                "promptstore.ssm.make_prompt_cache(model)"
            )


def check_caches(model_cache: List[Any], draft_cache: List[Any], num_draft_tokens: int) -> None:
    """Refuse, before any round, caches that speculative decoding cannot run on.

    Raises:
        UnknownStorageKind: a layer's exact class has no codec.
        InvalidInput: a layer's kind can neither always trim, nor run verify
            rounds, nor drop a sliding window's rejected tail; or a draft
            layer's window is shorter than a round's draft decodes.
    """
    _check_cache(model_cache, "model")
    _check_cache(draft_cache, "draft")
    for i, c in enumerate(draft_cache):
        if runs_window_rounds(c):
            check_window(c, num_draft_tokens - 1, f"layer {i} of the draft cache")


#: Per layer of a cache in a round: its WindowRound, or None (it trims or runs SSM rounds).
Windows = List[Optional[WindowRound]]


def _begin(cache: List[Any]) -> Windows:
    windows: Windows = []
    for c in cache:
        codec = codec_for_layer(c)
        if codec.rounds:
            c.begin_round()
        windows.append(WindowRound(c) if runs_window_rounds(c) else None)
    return windows


def _record(windows: Windows) -> None:
    """After each single-position forward of a round (the draft's decodes)."""
    for w in windows:
        if w is not None:
            w.record()


def _resolve(cache: List[Any], windows: Windows, recorded: int, keep: int) -> None:
    """Keep the first ``keep`` of ``recorded`` positions of the round."""
    for c, w in zip(cache, windows):
        if w is not None:
            w.resolve(recorded, keep)
        elif not codec_for_layer(c).rounds:
            if recorded > keep:
                c.trim(recorded - keep)
        elif keep == recorded:
            c.commit()
        else:
            c.rollback(keep)


class _OpenRound:
    """A verified round whose caches are not resolved yet.

    Before the round the target covers what precedes its window's first
    token ``y``; the draft covers ``y`` too. The window holds ``y`` and the
    drafts, of which the first ``accepted`` equal the round's first tokens;
    the draft's round recorded its decodes of the first ``num_draft - 1``
    drafts. Covering ``c`` of the round's tokens (``y``, then ``tokens[:c]``)
    keeps those of them the rounds hold and feeds the rest (at most one to the
    target, two to the draft), so the caches end bit for bit where decoding
    the same tokens one by one would (on backends whose kernels do not depend
    on the call's shape).
    """

    def __init__(self, model: nn.Module, draft_model: nn.Module, model_cache: List[Any], draft_cache: List[Any],
                 model_windows: Windows, draft_windows: Windows, num_draft: int, accepted: int,
                 tokens: List[int]) -> None:
        self._models = (model, draft_model)
        self._caches = (model_cache, draft_cache)
        self._windows = (model_windows, draft_windows)
        self._num_draft = num_draft
        self._accepted = accepted
        self._tokens = tokens
        self.model_has: Optional[int] = None  # of the round's tokens, once resolved
        self.draft_has = 0

    def resolve(self, c: int) -> None:
        """Close both rounds keeping what they hold of ``tokens[:c]`` (once)."""
        if self.model_has is not None:
            return
        self.model_has = min(c, self._accepted)
        self.draft_has = min(self.model_has, self._num_draft - 1)
        _resolve(self._caches[0], self._windows[0], self._num_draft + 1, 1 + self.model_has)
        _resolve(self._caches[1], self._windows[1], self._num_draft - 1, self.draft_has)

    def settle(self, c: int) -> None:
        """Leave both caches covering ``y`` and ``tokens[:c]`` (``c`` at least
        what :meth:`resolve` kept)."""
        self.resolve(c)
        for i, has in enumerate((self.model_has or 0, self.draft_has)):
            if has < c:
                self._models[i](mx.array(self._tokens[has:c], mx.uint32)[None], cache=self._caches[i])
        self.model_has = self.draft_has = c
        mx.eval([x.state for x in self._caches[0] + self._caches[1]])


def _prefill(model: nn.Module, cache: List[Any], y: mx.array, step: int) -> None:
    """Process ``y``, at most ``step`` tokens a forward."""
    for i in range(0, y.size, step):
        model(y[i : i + step][None], cache=cache)
        mx.eval([c.state for c in cache])


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    prompt_cache: Optional[List[Any]] = None,
    draft_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    stats: Optional[SpeculativeStats] = None,
    stop_tokens: Optional[Collection[int]] = None,
    absorb_last: bool = False,
    on_prefilled: Optional[Callable[[int], None]] = None,
    prefill_breaks: Collection[int] = (),
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Generate tokens speculatively; mlx-lm's ``speculative_generate_step`` contract.

    Both models are adapted (:func:`promptstore.ssm.adapt`, bit-identical) so
    their gated-DeltaNet layers can run verify rounds.

    Args:
        prompt: the prompt token ids (1-D), processed on top of the caches.
        model, draft_model: the target and the draft model (same tokenizer).
        num_draft_tokens: tokens drafted per round (>= 1).
        max_tokens: tokens to generate.
        sampler: maps log-probabilities to tokens; greedy (argmax) by default.
            A draft token is accepted when the sampled target token equals it.
        prompt_cache, draft_cache: caches to continue and update in place;
            fresh ones from :func:`promptstore.ssm.make_prompt_cache` by default.
        prefill_step_size: prompt tokens per prefill forward (>= 1).
        stats: filled with round, drafted and accepted counts as generation runs.
        stop_tokens: token ids (e.g. EOS) that end generation: the round that
            produces one yields up to and including it, and its caches keep
            no position past it.
        absorb_last: before the last token is yielded, feed it to both
            models, so that at the end (or once the consumer closes the
            generator after any token) both caches cover the prompt and every
            yielded token (a serving loop stores them under exactly those
            tokens).
        on_prefilled: called with the number of prompt tokens both caches
            cover, once they cover the prompt but its last token (e.g. to
            checkpoint them), before the first round; and at each of
            ``prefill_breaks`` before that.
        prefill_breaks: prompt offsets ``0 < b < len(prompt) - 1`` where
            both models' prefill pauses (a forward ends there) for
            ``on_prefilled`` (e.g. the end of a system prompt); others are
            ignored.

    Yields:
        ``(token, logprobs, from_draft)`` per generated token.

    Raises:
        InvalidInput: a bad argument, or a cache layer that can neither trim nor
            run verify rounds.
        UnknownStorageKind: a cache layer's exact class has no codec.
    """
    if num_draft_tokens < 1:
        raise InvalidInput(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if prefill_step_size < 1:
        raise InvalidInput(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    if prompt.size == 0:
        raise InvalidInput("speculative decoding needs at least one prompt token")
    adapt(model)
    adapt(draft_model)
    model_cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    draft_cache = draft_cache if draft_cache is not None else make_prompt_cache(draft_model)
    check_caches(model_cache, draft_cache, num_draft_tokens)
    sampler = sampler or _greedy
    stats = stats if stats is not None else SpeculativeStats()
    stop = frozenset(stop_tokens or ())

    def sample(logits: mx.array) -> Tuple[mx.array, mx.array]:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs

    prompt = prompt.astype(mx.uint32)
    start = 0
    for end in sorted({b for b in prefill_breaks if 0 < b < prompt.size - 1}) + [prompt.size - 1]:
        _prefill(draft_model, draft_cache, prompt[start:end], prefill_step_size)
        _prefill(model, model_cache, prompt[start:end], prefill_step_size)
        start = end
        if on_prefilled is not None:
            on_prefilled(end)
    draft_y = y = prompt[start:]

    ntoks = 0
    while ntoks < max_tokens:
        num_draft = min(max_tokens - ntoks, num_draft_tokens)

        # Draft: the first step consumes confirmed tokens; the rest are recorded.
        drafts: List[mx.array] = []
        d, _ = sample(draft_model(draft_y[None], cache=draft_cache)[:, -1])
        drafts.append(d.reshape(1))
        draft_windows = _begin(draft_cache)
        for _ in range(num_draft - 1):
            d, _ = sample(draft_model(drafts[-1][None], cache=draft_cache)[:, -1])
            drafts.append(d.reshape(1))
            _record(draft_windows)
        draft_arr = mx.concatenate(drafts)

        # Verify all drafts in one window.
        model_windows = _begin(model_cache)
        window = mx.concatenate([y, draft_arr.astype(mx.uint32)])
        target, logprobs = sample(model(window[None], cache=model_cache)[0])
        mx.eval(target, draft_arr)
        # 1-D arrays: tolist() gives a flat list of ints
        tokens, draft_list = cast(List[int], target.tolist()), cast(List[int], draft_arr.tolist())

        n = 0
        while n < num_draft and tokens[n] == draft_list[n]:
            n += 1
        emit = min(n + 1, max_tokens - ntoks)
        stop_at = next((j for j in range(emit) if tokens[j] in stop), None)
        if stop_at is not None:
            emit = stop_at + 1
        final = stop_at is not None or ntoks + emit == max_tokens
        stats.rounds += 1
        stats.drafted += num_draft
        stats.accepted += n
        stats.per_round.append((num_draft, n))

        # The round stays open while its tokens are yielded, so that a consumer
        # that stops after any of them leaves the caches covering what it took.
        rnd = _OpenRound(model, draft_model, model_cache, draft_cache, model_windows, draft_windows,
                         num_draft, n, tokens[:emit])
        for j in range(emit):
            if j == emit - 1 and final:
                rnd.settle(emit if absorb_last else emit - 1)
            elif j == emit - 1:
                rnd.resolve(emit - 1)  # the draft's missing tokens go with its next step
            ntoks += 1
            try:
                yield tokens[j], logprobs[j], j < n
            except GeneratorExit:
                rnd.settle(j + 1 if absorb_last else j)
                raise
        if final:
            return
        y = mx.array(tokens[emit - 1 : emit], mx.uint32)
        draft_y = mx.array(tokens[rnd.draft_has : emit], mx.uint32)


def speculative_generate(
    model: nn.Module,
    draft_model: nn.Module,
    prompt,
    *,
    max_tokens: int = 256,
    num_draft_tokens: int = 2,
    **kwargs,
) -> SpeculativeResult:
    """Run :func:`speculative_generate_step` to the end and report acceptance.

    Args:
        prompt: token ids (list or mx.array).
        kwargs: passed on (sampler, prompt_cache, draft_cache, prefill_step_size).

    Returns:
        The tokens, which of them came from the draft, and the round counts.
    """
    stats = SpeculativeStats()
    prompt = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt))
    tokens, from_draft = [], []
    for token, _, drafted in speculative_generate_step(
        prompt,
        model,
        draft_model,
        num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens,
        stats=stats,
        **kwargs,
    ):
        tokens.append(token)
        from_draft.append(drafted)
    return SpeculativeResult(
        tokens, from_draft, stats.rounds, stats.drafted, stats.accepted, tuple(stats.per_round)
    )
