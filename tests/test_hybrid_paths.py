"""Hybrid models on every path: gated-DeltaNet layers are stored as ``ssm.gated_delta``
with coverage (CLI put/get, warm-up, the serving cache), older ``arrays`` entries still
restore and are rewritten as ``ssm.gated_delta``, and a cache in which no layer reports
coverage is stored only with its coverage given."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from conftest import HYBRIDS, load_fixture, sample_tokens
from promptstore import PromptStore, warmup
from promptstore.cli import main
from promptstore.errors import CoverageMismatch
from promptstore.jobs.prefill import encode_prompt, prefill
from promptstore.serving import PersistentPromptCache
from promptstore.ssm import SSMCache
from _bits import bits_equal

KINDS = ["ssm.gated_delta", "kv", "ssm.gated_delta", "kv"]  # both fixture hybrids


def _next_logits_equal(model, a, b, token: int = 77) -> bool:
    x = mx.array([[token]])
    return bool(bits_equal(model(x, cache=a), model(x, cache=b)).item())


def _mlx_prefilled(model, tokens):
    """A cache as mlx-lm's own code makes it (ArraysCache in gated-DeltaNet layers)."""
    cache = mlx_make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("name", HYBRIDS)
def test_cli_put_stores_ssm_gated_delta_and_get_continues_exactly(tmp_path, name):
    model, tok, fp, path = load_fixture(name)
    prompt = "You are terse. Explain prompt caches."
    store = str(tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(main, ["--store", store, "put", "--model", str(path), "--prompt", prompt, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["kinds"] == KINDS
    ls = json.loads(runner.invoke(main, ["--store", store, "ls", "--json"]).stdout)
    assert [row["kinds"] for row in ls] == [KINDS]
    tokens = encode_prompt(tok, prompt)
    with PromptStore(store) as s:
        cache = s.get(fp, tokens)
    assert [type(c) for c in cache][0] is SSMCache and cache[0].offset == len(tokens)
    assert _next_logits_equal(model, cache, prefill(model, tokens))


@pytest.mark.parametrize("batch_size", [1, 2])
def test_warmup_stores_ssm_gated_delta_with_coverage(tmp_path, batch_size):
    model, tok, fp, path = load_fixture("qwen3_next")
    records = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(["Short one.", "A somewhat longer prompt here.", "Third."])]
    with PromptStore(tmp_path / "s") as st:
        summary = warmup(st, path, records, batch_size=batch_size, loaded=(model, tok))
        assert summary.ok
        entries = list(st.entries())
        assert entries and all(list(e.kinds) == KINDS for e in entries)
        for e in entries:
            cache = st.get(fp, st.tokens(e.id))
            assert all(c.offset == e.n_tokens for c in cache)


def test_serving_insert_of_mlx_lm_caches_stores_ssm_gated_delta(tmp_path):
    model, tok, fp, path = load_fixture("qwen3_next")
    tokens = sample_tokens(30, seed=3)
    mlx_cache = _mlx_prefilled(model, tokens)
    with PromptStore(tmp_path / "s") as st:
        with PersistentPromptCache(st) as pc:
            pc.insert_cache(str(path), tokens, mlx_cache)
            assert pc.flush(60)
            (info,) = list(st.entries())
            assert list(info.kinds) == KINDS and info.n_tokens == len(tokens)
            # handed back to mlx-lm's server as the classes it makes (it batches them with its own)
            got, rest = pc.fetch_nearest_cache(str(path), tokens + [9])
            assert rest == [9] and [type(c) for c in got][0] is ArraysCache
            assert all(bits_equal(x, y).item() for x, y in zip(got[0].cache, mlx_cache[0].cache))
        stored = st.get(fp, tokens)
        assert type(stored[0]) is SSMCache and stored[0].offset == len(tokens)
        assert _next_logits_equal(model, stored, _mlx_prefilled(model, tokens))
        with PersistentPromptCache(st, ssm_layers=True) as pc:  # a fresh memory tier: a store hit
            got, rest = pc.fetch_nearest_cache(str(path), tokens + [9])
            assert rest == [9] and type(got[0]) is SSMCache and got[0].offset == len(tokens)
            assert pc.stats()["store_hits"] == 1


def test_an_arrays_entry_still_restores_and_is_rewritten_as_ssm_gated_delta(tmp_path):
    model, tok, fp, path = load_fixture("qwen3_next")
    tokens = sample_tokens(25, seed=5)
    with PromptStore(tmp_path / "s") as st:
        old = st.put(fp, tokens, _mlx_prefilled(model, tokens), meta={"source": "old"})  # as before this release
        assert list(old.kinds) == ["arrays", "kv", "arrays", "kv"]
        restored = st.get(fp, tokens)
        assert type(restored[0]) is ArraysCache
        assert _next_logits_equal(model, restored, prefill(model, tokens))
        with PersistentPromptCache(st) as pc:
            got, rest = pc.fetch_nearest_cache(str(path), tokens + [4])
            assert got is not None and rest == [4]
            assert pc.flush(60)
        (info,) = list(st.entries())
        assert list(info.kinds) == KINDS and info.meta == {"source": "old"}
        assert _next_logits_equal(model, st.get(fp, tokens), prefill(model, tokens))


def test_a_cache_without_coverage_is_stored_only_with_coverage_given(store):
    layer = ArraysCache(2)
    layer[0], layer[1] = mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    with pytest.raises(CoverageMismatch, match="coverage="):
        store.put("m@test", [1, 2, 3], [layer])
    assert store.get("m@test", [1, 2, 3]) is None
    with pytest.raises(CoverageMismatch):
        store.put("m@test", [1, 2, 3], [layer], coverage=4)
    info = store.put("m@test", [1, 2, 3], [layer], coverage=3)
    assert info.kinds == ("arrays",) and store.get("m@test", [1, 2, 3]) is not None


def test_a_put_never_replaces_ssm_state_with_plain_arrays(tmp_path):
    """The same tokens put as mlx-lm's ArraysCache over a stored
    ``ssm.gated_delta`` entry: refused, the entry unchanged; the other way
    round (arrays first, then ssm.gated_delta) is an upgrade and allowed."""
    from promptstore import InvalidInput

    model, _, fp, _ = load_fixture("qwen3_next")
    tokens = sample_tokens(40, seed=4)
    with PromptStore(tmp_path / "s") as store:
        store.put(fp, tokens, prefill(model, tokens))
        (info,) = list(store.entries())
        assert "ssm.gated_delta" in info.kinds
        with pytest.raises(InvalidInput, match="to_ssm"):
            store.put(fp, tokens, _mlx_prefilled(model, tokens))
        (still,) = list(store.entries())
        assert still.id == info.id and still.kinds == info.kinds and store.verify().ok
        other = sample_tokens(30, seed=5)
        store.put(fp, other, _mlx_prefilled(model, other))  # arrays first ...
        store.put(fp, other, prefill(model, other))  # ... then upgraded
        assert all("arrays" not in e.kinds for e in store.entries())
