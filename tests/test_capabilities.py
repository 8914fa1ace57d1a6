"""Per-kind capabilities come from the codec registry, by exact class, and fail closed.

Rows, trim, batched warm-up, speculative rounds, the mlx-lm file class and
checkpoint needs are each declared by one codec (or, for a batch class that is
never stored, one ``register_rows``). A class nobody registered -- a subclass
of a registered one included -- gets none of them.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from conftest import HYBRIDS, load_fixture, sample_tokens
from promptstore import InvalidInput, UnknownStorageKind
from promptstore.codecs import (
    Codec,
    MissingCapability,
    codec_for_layer,
    codecs,
    is_trimmable,
    register,
    register_rows,
    rows_for_layer,
    trim_cache,
    unregister,
)
from promptstore.jobs.checkpoints import needs_checkpoints
from promptstore.jobs.prefill import prefill
from promptstore.rows import row_coverage
from promptstore.ssm import SSMCache, make_prompt_cache
from promptstore.ssm.speculative import speculative_generate_step


class TaggedSSM(SSMCache):
    """A subclass with state of its own that SSMCache's codec knows nothing of."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = mx.array([7])


def _tagged(cache):
    """``cache`` with every SSMCache layer replaced by a fresh TaggedSSM."""
    return [TaggedSSM() if type(c) is SSMCache else c for c in cache]


# -- the two paths that used to fail open ---------------------------------------------


@pytest.mark.parametrize("name", HYBRIDS)
def test_put_row_refuses_unregistered_ssm_subclass(name, store):
    """It used to pass a duck-typing check and be stored as ssm.gated_delta,
    the subclass's own state silently dropped."""
    model, _, fp, _ = load_fixture(name)
    tokens = sample_tokens(11, seed=3)
    cache = _tagged(make_prompt_cache(model))
    assert any(type(c) is TaggedSSM for c in cache)
    prefill(model, tokens, cache=cache)
    with pytest.raises(UnknownStorageKind, match="cannot take a row of a .*TaggedSSM") as err:
        store.put_row(fp, tokens, cache, 0)
    assert "subclasses SSMCache" in str(err.value)
    assert list(store.entries()) == []
    # the registered class itself is stored (so the refusal is the subclass's)
    plain = make_prompt_cache(model)
    prefill(model, tokens, cache=plain)
    assert "ssm.gated_delta" in store.put_row(fp, tokens, plain, 0).kinds


def test_speculative_refuses_unregistered_round_cache():
    """Anything with a ``begin_round`` attribute used to run verify rounds."""
    target, _, _, _ = load_fixture("qwen3_next")
    cache = _tagged(make_prompt_cache(target))
    with pytest.raises(UnknownStorageKind, match="TaggedSSM"):
        next(speculative_generate_step(mx.array([5, 17, 99]), target, target, prompt_cache=cache))
    assert all(c.offset == 0 for c in cache if type(c) is TaggedSSM)  # refused before any forward
    draft = _tagged(make_prompt_cache(target))
    with pytest.raises(UnknownStorageKind, match="TaggedSSM"):
        next(speculative_generate_step(mx.array([5, 17, 99]), target, target, draft_cache=draft))


# -- what each kind declares -------------------------------------------------------------

# kind: (row class, batchable, always trimmable, rounds, mlx-lm class)
DECLARED = {
    "kv": (KVCache, True, True, False, KVCache),
    "kv.rotating": (RotatingKVCache, False, False, False, RotatingKVCache),
    "kv.quantized": (None, False, True, False, QuantizedKVCache),
    "kv.chunked": (None, False, False, False, ChunkedKVCache),
    "kv.concat": (None, False, False, False, ConcatenateKVCache),
    "arrays": (ArraysCache, True, False, False, ArraysCache),
    "list": (CacheList, False, False, False, CacheList),
    "ssm.gated_delta": (SSMCache, True, False, True, ArraysCache),  # batched warm-up
}


@pytest.mark.parametrize("codec", codecs(), ids=lambda c: c.kind)
def test_each_kind_declares_its_capabilities(codec):
    rows, batchable, always_trimmable, rounds, mlx_lm_class = DECLARED[codec.kind]
    assert (codec.rows.serial if codec.rows else None) is rows
    assert (codec.batchable, codec.always_trimmable, codec.rounds) == (batchable, always_trimmable, rounds)
    assert codec.mlx_lm_class is mlx_lm_class


def test_batch_classes_have_rows_but_no_codec():
    for cls, serial in ((BatchKVCache, KVCache), (BatchRotatingKVCache, RotatingKVCache)):
        layer = cls([0, 0]) if cls is BatchKVCache else cls(8, [0, 0])
        assert rows_for_layer(layer).serial is serial
        with pytest.raises(UnknownStorageKind):
            codec_for_layer(layer)
    with pytest.raises(InvalidInput, match="registered already"):
        register_rows(BatchKVCache, rows_for_layer(BatchKVCache([0])))
    with pytest.raises(InvalidInput, match="registered already"):
        register_rows(KVCache, rows_for_layer(KVCache()))


def test_a_new_codec_has_no_capability_until_it_declares_one():
    class Plain(KVCache):
        pass

    class PlainCodec(Codec):
        kind = "test.plain"
        types = (Plain,)

    register(PlainCodec())
    try:
        layer = Plain()
        codec = codec_for_layer(layer)
        assert not (codec.batchable or codec.always_trimmable or codec.rounds)
        assert not is_trimmable([layer]) and codec.needs_checkpoints(layer, 10)
        for fails in (
            lambda: rows_for_layer(layer),
            lambda: trim_cache([layer], 1),
            lambda: codec.batch_layer(layer, [0]),
            lambda: codec.to_mlx_lm(layer),
        ):
            with pytest.raises(MissingCapability, match="test.plain"):
                fails()
        with pytest.raises(InvalidInput, match="cannot take a row of a .*Plain.*'test.plain' has no row support"):
            row_coverage([layer], 0)
    finally:
        unregister("test.plain")


# -- trim ------------------------------------------------------------------------------------


def test_trim_cache_drops_the_trimmed_positions():
    model, _, _, _ = load_fixture("llama")
    cache = mlx_make_prompt_cache(model)
    prefill(model, sample_tokens(12, seed=1), cache=cache)
    full = [mx.array(c.keys[..., :8, :]) for c in cache]
    assert is_trimmable(cache)
    trim_cache(cache, 4)
    for c, keys in zip(cache, full):
        assert c.offset == 8 and c.keys.shape[2] == 8
        assert mx.array_equal(c.keys, keys).item()


def test_trimmed_concat_cache_continues_like_one_that_never_held_the_tokens():
    """mlx-lm's ConcatenateKVCache.trim only lowers offset; the next update
    would append after the stale keys. trim_cache drops them, so a trimmed
    cache continues bit-exactly like one filled with the kept tokens only."""
    keys = mx.arange(2 * 10 * 4, dtype=mx.float32).reshape(1, 2, 10, 4)
    step = mx.full((1, 2, 1, 4), -1.0)
    trimmed, fresh = ConcatenateKVCache(), ConcatenateKVCache()
    trimmed.update_and_fetch(keys, keys)
    fresh.update_and_fetch(keys[..., :7, :], keys[..., :7, :])
    trim_cache([trimmed], 3)
    got, _ = trimmed.update_and_fetch(step, step)
    want, _ = fresh.update_and_fetch(step, step)
    assert got.shape == want.shape == (1, 2, 8, 4)
    assert mx.array_equal(got, want).item()


def test_trim_cache_trims_nothing_unless_every_layer_can():
    model, _, _, _ = load_fixture("gemma3_text")
    cache = mlx_make_prompt_cache(model)
    assert any(type(c) is RotatingKVCache for c in cache)
    prefill(model, sample_tokens(80, seed=2), cache=cache)  # the sliding windows wrap
    before = [c.offset for c in cache]
    assert not is_trimmable(cache)
    with pytest.raises(MissingCapability, match="kv.rotating"):
        trim_cache(cache, 3)
    assert [c.offset for c in cache] == before


def test_cache_list_delegates_to_its_inner_codecs():
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 2, 6, 4)), mx.zeros((1, 2, 6, 4)))
    layer = CacheList(kv, ArraysCache(2))
    assert not is_trimmable([layer]) and needs_checkpoints_of(layer)
    with pytest.raises(MissingCapability):
        trim_cache([layer], 2)
    layer = CacheList(kv, RotatingKVCache(16))
    assert is_trimmable([layer])
    trim_cache([layer], 2)
    assert kv.offset == 4 and kv.keys.shape[2] == 4  # the inner KV layer dropped its positions too
    assert codec_for_layer(layer).needs_checkpoints(layer, 8) is False
    assert codec_for_layer(layer).needs_checkpoints(layer, 16) is True


def needs_checkpoints_of(layer) -> bool:
    return codec_for_layer(layer).needs_checkpoints(layer, None)


def test_checkpoint_needs_come_from_the_codecs():
    assert not needs_checkpoints(load_fixture("llama")[0])
    for name in HYBRIDS + ("gemma3_text",):
        assert needs_checkpoints(load_fixture(name)[0])
