"""Shared fixtures: a store on tmp_path, the fixture models, prefill helpers."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from promptstore import PromptStore, fingerprint
from promptstore._backend import backend as default_backend

# Model digests are remembered on disk; the tests (and their subprocesses) keep theirs out of ~/.cache.
os.environ.setdefault("PROMPTSTORE_IDENTITY_CACHE", os.path.join(tempfile.mkdtemp(prefix="promptstore-identity-"), "identity.json"))

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "fixtures" / "models"
MODEL_NAMES = ("llama", "qwen3_next", "qwen3_5", "gemma3_text")
HYBRIDS = ("qwen3_next", "qwen3_5")

BACKENDS = ("cpu", "metal", "cuda")


def backend() -> str:
    """The mlx backend the tests run on: ``$PROMPTSTORE_BACKEND`` when set
    (``cpu``, ``metal`` or ``cuda``), else the default device's."""
    given = os.environ.get("PROMPTSTORE_BACKEND")
    if given:
        if given not in BACKENDS:
            raise pytest.UsageError(f"PROMPTSTORE_BACKEND={given!r}: expected one of {', '.join(BACKENDS)}")
        return given
    return default_backend()


SHAPE_DEPENDENT = (
    "shape_dependent: the reference is computed with other call shapes, and the {0} backend's "
    "kernels depend on shape (bit-exact only where they do not, e.g. the CPU; README, Fidelity contract)"
)
MISSING_KERNEL = "missing_kernel: mlx has no {1} kernel for this shape on the {0} backend"


def pytest_collection_modifyitems(config, items):
    """Off the CPU, report shape-dependent tests (and tests needing a kernel the
    backend lacks) as non-strict xfails, so a GPU run shows real failures only."""
    where = backend()
    if where == "cpu":
        return
    for item in items:
        if item.get_closest_marker("shape_dependent") is not None:
            item.add_marker(pytest.mark.xfail(strict=False, reason=SHAPE_DEPENDENT.format(where)))
        missing = item.get_closest_marker("missing_kernel")
        if missing is not None and where == missing.kwargs.get("backend"):
            reason = MISSING_KERNEL.format(where, missing.kwargs.get("op", "an"))
            item.add_marker(pytest.mark.xfail(strict=False, reason=reason))


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


def greedy_cache(model, tokens, n_prompt: int):
    """What greedy decoding (mlx-lm's ``generate_step``) leaves in a cache:
    the prompt but its last token in one forward, then one token a forward."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens[: n_prompt - 1])[None], cache=cache)
    for t in tokens[n_prompt - 1 :]:
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


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
