"""Rows of hybrid (gated-DeltaNet) batches: put_row/extract_row with ``gated=``
store ``ssm.gated_delta`` with coverage, and merge_rows joins ArraysCache and
SSMCache rows by one rule (the batch's class wins), bit-exactly.

The batches are mlx-lm's own (``BatchGenerator`` on the fixture hybrids), whose
gated-DeltaNet layers are ``ArraysCache``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from conftest import HYBRIDS, load_fixture, sample_tokens
from promptstore import CoverageMismatch, InvalidInput
from promptstore.jobs.prefill import prefill
from promptstore.rows import extract_row, merge_rows, put_row, row_count, row_coverage
from promptstore.ssm import SSMCache, gated_delta_layers
from test_rows_api import _running
from _bits import bits_equal


def _eq(a, b) -> bool:
    return bool(bits_equal(a, b).item())


def _continue(model, batch, last, steps: int = 4):
    """Greedy logits of ``steps`` forward calls of every row of ``batch``."""
    y = mx.array(last)
    out = []
    for _ in range(steps):
        lg = model(y[:, None], cache=batch)[:, -1, :]
        mx.eval(lg)
        out.append(lg)
        y = mx.argmax(lg, axis=-1)
    return out


@pytest.mark.parametrize("name", HYBRIDS)
def test_put_row_with_gated_stores_ssm_gated_delta_with_coverage(name, store):
    model, _, fp, _ = load_fixture(name)
    gen, _, _ = _running(name)
    batch = gen._generation_batch.prompt_cache
    assert any(type(c) is ArraysCache for c in batch)  # mlx-lm's own batch
    flags = gated_delta_layers(model)
    tokens = list(gen._generation_batch.tokens[2])
    live = extract_row(batch, 2)  # as mlx-lm's classes
    info = put_row(store, fp, tokens, batch, 2, gated=flags)
    assert "arrays" not in info.kinds
    assert [k == "ssm.gated_delta" for k in info.kinds] == flags and any(flags)
    restored = store.get(fp, tokens)
    for layer, old in zip(restored, live):
        if type(old) is ArraysCache:
            assert type(layer) is SSMCache and layer.offset == len(tokens)
            assert _eq(layer[0], old.cache[0]) and _eq(layer[1], old.cache[1])
    # both continue exactly alike: the conversion kept every bit
    a = _continue(model, restored, [tokens[-1]])
    b = _continue(model, live, [tokens[-1]])
    assert all(_eq(x, y) for x, y in zip(a, b))
    # gated=True (every ArraysCache layer) is the same on these models
    assert extract_row(batch, 2, gated=True)[0].offsets == [len(tokens)]


def test_put_row_without_gated_keeps_mlx_lm_classes(store):
    """The batch alone cannot tell a gated-DeltaNet layer from another two-slot
    recurrent layer: without ``gated`` the row is stored as it is."""
    model, _, fp, _ = load_fixture("qwen3_next")
    gen, _, _ = _running("qwen3_next")
    batch = gen._generation_batch
    info = put_row(store, fp, list(batch.tokens[0]), batch.prompt_cache, 0)
    assert "arrays" in info.kinds and "ssm.gated_delta" not in info.kinds


def test_extract_row_with_gated_needs_a_layer_that_reports_coverage():
    layer = ArraysCache(2)
    layer[0], layer[1] = mx.ones((2, 3, 8)), mx.zeros((2, 2, 4, 4))
    with pytest.raises(CoverageMismatch, match="no layer of this batch reports"):
        extract_row([layer], 1, gated=True)
    assert type(extract_row([layer], 1)[0]) is ArraysCache  # unconverted: no coverage needed
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((2, 2, 5, 4)), mx.zeros((2, 2, 5, 4)))
    row = extract_row([layer, kv], 1, gated=[True, False])
    assert type(row[0]) is SSMCache and row[0].offset == 5 and _eq(row[0][1], layer[1][1:2])
    with pytest.raises(InvalidInput, match="1 flags for a cache of 2 layers"):
        extract_row([layer, kv], 1, gated=[True])


@pytest.mark.parametrize("name", HYBRIDS)
def test_ssm_row_joins_an_mlx_lm_batch_as_arrays_cache(name, store):
    """A restored ssm.gated_delta row joins mlx-lm's ArraysCache batch exactly
    like the live ArraysCache row does."""
    model, _, fp, _ = load_fixture(name)
    src, _, _ = _running(name)
    tokens = list(src._generation_batch.tokens[1])
    put_row(store, fp, tokens, src._generation_batch.prompt_cache, 1, gated=gated_delta_layers(model))
    restored = store.get(fp, tokens)
    assert any(type(c) is SSMCache for c in restored)
    live = extract_row(src._generation_batch.prompt_cache, 1)

    out = []
    for row in (restored, live):
        gen, _, _ = _running(name)  # a fresh running mlx-lm batch of 4 rows
        batch = gen._generation_batch.prompt_cache
        last = [list(t)[-1] for t in gen._generation_batch.tokens]
        merge_rows(batch, [row])
        assert row_count(batch) == 5 and all(type(c) is not SSMCache for c in batch)
        out.append(_continue(model, batch, last + [tokens[-1]]))
    assert all(_eq(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("name", HYBRIDS)
def test_new_batch_of_mixed_rows_is_ssm_and_exact(name, store):
    model, _, fp, _ = load_fixture(name)
    p1 = sample_tokens(9, seed=71)
    ssm_row = prefill(model, p1)  # SSMCache layers
    src, _, _ = _running(name)
    tokens = list(src._generation_batch.tokens[3])
    arrays_row = extract_row(src._generation_batch.prompt_cache, 3)  # ArraysCache layers
    as_ssm = extract_row(src._generation_batch.prompt_cache, 3, gated=gated_delta_layers(model))

    mixed = merge_rows(None, [ssm_row, arrays_row])
    plain = merge_rows(None, [prefill(model, p1), as_ssm])
    for layer in mixed:
        if type(layer) is SSMCache:
            assert layer.offsets == [len(p1), len(tokens)]
    assert [type(c) for c in mixed] == [type(c) for c in plain]
    assert row_coverage(mixed, 1) == row_coverage(plain, 1)
    a = _continue(model, mixed, [p1[-1], tokens[-1]])
    b = _continue(model, plain, [p1[-1], tokens[-1]])
    assert all(_eq(x, y) for x, y in zip(a, b))


def test_arrays_row_without_coverage_cannot_join_an_ssm_batch():
    batch = [SSMCache.from_parts(mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4)), [3])]
    row = ArraysCache(2)
    row[0], row[1] = mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    with pytest.raises(CoverageMismatch, match="layer 0 \\(row 0\\).*no layer of the row reports"):
        merge_rows(batch, [[row]])
    assert batch[0].offsets == [3]  # untouched
    # with a layer that tells the coverage, it joins
    kv_b, kv_r = KVCache(), KVCache()
    kv_b.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    kv_r.update_and_fetch(mx.ones((1, 2, 6, 4)), mx.ones((1, 2, 6, 4)))
    joined = merge_rows([batch[0], merge_rows(None, [[kv_b]])[0]], [[row, kv_r]])
    assert type(joined[0]) is SSMCache and joined[0].offsets == [3, 6]
    assert _eq(joined[0][0][1:], row[0])


def test_a_batch_with_an_open_round_on_a_later_layer_is_refused_untouched():
    """merge_rows checks every layer before extending any: with a verify
    round open on the second layer only, the first layer was already
    extended when the second refused."""
    from promptstore.errors import RoundError

    def ssm(rows, value):
        return SSMCache.from_parts(mx.full((rows, 3, 8), value), mx.full((rows, 2, 4, 4), value), [3] * rows)

    batch = [ssm(2, 1.0), ssm(2, 2.0)]
    batch[1].begin_round()
    with pytest.raises(RoundError, match="layer 1"):
        merge_rows(batch, [[ssm(1, 3.0), ssm(1, 4.0)]])
    assert [layer.batch_size for layer in batch] == [2, 2] and batch[0].offsets == [3, 3]
