"""SSMCache as a true drop-in for mlx-lm's ArraysCache: coverage survives
``state``/``from_state``, mlx-lm's own prompt-cache files round-trip it (as
ArraysCache), and setting ``state`` during an open round is refused."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from conftest import HYBRIDS
from promptstore import PromptStore
from promptstore.ssm import RoundError, SSMCache, gated_delta_layers, to_ssm
from _bits import bits_equal
from test_ssm import PROMPT, WINDOW, fixture, prefilled, same, verify_round


def _next_logits_equal(model, a, b, token: int = 77) -> bool:
    x = mx.array([[token]])
    return bool(bits_equal(model(x, cache=a), model(x, cache=b)).item())


@pytest.mark.parametrize("arch", HYBRIDS)
def test_from_state_keeps_coverage(arch):
    model, _ = fixture(arch, False)
    cache = prefilled(model)
    back = SSMCache.from_state(cache[0].state)
    assert back.offset == len(PROMPT)
    assert same(back[0], cache[0][0]) and same(back[1], cache[0][1])
    other = prefilled(model, PROMPT[:4])
    batch = SSMCache.merge([cache[0], other[0]])
    assert SSMCache.from_state(batch.state).offsets == [len(PROMPT), 4]
    # mlx-lm's own class takes the state as its own
    plain = ArraysCache.from_state(cache[0].state)
    assert same(plain[0], cache[0][0]) and same(plain[1], cache[0][1])
    # a plain ArraysCache state carries no coverage: give it
    layer = SSMCache.from_arrays_cache(plain, len(PROMPT))
    assert layer.offset == len(PROMPT) and same(layer[1], cache[0][1])


@pytest.mark.shape_dependent
def test_setting_state_during_an_open_round_is_refused_and_the_round_survives():
    model, _ = fixture("qwen3_next", True)
    cache = prefilled(model)
    before = cache[0].state
    for c in cache:
        if isinstance(c, SSMCache):
            c.begin_round()
    model(mx.array([WINDOW]), cache=cache)
    with pytest.raises(RoundError):
        cache[0].state = before
    assert cache[0].in_round
    for c in cache:
        if isinstance(c, SSMCache):
            c.rollback(2)
        else:
            c.trim(len(WINDOW) - 2)
    ref = prefilled(model, PROMPT, WINDOW[:2])
    assert cache[0].offset == len(PROMPT) + 2
    assert same(cache[0][0], ref[0][0]) and same(cache[0][1], ref[0][1])


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
def test_mlx_lm_prompt_cache_files_round_trip_ssm_layers(tmp_path, arch):
    model, _ = fixture(arch, True)
    cache = prefilled(model)
    verify_round(model, cache, WINDOW, 3)  # pending rows: the file holds the folded state
    assert cache[0].has_pending
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"note": "x"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)  # any mlx-lm reads it
    assert meta == {"note": "x"}
    assert [type(c) for c in loaded] == [ArraysCache, KVCache, ArraysCache, KVCache]
    ref = prefilled(model, PROMPT, WINDOW[:3])
    for i in (0, 2):
        assert same(loaded[i][0], ref[i][0]) and same(loaded[i][1], ref[i][1])
    n = len(PROMPT) + 3
    # back to SSMCache with the coverage the KV layers report, then into the store
    again = to_ssm(loaded, n, gated_delta_layers(model))
    assert [type(c) for c in again] == [SSMCache, KVCache, SSMCache, KVCache] and again[0].offset == n
    with PromptStore(tmp_path / "s") as st:
        info = st.put("m@test", PROMPT + WINDOW[:3], again)
        assert info.kinds == ("ssm.gated_delta", "kv", "ssm.gated_delta", "kv")
    assert _next_logits_equal(model, again, ref)  # continues exactly like the uninterrupted run


def test_from_arrays_cache_refuses_what_it_cannot_cover():
    from promptstore.errors import InvalidInput

    with pytest.raises(InvalidInput, match="empty"):
        SSMCache.from_arrays_cache(ArraysCache(2), 5)
    with pytest.raises(InvalidInput, match="two slots"):
        SSMCache.from_arrays_cache(ArraysCache(3), 0)
    assert SSMCache.from_arrays_cache(ArraysCache(2), 0).empty()
