"""Speculative decoding on hybrid models equals greedy decoding, token for token."""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step, speculative_generate_step as mlx_speculative_generate_step
from mlx_lm.models.cache import ChunkedKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from promptstore.errors import InvalidInput
from promptstore.ssm.speculative import SpeculativeStats, speculative_generate, speculative_generate_step
from promptstore.ssm import SSMCache, make_prompt_cache
from _bits import bits_equal
from conftest import MODELS

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HYBRIDS = ("qwen3_next", "qwen3_5")
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
MAX_TOKENS = 24


@functools.lru_cache(maxsize=None)
def noisy_draft(arch: str):
    """The target's architecture with the target's weights plus seeded noise,
    so it agrees with the target only sometimes."""
    draft, _ = load(str(MODELS / arch))
    mx.random.seed(7)
    noisy = [
        (k, v + 0.05 * mx.random.normal(v.shape).astype(v.dtype) * mx.abs(v).mean() if v.ndim >= 2 else v)
        for k, v in tree_flatten(draft.parameters())
    ]
    draft.load_weights(noisy)
    return draft


@functools.lru_cache(maxsize=None)
def models(arch: str):
    """(plain reference, target, draft): the draft is :func:`noisy_draft`."""
    plain, _ = load(str(MODELS / arch))
    target, _ = load(str(MODELS / arch))
    return plain, target, noisy_draft(arch)


@functools.lru_cache(maxsize=None)
def greedy_reference(arch: str):
    plain = models(arch)[0]
    return [t for t, _ in generate_step(mx.array(PROMPT), plain, max_tokens=MAX_TOKENS)]


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_equals_greedy(arch, k):
    _, target, draft = models(arch)
    result = speculative_generate(target, draft, PROMPT, max_tokens=MAX_TOKENS, num_draft_tokens=k)
    assert result.tokens == greedy_reference(arch)
    # the draft sometimes agrees and sometimes not, so rollbacks of every kind ran
    accepted = [n for _, n in result.per_round]
    assert 0 in accepted and any(n > 0 for n in accepted)
    assert 0 < result.acceptance < 1
    assert sum(result.from_draft) == min(result.accepted, MAX_TOKENS)
    assert result.drafted == sum(d for d, _ in result.per_round)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_rounds_cover_partial_and_full_accepts(arch):
    _, target, draft = models(arch)
    seen = set()
    for k in (2, 3, 4):
        result = speculative_generate(target, draft, PROMPT, max_tokens=MAX_TOKENS, num_draft_tokens=k)
        seen |= {"partial" if 0 < n < d else "full" if n == d else "none" for d, n in result.per_round}
    assert seen == {"none", "partial", "full"}


@pytest.mark.shape_dependent
def test_caches_cover_prompt_and_tokens_but_the_last():
    _, target, draft = models("qwen3_5")
    cache, dcache = make_prompt_cache(target), make_prompt_cache(draft)
    stats = SpeculativeStats()
    tokens = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array(PROMPT), target, draft, num_draft_tokens=3, max_tokens=MAX_TOKENS,
            prompt_cache=cache, draft_cache=dcache, stats=stats,
        )
    ]
    assert tokens == greedy_reference("qwen3_5") and stats.rounds == len(stats.per_round) > 0
    covered = len(PROMPT) + len(tokens) - 1
    assert [c.offset for c in cache] == [covered] * 4 and [c.offset for c in dcache] == [covered] * 4
    assert not any(c.in_round for c in cache + dcache if isinstance(c, SSMCache))
    # continuing from the speculative caches equals continuing the greedy run
    plain = models("qwen3_5")[0]
    ref = mlx_make_prompt_cache(plain)
    plain(mx.array([PROMPT + tokens[:-1]]), cache=ref)
    last = mx.array([[tokens[-1]]])
    assert bits_equal(target(last, cache=cache), plain(last, cache=ref)).item()


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
def test_stop_tokens_and_absorb_last_leave_caches_over_every_yielded_token(arch):
    """What a serving loop needs: generation ends at the first stop token, and
    the caches cover the prompt and every yielded token (the last one too).
    ``on_prefilled`` sees both caches at each prefill break (4: the others are
    outside the prompt but its last token) and at the prompt but its last token."""
    plain, target, draft = models(arch)
    ref = greedy_reference(arch)
    k = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    for stop, want in (({ref[k]}, ref[: k + 1]), (None, ref)):
        cache, dcache = make_prompt_cache(target), make_prompt_cache(draft)
        prefilled = []
        tokens = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(PROMPT), target, draft, num_draft_tokens=3, max_tokens=MAX_TOKENS,
                prompt_cache=cache, draft_cache=dcache, stop_tokens=stop, absorb_last=True,
                on_prefilled=lambda n: prefilled.append([n] + [c.offset for c in cache + dcache]),
                prefill_breaks=(0, 4, len(PROMPT) - 1, 99),
            )
        ]
        assert tokens == want
        assert prefilled == [[4] * 9, [len(PROMPT) - 1] * 9]
        covered = len(PROMPT) + len(tokens)
        assert [c.offset for c in cache + dcache] == [covered] * 8
        assert not any(c.in_round for c in cache + dcache if isinstance(c, SSMCache))
        # continuing from the speculative caches equals continuing the greedy run
        ref_cache = mlx_make_prompt_cache(plain)
        plain(mx.array([PROMPT + tokens]), cache=ref_cache)
        x = mx.array([[33]])
        assert bits_equal(target(x, cache=cache), plain(x, cache=ref_cache)).item()


def test_a_sampling_sampler_runs_and_keeps_caches_consistent():
    _, target, draft = models("qwen3_next")
    mx.random.seed(11)
    cache = make_prompt_cache(target)
    result = speculative_generate(
        target, draft, PROMPT, max_tokens=16, num_draft_tokens=3, sampler=make_sampler(temp=0.8), prompt_cache=cache
    )
    assert len(result.tokens) == 16 and result.rounds == len(result.per_round)
    assert [c.offset for c in cache] == [len(PROMPT) + 15] * 4


def test_mlx_lm_refuses_and_bad_caches_are_refused():
    plain, target, draft = models("qwen3_next")
    with pytest.raises(ValueError, match="trimmable"):  # why this module exists (mlx-lm #1446)
        next(mlx_speculative_generate_step(mx.array(PROMPT), plain, plain))
    with pytest.raises(InvalidInput, match="make_prompt_cache"):
        next(speculative_generate_step(mx.array(PROMPT), target, draft, prompt_cache=mlx_make_prompt_cache(target)))
    with pytest.raises(InvalidInput):
        next(speculative_generate_step(mx.array(PROMPT), target, draft, num_draft_tokens=0))
    with pytest.raises(InvalidInput, match="prefill_step_size"):  # was a ValueError from a reshape of y[:0]
        next(speculative_generate_step(mx.array(PROMPT), target, draft, prefill_step_size=0))


def test_sliding_window_caches_run_speculatively_and_other_kinds_are_refused():
    """A RotatingKVCache (trimmable only until it wraps) drops a round's rejected
    tail itself (tests/test_spec_window.py); a kind that can neither trim, nor
    run rounds, nor drop that tail is refused before any round, by its class."""
    gemma, _ = load(str(MODELS / "gemma3_text"))
    for prompt in (PROMPT[:4], PROMPT * 4):
        assert len(list(speculative_generate_step(mx.array(prompt), gemma, gemma, num_draft_tokens=2,
                                                  max_tokens=4))) == 4
    with pytest.raises(InvalidInput, match="ChunkedKVCache"):
        next(speculative_generate_step(mx.array(PROMPT), gemma, gemma, num_draft_tokens=2,
                                       prompt_cache=[ChunkedKVCache(8) for _ in gemma.layers]))
