"""The fidelity contract that holds on every backend (README, "Fidelity contract").

GPU kernels may depend on the shapes they are given, so a reference computed
with another call shape (a fresh forward over the accepted tokens, plain greedy
decoding) is bit-exact only where they do not (the CPU); those tests carry the
``shape_dependent`` marker. The references here are taken from the very
forward under test:

* a verify round's ``rollback(keep)`` folds to the state that the verify window
  itself reached after ``keep`` positions (its recorded operands replayed one
  position at a time from the pre-round slots, anchored to the window's own
  final slots);
* a round of single-position decodes (the draft's side) folds to the state each
  of those decodes left;
* speculative decoding emits, token for token, the target model's own argmax
  in its verify window, each conditioned on exactly the tokens emitted before it.

Every comparison is bit-exact (dtype, shape and bytes).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import _merge_caches

from promptstore.ssm import SSMCache, adapt, make_prompt_cache
from promptstore.ssm._recur import Trajectory, trajectory
from promptstore.ssm.speculative import SpeculativeStats, speculative_generate_step
from _bits import bits_equal
from test_speculative import noisy_draft

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HYBRIDS = ("qwen3_next", "qwen3_5")
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
WINDOW = [31, 32, 33, 34, 35]
MAX_TOKENS = 24


@functools.lru_cache(maxsize=None)
def adapted(arch: str):
    """A private, adapted copy of a fixture model."""
    model, _ = load(str(MODELS / arch))
    assert adapt(model) == 2  # the fixtures have two gated-DeltaNet layers
    return model


def same(a: Optional[mx.array], b: Optional[mx.array]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(bits_equal(a, b).item())


def ssm(cache: List[Any]) -> List[SSMCache]:
    return [c for c in cache if isinstance(c, SSMCache)]


def resolve(cache: List[Any], recorded: int, keep) -> None:
    """Roll every SSM layer back to ``keep`` and trim the attention layers alike."""
    for c in cache:
        if isinstance(c, SSMCache):
            c.rollback(keep)
        else:
            c.trim(recorded - (keep if isinstance(keep, int) else max(keep)))


def verify_window(model, cache: List[Any], window: List[List[int]]) -> List[Trajectory]:
    """Run a verify window in a round; return, per SSM layer, the states the
    window passed through (checked against the window's own final slots)."""
    layers = ssm(cache)
    before = [(c[0], c[1]) for c in layers]
    for c in layers:
        c.begin_round()
    mx.eval(model(mx.array(window), cache=cache))
    refs = []
    for c, (conv, state) in zip(layers, before):
        rnd = c._round  # the open round: its recorded operands are the reference's inputs
        assert rnd is not None and len(rnd.chunks) == 1
        ref = trajectory(conv, state, rnd.chunks[0], rnd.n_keep, rnd.use_kernel)
        # the anchor: replayed position by position, the window ends where it did
        assert same(ref.convs[-1], c[0]) and same(ref.states[-1], c[1])
        refs.append(ref)
    return refs


@pytest.mark.parametrize("arch", HYBRIDS)
def test_rollback_folds_to_the_verify_windows_own_state(arch):
    model = adapted(arch)
    S = len(WINDOW)
    for keep in range(S + 1):
        cache = make_prompt_cache(model)
        model(mx.array([PROMPT]), cache=cache)
        refs = verify_window(model, cache, [WINDOW])
        resolve(cache, S, keep)
        assert all(c.has_pending == (0 < keep < S) for c in ssm(cache))
        for c, ref in zip(ssm(cache), refs):
            assert same(c[0], ref.convs[keep]), (arch, keep, "conv")
            assert same(c[1], ref.states[keep]), (arch, keep, "state")
        assert [c.offset for c in cache] == [len(PROMPT) + keep] * len(cache)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("keeps", [[2, 0, 5], [4, 1, 3]])
def test_per_row_rollback_folds_to_each_rows_own_window_state(arch, keeps):
    model = adapted(arch)
    prompts = [PROMPT[:4], PROMPT[4:8], [8, 9, 10, 11]]
    windows = [WINDOW, [41, 42, 43, 44, 45], [51, 52, 53, 54, 55]]
    batch = _merge_caches([_prefilled(model, p) for p in prompts])
    refs = verify_window(model, batch, windows)
    for c in ssm(batch):
        c.rollback(keeps)
    for c, ref in zip(ssm(batch), refs):
        assert c.offsets == [4 + k for k in keeps]
        for i, keep in enumerate(keeps):
            row = c.extract(i)  # folds the batch, then takes its row
            assert same(row[0], ref.convs[keep][i : i + 1]), (arch, keeps, i, "conv")
            assert same(row[1], ref.states[keep][i : i + 1]), (arch, keeps, i, "state")


def test_decode_round_folds_to_the_state_each_decode_left():
    """The draft's side: a round of single-position decodes, rolled back to
    ``keep``, holds exactly what the ``keep``-th of those decodes left."""
    model = adapted("qwen3_5")
    steps = WINDOW[:4]
    for keep in range(len(steps) + 1):
        cache = make_prompt_cache(model)
        model(mx.array([PROMPT]), cache=cache)
        layers = ssm(cache)
        seen = [[(c[0], c[1]) for c in layers]]
        for c in layers:
            c.begin_round()
        for t in steps:
            mx.eval(model(mx.array([[t]]), cache=cache))
            seen.append([(c[0], c[1]) for c in layers])
        resolve(cache, len(steps), keep)
        for c, (conv, state) in zip(layers, seen[keep]):
            assert same(c[0], conv) and same(c[1], state), keep


def _prefilled(model, tokens: List[int]) -> List[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache


# -- speculative decoding ----------------------------------------------------


class _Recording:
    """The target model, recording each verify window it runs: its tokens, the
    coverage of its cache before it, and the greedy pick at each position."""

    def __init__(self, model):
        self.model = model
        self.windows: List[Tuple[List[int], List[int], List[int]]] = []

    def __call__(self, x: mx.array, cache=None):
        offsets = [c.offset for c in cache]
        verifying = any(c.in_round for c in ssm(cache))
        logits = self.model(x, cache=cache)
        if verifying:
            # the driver's greedy sampler: argmax of the log-probabilities
            logprobs = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)
            self.windows.append((x[0].tolist(), offsets, mx.argmax(logprobs, axis=-1).tolist()))
        return logits

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("draft_kind", ["noisy", "self"])
def test_speculative_emits_the_targets_own_verify_argmaxes(arch, draft_kind):
    target = adapted(arch)
    draft = noisy_draft(arch) if draft_kind == "noisy" else target
    recording = _Recording(target)
    cache = make_prompt_cache(target)
    stats = SpeculativeStats()
    emitted: List[int] = []
    rounds: List[int] = []
    for token, _, _ in speculative_generate_step(
        mx.array(PROMPT), recording, draft, num_draft_tokens=3, max_tokens=MAX_TOKENS,
        prompt_cache=cache, stats=stats,
    ):
        emitted.append(token)
        rounds.append(len(recording.windows) - 1)
    assert len(emitted) == MAX_TOKENS and len(recording.windows) == stats.rounds

    covered, last = len(PROMPT) - 1, PROMPT[-1]
    for r, (window, offsets, argmax) in enumerate(recording.windows):
        mine = [t for t, rr in zip(emitted, rounds) if rr == r]
        n = len(mine)
        assert 1 <= n <= len(window)
        # the window continues exactly the prompt and the tokens emitted so far
        assert offsets == [covered] * len(cache) and window[0] == last
        # each emitted token is the target's own pick in its verify window ...
        assert mine == argmax[:n], (r, window, argmax)
        # ... conditioned on the emitted tokens before it (accepted drafts)
        assert window[1:n] == mine[:-1]
        if r < len(recording.windows) - 1 and n < len(window):
            # a rejection: the next draft was not the target's pick
            assert window[n] != argmax[n - 1]
        covered, last = covered + n, mine[-1]
    if draft_kind == "noisy":
        accepted = [n for _, n in stats.per_round]
        assert 0 in accepted and any(n > 0 for n in accepted)  # rollbacks of several keeps ran
