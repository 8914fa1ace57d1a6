"""Bad input to the API, caches whose arrays disagree with their own state:
a typed error, the entry refused, and what was stored kept bit for bit."""

from __future__ import annotations

import pytest

from _content import same_cache

from promptstore import InvalidInput, PromptStore
from promptstore.format import _entry
from test_bad_input_api import _arrays_of, _kv


def _rotating(idx):
    from mlx_lm.models.cache import RotatingKVCache
    import mlx.core as mx

    r = RotatingKVCache(8)
    r.keys, r.values, r.offset, r._idx = mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)), 20, idx
    return r


def _quantized_short_biases():
    from mlx_lm.models.cache import KVCache
    import mlx.core as mx

    c = KVCache()
    c.keys, c.values, c.offset = mx.ones((1, 2, 20, 64)), mx.ones((1, 2, 20, 64)), 20
    q = c.to_quantized(32, 4)
    q.keys = (q.keys[0], q.keys[1], q.keys[2][..., :10, :])
    return q


def _concat(offset):
    from mlx_lm.models.cache import ConcatenateKVCache
    import mlx.core as mx

    c = ConcatenateKVCache()
    c.keys, c.values, c.offset = mx.ones((1, 2, 20, 4)), mx.ones((1, 2, 20, 4)), offset
    return c


# (a cache of 20 tokens by its own account, the error): each was stored and
# replaced an intact entry, and every read of it then failed (or, keys None,
# read back as an empty cache).
UNREADABLE = [
    pytest.param(lambda: [_kv(15, 20)], 20, "InvalidInput", id="keys-shorter-than-offset"),
    pytest.param(lambda: [_kv(20, 20, keys=False)], 20, "CoverageMismatch", id="keys-none-values-set"),
    pytest.param(lambda: [_rotating(12)], 20, "InvalidInput", id="rotating-index-past-keys"),
    pytest.param(lambda: [_rotating(-3)], 20, "InvalidInput", id="rotating-negative-index"),
    pytest.param(lambda: [_quantized_short_biases()], 20, "InvalidInput", id="quantized-short-biases"),
    pytest.param(lambda: [_concat(30)], 30, "InvalidInput", id="concat-offset-past-keys"),
    # what the manifest reader refuses: an array of more than 8 dimensions, more than MAX_LAYERS layers
    pytest.param(lambda: [_kv(20, 20), _arrays_of(9)], 20, "InvalidInput", id="array-of-9-dimensions"),
    pytest.param(lambda: [_kv(20, 20)] * (_entry.MAX_LAYERS + 1), 20, "InvalidInput", id="too-many-layers"),
]


@pytest.mark.parametrize("bad,n,error", UNREADABLE)
def test_a_cache_that_could_not_be_read_back_is_refused_and_the_entry_kept(tmp_path, bad, n, error):
    import mlx.core as mx

    import promptstore.errors as errors

    layers = bad()
    toks = list(range(1, n + 1))
    good = [_kv(n, n)]
    good[0].keys = mx.arange(2 * n * 4, dtype=mx.float32).reshape(1, 2, n, 4)
    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", toks, good)
        with pytest.raises(getattr(errors, error)):
            st.put("m@x", toks, layers)
        assert same_cache(st.get("m@x", toks), good)  # the intact entry is still there, bit for bit
        assert st.verify().problems == ()


NOT_MLX = [
    pytest.param(lambda: __import__("numpy").ones((1, 2, 20, 4), "float32"), "ndarray", id="numpy"),
    pytest.param(lambda: [1], "cannot store this KVCache", id="list"),
    pytest.param(lambda: __import__("mlx.core", fromlist=["ones"]).ones((20,)), "cannot store this KVCache", id="one-dimension"),
]


@pytest.mark.parametrize("make,message", NOT_MLX)
def test_layer_arrays_that_are_not_mlx_arrays_of_a_cache_layout_are_refused(tmp_path, make, message):
    c = _kv(20, 20)
    c.keys, c.values = make(), make()
    with PromptStore(tmp_path / "s") as st:
        with pytest.raises(InvalidInput, match=message):
            st.put("m@x", list(range(20)), [c])
        assert list(st.entries()) == []


def test_an_arrays_slot_that_is_not_an_mlx_array_is_refused(tmp_path):
    import numpy as np
    from mlx_lm.models.cache import ArraysCache

    a = ArraysCache(1)
    a[0] = np.ones((1, 3), np.float32)
    with PromptStore(tmp_path / "s") as st, pytest.raises(InvalidInput, match="not an mlx array"):
        st.put("m@x", list(range(20)), [a], coverage=20)
