"""The ``ssm.gated_delta`` codec: bit-exact round trips, folding before writing, damage refused."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, List

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from promptstore import PromptStore
from promptstore.codecs import decode_layer, encode_layer, layer_coverage, storage_kind
from promptstore.errors import CorruptEntry, CoverageMismatch
from promptstore.jobs.interop import write_mlx_cache_file
from promptstore.ssm import RoundError, SSMCache, adapt, make_prompt_cache
from _bits import bits_equal
from test_ssm import verify_round

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HYBRIDS = ("qwen3_next", "qwen3_5")
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
WINDOW = [31, 32, 33, 34, 35]


def _det(shape, dtype, seed: int) -> mx.array:
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64) + seed * 7919
    vals = ((i * 2654435761) % 2003 - 1001).astype(np.float32) / 257.0
    return mx.array(vals.reshape(shape)).astype(dtype)


def ssm_samples() -> List[Any]:
    """Deterministic populated serial SSMCache layers (fp16 conv, bf16 conv), storable as entries.

    tests/_samples.py can register them for the generic codec tests.
    """
    return [
        SSMCache.from_parts(_det((1, 3, 96), mx.float16, 1), _det((1, 4, 16, 32), mx.float32, 2), [37]),
        SSMCache.from_parts(_det((1, 3, 64), mx.bfloat16, 5), _det((1, 2, 32, 32), mx.float32, 6), [4]),
    ]


def batch_sample() -> SSMCache:
    """A batch of 3 with left padding (encodable, but not an entry: no single coverage)."""
    return SSMCache.from_parts(
        _det((3, 3, 96), mx.bfloat16, 3), _det((3, 4, 16, 32), mx.float32, 4), [5, 0, 12], left_padding=[0, 2, 1]
    )


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(bits_equal(a, b).item())


def _same_layer(a: SSMCache, b: SSMCache) -> bool:
    return (
        _same(a[0], b[0])
        and _same(a[1], b[1])
        and a.offsets == b.offsets
        and _same(a.left_padding, b.left_padding)
        and _same(a.lengths, b.lengths)
    )


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    model, _ = load(str(MODELS / arch))
    adapt(model)
    return model


def _forward(model, cache, tokens):
    return model(mx.array([tokens]), cache=cache)


def _greedy(model, cache, logits, steps):
    toks, outs = [], []
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(steps):
        toks.append(int(y.item()))
        out = model(y[:, None], cache=cache)
        outs.append(out)
        y = mx.argmax(out[:, -1, :], axis=-1)
    return toks, outs


@pytest.mark.parametrize("i", range(4))
def test_round_trip_is_bit_exact(i):
    layer = ([SSMCache()] + ssm_samples() + [batch_sample()])[i]
    enc = encode_layer(layer)
    assert enc.kind == storage_kind(layer) == "ssm.gated_delta" and enc.version == 1
    back = decode_layer(enc.kind, enc.version, enc.arrays, enc.meta)
    assert type(back) is SSMCache and _same_layer(layer, back)
    again = encode_layer(back)
    assert again.meta == enc.meta and all(_same(enc.arrays[k], again.arrays[k]) for k in enc.arrays)


def test_coverage_is_the_serial_offset_and_a_batch_is_refused():
    fresh, (serial, _), batch = SSMCache(), ssm_samples(), batch_sample()
    assert layer_coverage(fresh) == 0 and layer_coverage(serial) == 37
    with pytest.raises(CoverageMismatch, match="extract"):
        layer_coverage(batch)
    assert layer_coverage(batch.extract(2)) == 12


BAD_META = [
    {},
    {"offsets": "7", "conv": True, "state": True, "left_padding": None, "lengths": None},
    {"offsets": [], "conv": False, "state": False, "left_padding": None, "lengths": None},
    {"offsets": [-1], "conv": True, "state": True, "left_padding": None, "lengths": None},
    {"offsets": [True], "conv": True, "state": True, "left_padding": None, "lengths": None},
    {"offsets": [37], "conv": True, "state": False, "left_padding": None, "lengths": None},
    {"offsets": [37], "conv": False, "state": False, "left_padding": None, "lengths": None},
    {"offsets": [37], "conv": True, "state": True, "left_padding": [0, 1], "lengths": None},
    {"offsets": [37], "conv": True, "state": True, "left_padding": None, "lengths": ["x"]},
    {"offsets": [37, 1], "conv": True, "state": True, "left_padding": None, "lengths": None},
    {"offsets": [37], "conv": 1, "state": True, "left_padding": None, "lengths": None},
]


@pytest.mark.parametrize("meta", BAD_META, ids=range(len(BAD_META)))
def test_malformed_meta_is_corrupt(meta):
    enc = encode_layer(ssm_samples()[0])
    with pytest.raises(CorruptEntry):
        decode_layer(enc.kind, enc.version, enc.arrays, meta)


def test_malformed_arrays_are_corrupt():
    enc = encode_layer(ssm_samples()[0])
    broken = [
        {"state": enc.arrays["state"]},  # conv missing
        {"conv": enc.arrays["conv"], "state": enc.arrays["state"][0]},  # wrong rank
        {"conv": enc.arrays["conv"], "state": mx.concatenate([enc.arrays["state"]] * 2)},  # wrong rows
        {"conv": enc.arrays["conv"].astype(mx.int32), "state": enc.arrays["state"]},  # not floats
        {"conv": np.zeros((1, 3, 96)), "state": enc.arrays["state"]},  # not an mx.array
    ]
    for arrays in broken:
        with pytest.raises(CorruptEntry):
            decode_layer(enc.kind, enc.version, arrays, enc.meta)


def test_a_put_of_slots_the_decoder_would_refuse_is_invalid_input(tmp_path):
    """The encoder runs the decoder's checks: a put of an SSMCache whose slots
    could never be read back (integer conv, float64 or 3-D state, left
    padding for other rows) is refused before anything is written. It used to
    succeed, replacing a good entry by one every get refused as CorruptEntry."""
    from promptstore.errors import InvalidInput

    good = ssm_samples()[0]
    conv, state = good[0], good[1]
    bad = [
        SSMCache.from_parts(conv.astype(mx.int32), state, [37]),
        SSMCache.from_parts(conv, state.astype(mx.float64, stream=mx.cpu), [37]),  # mlx's GPU backends have no float64
        SSMCache.from_parts(conv, state[:, 0], [37]),
        SSMCache.from_parts(conv, state, [37], left_padding=[0, 0]),
    ]
    tokens = list(range(37))
    with PromptStore(tmp_path / "s") as store:
        store.put("m@0123456789abcdef", tokens, [good])
        for layer in bad:
            with pytest.raises(InvalidInput):
                encode_layer(layer)
            with pytest.raises(InvalidInput):
                store.put("m@0123456789abcdef", tokens, [layer])
            assert _same_layer(store.get("m@0123456789abcdef", tokens)[0], good)


def _pending_cache(model, keep):
    cache = make_prompt_cache(model)
    _forward(model, cache, PROMPT)
    verify_round(model, cache, WINDOW, keep)
    return cache


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
def test_encoding_writes_the_folded_state(arch):
    model = _model(arch)
    cache = _pending_cache(model, 2)
    assert cache[0].has_pending
    enc = encode_layer(cache[0])
    fresh = make_prompt_cache(model)
    _forward(model, fresh, PROMPT)
    _forward(model, fresh, WINDOW[:2])
    assert _same(enc.arrays["conv"], fresh[0][0]) and _same(enc.arrays["state"], fresh[0][1])
    assert enc.meta["offsets"] == [len(PROMPT) + 2]


def test_persisting_an_open_round_is_refused(tmp_path):
    model = _model("qwen3_next")
    cache = make_prompt_cache(model)
    _forward(model, cache, PROMPT)
    cache[0].begin_round()
    with pytest.raises(RoundError):
        encode_layer(cache[0])
    with PromptStore(tmp_path / "s") as store:
        with pytest.raises(RoundError):
            store.put("m@test", PROMPT, cache)
        assert store.get("m@test", PROMPT) is None
    out = tmp_path / "open.safetensors"
    with pytest.raises(RoundError):  # nor written as an mlx-lm file: the round's outcome is undecided
        write_mlx_cache_file(str(out), cache, "m@test", tokens=PROMPT)
    assert not out.exists() and cache[0].in_round


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
def test_persisted_pending_cache_continues_like_the_uninterrupted_run(arch, tmp_path):
    """Save with pending rows, restore, continue greedily: same tokens and logits as
    continuing the saved cache, and as a run that never speculated."""
    model = _model(arch)
    keep = 3
    tokens = PROMPT + WINDOW[:keep]
    saved = _pending_cache(model, keep)
    with PromptStore(tmp_path / "s") as store:
        store.put("m@test", tokens, saved)
    with PromptStore(tmp_path / "s") as store:
        restored = store.get("m@test", tokens)
    assert [type(c).__qualname__ for c in restored] == ["SSMCache", "KVCache", "SSMCache", "KVCache"]
    assert restored[0].offset == len(tokens) and not restored[0].has_pending

    plain = make_prompt_cache(model)  # the run that never speculated
    _forward(model, plain, PROMPT)
    _forward(model, plain, WINDOW[:keep])
    runs = {"restored": restored, "saved": saved, "plain": plain}
    next_token = mx.array([[77]])
    outs = {name: model(next_token, cache=cache) for name, cache in runs.items()}
    assert _same(outs["restored"], outs["saved"]) and _same(outs["restored"], outs["plain"])
    results = {name: _greedy(model, cache, outs[name], 8) for name, cache in runs.items()}
    toks = {name: r[0] for name, r in results.items()}
    assert toks["restored"] == toks["saved"] == toks["plain"]
    for a, b, c in zip(results["restored"][1], results["saved"][1], results["plain"][1]):
        assert _same(a, b) and _same(a, c)
