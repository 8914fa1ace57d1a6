"""Every registered codec round-trips bit-exactly; the registry fails closed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from promptstore import PromptStore, UnknownStorageKind, UnsupportedVersion
from promptstore.codecs import Codec, codecs, decode_layer, encode_layer, layer_coverage, register, storage_kind, unregister
from promptstore.errors import InvalidInput
from _samples import SAMPLES, assert_same, continue_both, visible_state

KINDS = [c.kind for c in codecs()]


def _cases():
    for kind in KINDS:
        if kind in SAMPLES:
            for i, _ in enumerate(SAMPLES[kind]()):
                yield pytest.param(kind, i, id=f"{kind}-{i}")


def test_every_kind_has_samples():
    missing = [k for k in KINDS if k not in SAMPLES]
    assert not missing, f"codecs without samples in tests/_samples.py: {missing}"


@pytest.mark.parametrize("kind,i", list(_cases()))
def test_codec_round_trip(kind, i):
    layer = SAMPLES[kind]()[i]
    enc = encode_layer(layer)
    assert enc.kind.split("(")[0] == kind
    back = decode_layer(enc.kind, enc.version, enc.arrays, enc.meta)
    assert type(back) is type(layer)
    assert_same(visible_state(layer), visible_state(back))
    again = encode_layer(back)
    assert again.meta == enc.meta and again.kind == enc.kind
    assert_same(dict(enc.arrays), dict(again.arrays))
    continue_both(layer, back)


@pytest.mark.parametrize("kind,i", list(_cases()))
def test_store_round_trip(tmp_path, kind, i):
    layer = SAMPLES[kind]()[i]
    cov = layer_coverage(layer)
    tokens = list(range(3, 3 + (cov if cov else 11)))
    with PromptStore(tmp_path / "s") as s:
        s.put("m@test", tokens, [layer], coverage=len(tokens))
    with PromptStore(tmp_path / "s") as s:
        (back,) = s.get("m@test", tokens)
    assert type(back) is type(layer)
    assert_same(visible_state(layer), visible_state(back))
    continue_both(layer, back)


def test_kv_writes_only_covered_tokens():
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 10, 64), mx.bfloat16), mx.zeros((1, 2, 10, 64), mx.bfloat16))
    assert c.keys.shape[2] == 256
    enc = encode_layer(c)
    assert enc.arrays["keys"].shape == (1, 2, 10, 64)
    c.trim(4)
    assert encode_layer(c).arrays["values"].shape == (1, 2, 6, 64)


def test_rotating_keeps_ring_position():
    c = SAMPLES["kv.rotating"]()[1]
    back = decode_layer(*(lambda e: (e.kind, e.version, e.arrays, e.meta))(encode_layer(c)))
    assert (back._idx, back.keep, back.max_size, back.offset) == (c._idx, c.keep, c.max_size, c.offset)


def test_unregistered_subclass_refused():
    class MyKV(KVCache):
        pass

    layer = MyKV()
    with pytest.raises(UnknownStorageKind, match="subclass"):
        encode_layer(layer)
    with pytest.raises(UnknownStorageKind):
        storage_kind(layer)


def test_unknown_kind_and_newer_version_refused():
    enc = encode_layer(SAMPLES["kv"]()[0])
    with pytest.raises(UnknownStorageKind):
        decode_layer("kv.from_the_future", 1, enc.arrays, enc.meta)
    with pytest.raises(UnsupportedVersion):
        decode_layer("kv", 2, enc.arrays, enc.meta)
    with pytest.raises(UnsupportedVersion):
        decode_layer("kv", 0, enc.arrays, enc.meta)


def test_register_twice_refused():
    class Dup(Codec):
        kind = "kv"
        types = ()

    with pytest.raises(InvalidInput, match="registered already"):
        register(Dup())

    class DupType(Codec):
        kind = "kv.other"
        types = (RotatingKVCache,)

    with pytest.raises(InvalidInput, match="registered already"):
        register(DupType())
    assert "kv.other" not in [c.kind for c in codecs()]


def test_custom_codec_registers_and_routes_exactly():
    class Special(KVCache):
        pass

    class SpecialCodec(Codec):
        kind = "test.special"
        types = (Special,)

        def encode(self, layer):
            return {"x": mx.array([layer.offset])}, {}

        def decode(self, arrays, meta, version):
            s = Special()
            s.offset = int(arrays["x"].item())
            return s

    register(SpecialCodec())
    try:
        s = Special()
        s.offset = 5
        enc = encode_layer(s)
        assert enc.kind == "test.special"
        assert decode_layer(enc.kind, 1, enc.arrays, enc.meta).offset == 5
        assert storage_kind(KVCache()) == "kv"
    finally:
        unregister("test.special")


def test_cache_list_kind_names_inner_kinds():
    layer = SAMPLES["list"]()[0]
    assert storage_kind(layer) == "list(kv,kv.rotating)"
