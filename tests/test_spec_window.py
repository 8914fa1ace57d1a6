"""Speculative decoding on a sliding-window model (gemma3_text: RotatingKVCache
layers, window 16): verify rounds drop the ring's rejected tail for real.

Cache level: a round that keeps ``k`` of its ``S`` positions leaves exactly the
buffer, ``offset`` and ``_idx`` of mlx-lm's own update of those ``k`` positions
alone, in every ring state (empty, growing, full, wrapped, over-long after a
window). Model level: tokens equal plain greedy ``generate_step`` far past the
window, and both caches equal plain greedy's caches at the same token count as
the next forward sees them (its window, and its logits bit for bit), where
mlx-lm's ``trim`` leaves rejected keys in the ring.
"""

from __future__ import annotations

import functools
from typing import Any, List

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import promptstore.ssm.speculative as spec
from promptstore.bench._draft import smaller_draft
from promptstore.codecs import codec_for_layer
from promptstore.errors import InvalidInput, RoundError
from promptstore.serving._speculative import DraftCounters, make_stream_generate
from promptstore.ssm._window import WindowRound
from promptstore.ssm.speculative import SpeculativeStats, speculative_generate, speculative_generate_step
from _bits import bits_equal
from conftest import MODELS, greedy_cache

GEMMA = MODELS / "gemma3_text"
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
MAX_TOKENS = 40  # 10 + 40 positions through a window of 16: the ring wraps twice


# -- cache level ---------------------------------------------------------------

def _kv(n: int, seed: int) -> tuple:
    mx.random.seed(seed)
    return mx.random.normal((1, 1, n, 4)), mx.random.normal((1, 1, n, 4))


def _ring(history: List[int], max_size: int = 6) -> RotatingKVCache:
    """A RotatingKVCache after forwards of ``history`` positions each (1: in place)."""
    c = RotatingKVCache(max_size)
    for i, n in enumerate(history):
        c.update_and_fetch(*_kv(n, 100 + i))
    return c


def _same(a: RotatingKVCache, b: RotatingKVCache) -> bool:
    if (a.offset, a._idx, a.keys is None) != (b.offset, b._idx, b.keys is None):
        return False
    return a.keys is None or bool(bits_equal(a.keys, b.keys).item() and bits_equal(a.values, b.values).item())


HISTORIES = [[], [3], [1, 1], [5], [4, 1, 1, 1], [9], [2, 1, 1, 1, 1, 1, 1, 1, 1], [9, 1, 1], [3, 1, 1, 1, 4, 1]]


@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("S", [2, 4])
def test_a_window_round_leaves_what_its_kept_positions_alone_would(history, S):
    for keep in range(1, S + 1):
        live, ref = _ring(history), _ring(history)
        k, v = _kv(S, 7)
        rnd = WindowRound(live)
        live.update_and_fetch(k, v)
        rnd.resolve(S, keep)
        ref._update_concat(k[..., :keep, :], v[..., :keep, :])
        assert _same(live, ref), (history, S, keep)


@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("S", [1, 3, 5])
def test_a_decode_round_leaves_what_its_kept_positions_alone_would(history, S):
    for keep in range(0, S + 1):
        live, ref = _ring(history), _ring(history)
        rnd = WindowRound(live)
        for j in range(S):
            live.update_and_fetch(*_kv(1, 50 + j))
            rnd.record()
        rnd.resolve(S, keep)
        for j in range(keep):
            ref.update_and_fetch(*_kv(1, 50 + j))
        assert _same(live, ref), (history, S, keep)


def test_mlx_lm_trim_is_not_enough_once_the_ring_wraps():
    """Why the bypass exists: a wrapped ring trimmed by mlx-lm keeps the rejected keys."""
    live, ref = _ring([9, 1]), _ring([9, 1])
    k, v = _kv(3, 7)
    live.update_and_fetch(k, v)
    live.trim(2)
    ref._update_concat(k[..., :1, :], v[..., :1, :])
    assert live.offset == ref.offset and not _same(live, ref)


def test_window_round_misuse_is_refused():
    c = _ring([3])
    rnd = WindowRound(c)
    c.update_and_fetch(*_kv(2, 1))
    with pytest.raises(RoundError, match="record after every"):
        rnd.record()
    with pytest.raises(RoundError, match="go from offset 3 to 5"):
        rnd.resolve(3, 1)
    with pytest.raises(InvalidInput, match="keeps 0 to 2"):
        rnd.resolve(2, 3)
    with pytest.raises(InvalidInput, match="RotatingKVCache"):
        WindowRound(ChunkedKVCache(8))


def test_a_ring_shorter_than_the_round_is_refused():
    """Decodes that would overwrite their own slots: refused at the slot, and up front."""
    c = _ring([9])
    rnd = WindowRound(c)
    for j in range(6):  # 6 rotating slots
        c.update_and_fetch(*_kv(1, j))
        rnd.record()
    c.update_and_fetch(*_kv(1, 6))
    with pytest.raises(RoundError, match="wrote ring slot .* twice"):
        rnd.record()
    target = gemma()
    tiny = [RotatingKVCache(2) if type(c) is RotatingKVCache else type(c)() for c in mlx_make_prompt_cache(target)]
    with pytest.raises(InvalidInput, match="sliding window of 2 rotating positions"):
        next(speculative_generate_step(mx.array(PROMPT), target, target, num_draft_tokens=4, draft_cache=tiny))


# -- model level ---------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gemma(noise: bool = False) -> Any:
    model, _ = load(str(GEMMA))
    if noise:  # the target's weights plus seeded noise: a draft that agrees only sometimes
        mx.random.seed(7)
        model.load_weights([
            (k, v + 0.05 * mx.random.normal(v.shape).astype(v.dtype) * mx.abs(v).mean() if v.ndim >= 2 else v)
            for k, v in tree_flatten(model.parameters())
        ])
    return model


@functools.lru_cache(maxsize=None)
def greedy_tokens() -> List[int]:
    return [t for t, _ in generate_step(mx.array(PROMPT), gemma(), max_tokens=MAX_TOKENS)]


def _clone(cache: List[Any]) -> List[Any]:
    out = []
    for c in cache:
        n = RotatingKVCache(c.max_size, c.keep) if type(c) is RotatingKVCache else type(c)()
        n.keys, n.values, n.offset = c.keys[...], c.values[...], c.offset
        if type(c) is RotatingKVCache:
            n._idx = c._idx
        out.append(n)
    return out


def _window(c: Any) -> tuple:
    """What the next forward attends to of ``c`` besides its own positions, in temporal order."""
    if type(c) is RotatingKVCache:
        n = min(c.offset, c.max_size - 1)
        return c._temporal_order(c.keys)[..., -n:, :], c._temporal_order(c.values)[..., -n:, :], c.offset
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset


def assert_seen_alike(model: Any, cache: List[Any], ref: List[Any]) -> None:
    for a, b in zip(map(_window, cache), map(_window, ref)):
        assert a[2] == b[2] and bits_equal(a[0], b[0]).item() and bits_equal(a[1], b[1]).item()
    for x in ([[33]], [[33, 44, 45]]):  # one position (in place) and a window (concat)
        got, want = model(mx.array(x), cache=_clone(cache)), model(mx.array(x), cache=_clone(ref))
        assert bits_equal(got, want).item(), f"next forward of {len(x[0])} differs"


@pytest.mark.shape_dependent
@pytest.mark.parametrize("noise", [False, True], ids=["self-draft", "noisy-draft"])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("absorb_last", [False, True])
def test_gemma_speculative_equals_greedy_past_the_window(noise, k, absorb_last):
    target, draft = gemma(), gemma(noise)
    cache, dcache = mlx_make_prompt_cache(target), mlx_make_prompt_cache(draft)
    stats = SpeculativeStats()
    tokens = [t for t, _, _ in speculative_generate_step(
        mx.array(PROMPT), target, draft, num_draft_tokens=k, max_tokens=MAX_TOKENS,
        prompt_cache=cache, draft_cache=dcache, stats=stats, absorb_last=absorb_last)]
    assert tokens == greedy_tokens()
    if noise:  # rejections of every length ran, past the wrap
        assert 0 < stats.acceptance < 1 and 0 in [n for _, n in stats.per_round[3:]]
    else:
        assert stats.acceptance == 1.0
    covered = PROMPT + (tokens if absorb_last else tokens[:-1])
    assert {c.offset for c in cache + dcache} == {len(covered)} and len(covered) > 2 * 16
    assert_seen_alike(target, cache, greedy_cache(target, covered, len(PROMPT)))
    assert_seen_alike(draft, dcache, greedy_cache(draft, covered, len(PROMPT)))


@pytest.mark.shape_dependent
def test_mlx_lm_trim_instead_of_the_bypass_is_caught(monkeypatch):
    """The check above can fail: with mlx-lm's trim on the window layers the
    tokens still match (the target's windows reorder the ring), but the
    caches do not."""
    monkeypatch.setattr(spec, "runs_window_rounds", lambda layer: False)
    monkeypatch.setattr(spec, "_check_cache", lambda cache, which: None)
    target, draft = gemma(), gemma(True)
    cache, dcache = mlx_make_prompt_cache(target), mlx_make_prompt_cache(draft)
    r = speculative_generate(target, draft, PROMPT, max_tokens=MAX_TOKENS, num_draft_tokens=3,
                             prompt_cache=cache, draft_cache=dcache)
    assert r.tokens == greedy_tokens()
    with pytest.raises(AssertionError):
        assert_seen_alike(draft, dcache, greedy_cache(draft, PROMPT + r.tokens[:-1], len(PROMPT)))


@pytest.mark.shape_dependent
@pytest.mark.parametrize("draft_name", ["llama", "gemma3_text-2-layers"])
def test_gemma_with_another_draft_equals_greedy(tmp_path, draft_name):
    if draft_name == "llama":
        draft, _ = load(str(MODELS / "llama"))
    else:  # the target's first two layers: a window layer and a global one
        draft, _ = load(str(smaller_draft(GEMMA, tmp_path / "draft", 2)))
    r = speculative_generate(gemma(), draft, PROMPT, max_tokens=MAX_TOKENS, num_draft_tokens=3)
    assert r.tokens == greedy_tokens()
    assert r.drafted > 0 and r.acceptance < 1


def test_a_stored_window_cache_restores_and_continues_bit_identically():
    target = gemma()
    cache, dcache = mlx_make_prompt_cache(target), mlx_make_prompt_cache(gemma(True))
    list(speculative_generate_step(mx.array(PROMPT), target, gemma(True), num_draft_tokens=3,
                                   max_tokens=MAX_TOKENS, prompt_cache=cache, draft_cache=dcache, absorb_last=True))
    restored = []
    for c in cache:
        codec = codec_for_layer(c)
        arrays, meta = codec.encode(c)
        restored.append(codec.decode(arrays, meta, codec.version))
    assert {codec_for_layer(c).kind for c in cache} == {"kv", "kv.rotating"}
    assert_seen_alike(target, restored, cache)
    for step in ([[33]], [[34]], [[35, 36]]):  # the two copies stay alike as they go on
        assert bits_equal(target(mx.array(step), cache=cache), target(mx.array(step), cache=restored)).item()


@pytest.mark.parametrize("layer", [ChunkedKVCache(8), ConcatenateKVCache()], ids=lambda c: type(c).__name__)
def test_kinds_that_cannot_drop_a_rejected_tail_are_refused(layer):
    target = gemma()
    with pytest.raises(InvalidInput, match=type(layer).__name__):
        next(speculative_generate_step(mx.array(PROMPT), target, target, prompt_cache=[layer] * len(target.layers)))


class _Unregistered(RotatingKVCache):
    """A subclass no codec knows: its extra state would escape the rounds."""


@pytest.mark.parametrize("layer", [lambda: ChunkedKVCache(8), lambda: _Unregistered(16)],
                         ids=["ChunkedKVCache", "unregistered"])
def test_the_server_refuses_those_kinds_with_a_value_error(layer):
    """What mlx-lm's server answers as an error (a ValueError), naming the class."""
    counters = DraftCounters()
    stream = make_stream_generate(lambda *a, **k: iter(()), counters)
    _, tokenizer = load(str(GEMMA))
    target = gemma()
    cache = [layer() for _ in range(2 * len(target.layers))]
    with pytest.raises(ValueError, match=type(cache[0]).__name__):
        next(stream(target, tokenizer, PROMPT, max_tokens=4, draft_model=target, prompt_cache=cache))
    assert counters.snapshot()["speculative_requests"] == 0
