"""Shared fixtures: a store on tmp_path, the fixture models, prefill helpers."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore, fingerprint

# Model digests are remembered on disk; the tests (and their subprocesses) keep theirs out of ~/.cache.
os.environ.setdefault("PROMPTSTORE_IDENTITY_CACHE", os.path.join(tempfile.mkdtemp(prefix="promptstore-identity-"), "identity.json"))

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "fixtures" / "models"
MODEL_NAMES = ("llama", "qwen3_next", "qwen3_5", "gemma3_text")
HYBRIDS = ("qwen3_next", "qwen3_5")


@functools.lru_cache(maxsize=None)
def load_fixture(name: str):
    """``(model, tokenizer, fingerprint, path)`` of a fixture model, loaded once per session."""
    from mlx_lm import load

    path = MODELS / name
    model, tokenizer = load(str(path))
    return model, tokenizer, fingerprint(path), path


def sample_tokens(n: int, seed: int = 0, vocab: int = 500) -> list:
    """Deterministic token ids in [3, vocab) (skipping the fixture's special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def continued(cache) -> list:
    """New KVCache layers over the positions ``cache`` covers: prefilling more
    tokens into them leaves ``cache`` as it is (a conversation continued,
    whose entry then shares the blocks of ``cache``'s entry)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in cache:
        c = KVCache()
        c.keys, c.values, c.offset = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], layer.offset
        out.append(c)
    return out


def greedy(model, cache, first_logits, steps: int):
    """Continue greedily; return the tokens and the logits of every step."""
    toks, logits = [], []
    y = mx.argmax(first_logits[:, -1, :], axis=-1)
    for _ in range(steps):
        out = model(y[:, None], cache=cache)
        mx.eval(out)
        logits.append(out)
        toks.append(int(y.item()))
        y = mx.argmax(out[:, -1, :], axis=-1)
    return toks, logits


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store") as s:
        yield s


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture(scope="module")
def blocks_in_lmdb():
    """Shared blocks kept as LMDB values, never in pack files: for tests that
    damage, plant or find blocks in the data file itself (pack files have
    tests of their own, in test_packs.py)."""
    from promptstore.format import _packs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_packs, "MIN_BYTES", 1 << 62)
        yield
