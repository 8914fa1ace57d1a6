"""A consumer that stops in the middle of a verify round (a stop string, a
client gone) and closes the generator leaves both caches covering exactly the
tokens it took, bit for bit what greedy decoding of them leaves.

What mlx-lm's server needs: it takes the tokens one by one, stops after any
of them, and inserts the cache under the prompt and the tokens taken
(``_serve_single``'s ``cache_key``). Checked after every token of the first
rounds, for a self-draft (every round fully accepted) and for the target's
first layers (rounds partly accepted), on a hybrid (SSMCache rounds), an
attention model (trim) and a sliding-window model (window rounds).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any, List, Tuple

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import promptstore.ssm.speculative as spec
from promptstore.bench._draft import smaller_draft
from promptstore.serving._speculative import DraftCounters, make_stream_generate
from promptstore.ssm import SSMCache, make_prompt_cache
from promptstore.ssm.speculative import SpeculativeStats, speculative_generate_step
from _bits import bits_equal
from conftest import MODELS, greedy_cache

PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
K = 3  # draft tokens per round
TAKEN = range(1, 11)  # tokens taken before the stop: the first rounds, every position


@functools.lru_cache(maxsize=None)
def loaded(arch: str, which: str, copy: str) -> Any:
    """The target (``which == "self"``) or a draft, one per copy: the
    speculative path adapts its models in place, the greedy references run on
    copies it never saw. Drafts: the target's first layers (two, or one of
    two), or its weights plus seeded noise; both agree only sometimes."""
    if which == "fewer-layers":
        layers = min(2, json.loads((MODELS / arch / "config.json").read_text())["num_hidden_layers"] - 1)
        return load(str(smaller_draft(MODELS / arch, Path(tempfile.mkdtemp(prefix="spec-stop-")) / "d", layers)))[0]
    model = load(str(MODELS / arch))[0]
    if which == "noisy":
        mx.random.seed(7)
        model.load_weights([
            (k, v + 0.05 * mx.random.normal(v.shape).astype(v.dtype) * mx.abs(v).mean() if v.ndim >= 2 else v)
            for k, v in tree_flatten(model.parameters())
        ])
    return model


def models(arch: str, draft: str, copy: str) -> Tuple[Any, Any]:
    return loaded(arch, "self", copy), loaded(arch, draft, copy)


@functools.lru_cache(maxsize=None)
def rounds(arch: str, draft: str) -> Tuple[List[int], List[int]]:
    """Greedy tokens, and where the speculative rounds end (token counts)."""
    stats = SpeculativeStats()
    tokens = [t for t, _, _ in speculative_generate_step(
        mx.array(PROMPT), *models(arch, draft, "spec"), num_draft_tokens=K, max_tokens=max(TAKEN) + K, stats=stats)]
    ends, n = [], 0
    for _, accepted in stats.per_round:
        n += accepted + 1
        ends.append(n)
    return tokens, ends


def _seen(c: Any) -> Tuple[Any, ...]:
    """What the next forward reads of a layer: coverage and arrays, in temporal order."""
    if isinstance(c, SSMCache):
        return (c.offset, c[0], c[1])
    if type(c) is RotatingKVCache:
        n = min(c.offset, c.max_size - 1)
        return (c.offset, c._temporal_order(c.keys)[..., -n:, :], c._temporal_order(c.values)[..., -n:, :])
    assert type(c) is KVCache, type(c)
    return (c.offset, c.keys[..., : c.offset, :], c.values[..., : c.offset, :])


def assert_greedy(model: Any, plain: Any, cache: List[Any], tokens: List[int], n_prompt: int = len(PROMPT)) -> None:
    """``cache`` covers ``tokens`` (a prompt of ``n_prompt`` tokens, then
    generated ones) and holds, bit for bit, what greedy decoding of them by
    the same weights leaves; the next forward agrees too (this consumes both
    caches)."""
    ref = greedy_cache(plain, tokens, n_prompt)
    assert not any(c.in_round for c in cache if isinstance(c, SSMCache))
    for i, (a, b) in enumerate(zip(cache, ref)):
        sa = _seen(a)
        if isinstance(a, SSMCache):  # greedy's ArraysCache says nothing of coverage
            sb: Tuple[Any, ...] = (len(tokens), b[0], b[1])
        else:
            sb = _seen(b)
        assert sa[0] == sb[0], f"layer {i} covers {sa[0]} tokens, not {sb[0]}"
        assert all(bits_equal(x, y).item() for x, y in zip(sa[1:], sb[1:])), f"layer {i} differs from greedy"
    x = mx.array([[33, 44]])
    assert bits_equal(model(x, cache=cache), plain(x, cache=ref)).item(), "next forward differs"


def stop_after(arch: str, draft: str, taken: int, absorb_last: bool = True) -> None:
    """Take ``taken`` tokens, close the generator, check both caches."""
    target, dmodel = models(arch, draft, "spec")
    cache, dcache = make_prompt_cache(target), make_prompt_cache(dmodel)
    steps = speculative_generate_step(mx.array(PROMPT), target, dmodel, num_draft_tokens=K, max_tokens=64,
                                      prompt_cache=cache, draft_cache=dcache, absorb_last=absorb_last)
    tokens = [t for _, (t, _, _) in zip(range(taken), steps)]  # range first: no token past them
    steps.close()
    assert tokens == rounds(arch, draft)[0][:taken]
    covered = PROMPT + (tokens if absorb_last else tokens[:-1])
    plain, plain_draft = models(arch, draft, "plain")
    assert_greedy(target, plain, cache, covered)
    assert_greedy(dmodel, plain_draft, dcache, covered)


CASES = [("qwen3_next", "self"), ("qwen3_next", "fewer-layers"), ("qwen3_next", "noisy"),
         ("llama", "self"), ("llama", "noisy"), ("gemma3_text", "self"), ("gemma3_text", "noisy")]


@pytest.mark.shape_dependent  # the greedy reference decodes one token a forward
@pytest.mark.parametrize("arch,draft", CASES)
def test_a_stop_after_any_token_of_a_round_leaves_greedy_caches(arch, draft):
    tokens, ends = rounds(arch, draft)
    assert any(t not in ends for t in TAKEN), f"no round of {ends} ends past a token of {list(TAKEN)}"
    for taken in TAKEN:
        stop_after(arch, draft, taken)


@pytest.mark.parametrize("arch", ["qwen3_next", "llama", "gemma3_text"])
def test_the_weaker_drafts_are_partly_accepted(arch):
    """So the cases above cut short rounds of accepted drafts, of rejected
    ones, and of a partly accepted round."""
    per_round = []
    for draft in [d for a, d in CASES if a == arch and d != "self"]:
        stats = SpeculativeStats()
        list(speculative_generate_step(mx.array(PROMPT), *models(arch, draft, "spec"), num_draft_tokens=K,
                                       max_tokens=max(TAKEN), stats=stats))
        assert any(n > 0 for _, n in stats.per_round) and any(n < d for d, n in stats.per_round), stats.per_round
        per_round += stats.per_round
    assert any(0 < n < d for d, n in per_round), per_round


@pytest.mark.shape_dependent
@pytest.mark.parametrize("taken", [1, 2, 3])
def test_without_absorb_last_a_stop_leaves_all_but_the_last_token(taken):
    stop_after("qwen3_next", "noisy", taken, absorb_last=False)


@pytest.mark.shape_dependent
def test_the_check_catches_a_close_that_keeps_the_whole_round(monkeypatch):
    """Control: a close that resolves the round as if it had been taken to its
    end (what a close did before) leaves caches the check refuses."""
    settle = spec._OpenRound.settle
    monkeypatch.setattr(spec._OpenRound, "settle", lambda self, c: settle(self, len(self._tokens)))
    _, ends = rounds("qwen3_next", "self")
    with pytest.raises(AssertionError, match="covers"):
        stop_after("qwen3_next", "self", next(t for t in TAKEN if t not in ends))


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3_text"])
def test_the_server_stream_stopped_mid_round_leaves_its_cache_over_the_tokens_taken(arch):
    """``stream_generate`` as mlx-lm's server runs it: one cache list, target
    layers then draft layers (ArraysCache as the server makes them); the
    server takes responses, appends each token to its key, and drops the
    generator at a stop string."""
    target, dmodel = models(arch, "noisy", "spec")
    _, tokenizer = load(str(MODELS / arch))
    tokens, ends = rounds(arch, "noisy")
    plain, plain_draft = models(arch, "noisy", "plain")
    counters = DraftCounters()
    stream = make_stream_generate(None, counters)
    for taken in [t for t in TAKEN if t not in ends][:3]:
        cache = mlx_make_prompt_cache(target) + mlx_make_prompt_cache(dmodel)
        gen = stream(target, tokenizer, PROMPT, max_tokens=64, draft_model=dmodel, prompt_cache=cache,
                     num_draft_tokens=K)
        key = list(PROMPT)
        for r in gen:
            key.append(r.token)
            if len(key) == len(PROMPT) + taken:
                break
        del gen  # what the server's ``break`` does to the generator it iterated
        assert key == PROMPT + tokens[:taken]
        n = len(target.layers)
        assert_greedy(target, plain, cache[:n], key)
        assert_greedy(dmodel, plain_draft, cache[n:], key)
    assert counters.snapshot()["speculative_requests"] == 3
