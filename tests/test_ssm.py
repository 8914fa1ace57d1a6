"""SSMCache: drop-in for mlx-lm's ArraysCache, the adapter, verify rounds, row moves.

Every numerical comparison is bit-exact (``mx.array_equal``, dtype included).
Reference runs use a separately loaded, never adapted copy of each fixture model.
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, _merge_caches, _right_pad_prompts, generate, stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from promptstore.codecs import encode_layer
from promptstore.errors import InvalidInput
from promptstore.ssm import RoundError, SSMCache, adapt, make_prompt_cache, unadapt
from _bits import bits_equal

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HYBRIDS = ("qwen3_next", "qwen3_5")
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 8, 9]
WINDOW = [31, 32, 33, 34, 35]


@functools.lru_cache(maxsize=None)
def fixture(name: str, adapted: bool):
    """A private copy of a fixture model (so adapting never touches shared ones)."""
    model, tokenizer = load(str(MODELS / name))
    if adapted:
        assert adapt(model) == 2  # the fixtures have two gated-DeltaNet layers
    return model, tokenizer


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(bits_equal(a, b).item())


def ssm(cache):
    return [c for c in cache if isinstance(c, (SSMCache, ArraysCache))]


def same_ssm(a, b) -> bool:
    return all(same(x[0], y[0]) and same(x[1], y[1]) for x, y in zip(ssm(a), ssm(b)))


def prefilled(model, tokens=PROMPT, then=()):
    """A fresh cache after a forward over ``tokens`` and then one over ``then``."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    if then:
        model(mx.array([list(then)]), cache=cache)
    return cache


def verify_round(model, cache, window, keep):
    """Run a verify window in a round and keep its first ``keep`` positions."""
    for c in cache:
        if isinstance(c, SSMCache):
            c.begin_round()
    logits = model(mx.array([window]), cache=cache)
    for c in cache:
        if isinstance(c, SSMCache):
            c.rollback(keep)
        else:
            c.trim(len(window) - keep)
    return logits


# -- drop-in and adapter -------------------------------------------------------


@pytest.mark.parametrize("arch", HYBRIDS)
def test_make_prompt_cache_puts_ssm_in_linear_layers(arch):
    model, _ = fixture(arch, False)
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [SSMCache, KVCache, SSMCache, KVCache]
    c = cache[0]
    assert c.storage_kind == "ssm.gated_delta"
    assert c.is_trimmable() is False and c.bytes_per_token() == 0
    assert c.empty() and c.offset == 0 and c.nbytes == 0


@pytest.mark.parametrize("arch", HYBRIDS)
def test_outputs_bit_identical_to_mlx_lm(arch):
    """ArraysCache on plain mlx-lm == SSMCache unadapted == SSMCache through the adapter."""
    plain, _ = fixture(arch, False)
    adapted, _ = fixture(arch, True)
    runs = [(plain, mlx_make_prompt_cache(plain)), (plain, make_prompt_cache(plain)), (adapted, make_prompt_cache(adapted))]
    steps = [PROMPT[:7], PROMPT[7:], [4], [77], WINDOW]  # prefill chunks, decodes, a window
    for step in steps:
        outs = [model(mx.array([step]), cache=cache) for model, cache in runs]
        assert all(same(outs[0], o) for o in outs[1:])
        assert same_ssm(runs[0][1], runs[1][1]) and same_ssm(runs[0][1], runs[2][1])
    assert runs[2][1][0].offset == runs[2][1][1].offset == len(PROMPT) + 2 + len(WINDOW)


def test_adapt_is_reversible_and_keeps_parameters():
    model, _ = load(str(MODELS / "qwen3_next"))
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert adapt(model) == 2 and adapt(model) == 2  # idempotent
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert unadapt(model) == 2 and unadapt(model) == 0
    llama, _ = load(str(MODELS / "llama"))
    assert adapt(llama) == 0 and all(type(c) is KVCache for c in make_prompt_cache(llama))


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("adapted", [False, True])
def test_padded_batch_prefill_matches_serial_rows(arch, adapted):
    """Right-padded prefill: padding changes neither slot, conv tail and offset per row."""
    model, _ = fixture(arch, adapted)
    rows = [PROMPT[:7], [4, 5, 6], [100, 200, 300, 301, 302]]
    lengths = [len(r) for r in rows]
    L = max(lengths)
    batch = _merge_caches([make_prompt_cache(model) for _ in rows])
    for c in batch:
        c.prepare(lengths=lengths, right_padding=[L - n for n in lengths])
    model(_right_pad_prompts(rows), cache=batch)
    for c in batch:
        c.finalize()
    assert batch[0].offsets == lengths
    for i, row in enumerate(rows):
        serial = prefilled(model, row)
        extracted = [c.extract(i) for c in batch]
        assert same_ssm(extracted, serial)
        assert [c.row_offset(i) for c in ssm(batch)] == [len(row)] * 2


# -- verify rounds -------------------------------------------------------------


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
def test_rollback_folds_to_fresh_forward_serial(arch):
    model, _ = fixture(arch, True)
    S = len(WINDOW)
    for keep in range(S + 1):
        cache = prefilled(model)
        verify_round(model, cache, WINDOW, keep)
        assert all(c.has_pending == (0 < keep < S) for c in ssm(cache))
        fresh = prefilled(model, PROMPT, WINDOW[:keep])
        assert same_ssm(cache, fresh)
        assert [c.offset for c in cache] == [len(PROMPT) + keep] * 4
        # and the next forward continues identically
        assert same(model(mx.array([[7]]), cache=cache), model(mx.array([[7]]), cache=fresh))


@pytest.mark.shape_dependent
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("keeps", [[2, 0, 5], [4, 1, 3], np.array([3, 5, 0])])
def test_rollback_folds_per_row_keeps_in_a_batch_of_3(arch, keeps):
    # numpy keeps and row numbers (what a caller holding numpy acceptances passes) were refused
    as_np = isinstance(keeps, np.ndarray)
    model, _ = fixture(arch, True)
    prompts = [PROMPT[:4], PROMPT[4:8], [8, 9, 10, 11]]
    windows = [WINDOW, [41, 42, 43, 44, 45], [51, 52, 53, 54, 55]]
    batch = _merge_caches([prefilled(model, p) for p in prompts])
    for c in batch:
        if isinstance(c, SSMCache):
            c.begin_round()
    model(mx.array(windows), cache=batch)
    for c in ssm(batch):
        c.rollback(keeps)
        assert c.offsets == [4 + k for k in keeps] and c.has_pending
        assert all(type(o) is int for o in c.offsets)
    for i, (p, w, k) in enumerate(zip(prompts, windows, keeps)):
        fresh = prefilled(model, p, w[:k])
        i = np.int64(i) if as_np else i
        rows = [c.extract(i) if isinstance(c, SSMCache) else None for c in batch]
        assert all(r.offsets == [4 + int(k)] and type(r.offset) is int for r in rows if r is not None)
        assert same_ssm([r for r in rows if r is not None], ssm(fresh))


def test_rollback_builds_no_graph_and_restores_the_snapshot():
    model, _ = fixture("qwen3_5", True)
    cache = prefilled(model)
    c = cache[0]
    before = (c[0], c[1])
    c.begin_round()
    model(mx.array([WINDOW]), cache=cache)
    assert not same(c[1], before[1])
    c.rollback(2)
    # the restored slots are the snapshot objects themselves: nothing was computed
    assert c._slots[0] is before[0] and c._slots[1] is before[1] and c.has_pending
    c.begin_round()
    c.commit()  # an empty round leaves the pending rows alone
    assert c.has_pending


READS = {
    "state": lambda c: c.state,
    "slot": lambda c: c[1],
    "cache": lambda c: c.cache,
    "nbytes": lambda c: c.nbytes,
    "empty": lambda c: c.empty(),
    "extract": lambda c: c.extract(0),
    "filter": lambda c: c.filter([0]),
    "merge": lambda c: SSMCache.merge([c]),
    "encode": lambda c: encode_layer(c),
}


@pytest.mark.shape_dependent
@pytest.mark.parametrize("read", sorted(READS))
def test_every_read_folds_pending_rows(read):
    model, _ = fixture("qwen3_next", True)
    cache = prefilled(model)
    verify_round(model, cache, WINDOW, 3)
    c = cache[2]
    assert c.has_pending
    READS[read](c)
    assert not c.has_pending
    fresh = prefilled(model, PROMPT, WINDOW[:3])
    assert same(c._slots[0], fresh[2][0]) and same(c._slots[1], fresh[2][1])


def test_round_errors():
    model, _ = fixture("qwen3_5", True)
    cache = prefilled(model)
    c = cache[0]
    with pytest.raises(RoundError):
        c.rollback(0)
    with pytest.raises(RoundError):
        c.commit()
    for cc in ssm(cache):
        cc.begin_round()
    with pytest.raises(RoundError):
        c.begin_round()
    model(mx.array([WINDOW]), cache=cache)
    for bad in (-1, 6, True, 2.0, [1, 2], "3"):
        with pytest.raises(InvalidInput):
            c.rollback(bad)
    assert c.in_round  # a refused keep leaves the round open
    with pytest.raises(RoundError):  # a second window in one round
        model(mx.array([WINDOW]), cache=cache)
    for move in (lambda: c.extract(0), lambda: c.filter([0]), lambda: SSMCache.merge([c]), lambda: c.extend(SSMCache())):
        with pytest.raises(RoundError):
            move()
    with pytest.raises(RoundError):  # persisting an open round
        encode_layer(c)
    for cc in ssm(cache):
        cc.rollback(5)
    assert not c.in_round and c.offset == len(PROMPT) + 5


def test_bad_arguments_are_invalid_input():
    model, _ = fixture("qwen3_5", True)
    block = model.layers[0].linear_attn
    qkv = mx.zeros((1, 2, block.conv_dim))
    ab = mx.zeros((1, 2, block.num_v_heads))
    with pytest.raises(InvalidInput):
        SSMCache().recur_decode(block, qkv, ab, ab)  # two positions
    with pytest.raises(InvalidInput):
        SSMCache.from_parts(mx.zeros((2, 3, 8)), mx.zeros((2, 1, 4, 4)), [1])  # rows disagree
    with pytest.raises(InvalidInput):
        SSMCache.from_parts(mx.zeros((1, 3, 8)), None, [1])  # one slot alone
    with pytest.raises(InvalidInput):
        SSMCache.from_parts(None, None, [-1])
    with pytest.raises(InvalidInput):
        SSMCache().extend(ArraysCache(2))


def test_round_needs_the_adapter():
    plain, _ = fixture("qwen3_next", False)
    cache = prefilled(plain)
    cache[0].begin_round()
    with pytest.raises(RoundError, match="adapt"):
        plain(mx.array([WINDOW]), cache=cache)


def test_decode_round_replays_decodes():
    """A round of single-position decodes (the draft side) folds like a window."""
    model, _ = fixture("qwen3_5", True)
    cache = prefilled(model)
    reference = prefilled(model)
    for c in ssm(cache):
        c.begin_round()
    for t in WINDOW[:4]:
        model(mx.array([[t]]), cache=cache)
    for c in cache:
        if isinstance(c, SSMCache):
            c.rollback(2)
        else:
            c.trim(2)
    for t in WINDOW[:2]:
        model(mx.array([[t]]), cache=reference)
    assert same_ssm(cache, reference)
    assert same(model(mx.array([[9]]), cache=cache), model(mx.array([[9]]), cache=reference))


# -- row moves ---------------------------------------------------------------------


def _big_batch(rows=8):
    mx.random.seed(3)
    conv = mx.random.normal((rows, 3, 8192)).astype(mx.bfloat16)
    state = mx.random.normal((rows, 32, 128, 128))
    mx.eval(conv, state)
    return SSMCache.from_parts(conv, state, list(range(10, 10 + rows)))


def test_extract_holds_only_its_row_and_frees_the_batch():
    gc.collect()
    base = mx.get_active_memory()
    batch = _big_batch()
    batch_bytes = batch.nbytes
    assert mx.get_active_memory() - base >= batch_bytes
    expected = (mx.contiguous(batch[0][3:4]), mx.contiguous(batch[1][3:4]))
    mx.eval(expected)
    row = batch.extract(3)  # not evaluated by the caller, as mlx-lm's BatchGenerator does
    del batch
    gc.collect()
    held = mx.get_active_memory() - base - sum(e.nbytes for e in expected)
    assert held <= row.nbytes + (64 << 10), f"{held} bytes held for a {row.nbytes}-byte row"
    assert row.nbytes * 8 == batch_bytes and row.offset == 13 and row.batch_size == 1
    assert same(row[0], expected[0]) and same(row[1], expected[1])


def test_filter_refuses_rows_out_of_range_and_changes_nothing():
    batch = _big_batch(4)
    conv, offsets = batch[0], batch.offsets
    for bad in ([0, 5], [-5], ["x"]):
        with pytest.raises(InvalidInput, match="out of range"):
            batch.filter(bad)
        assert batch.offsets == offsets and same(batch[0], conv)
    batch.filter([-1])
    assert batch.offsets == offsets[-1:]


def test_filter_in_place_and_merge():
    batch = _big_batch(4)
    conv, state = batch[0], batch[1]
    batch.filter([3, 1])
    assert batch.offsets == [13, 11] and batch.batch_size == 2
    assert same(batch[1], mx.concatenate([state[3:4], state[1:2]]))
    solo = _big_batch(1)
    merged = SSMCache.merge(batch, solo)  # a prefilled solo row joins a running batch
    assert merged.offsets == [13, 11, 10]
    assert same(merged[0], mx.concatenate([conv[3:4], conv[1:2], solo[0]]))
    assert merged[1] is not batch[1] and merged[1] is not solo[1]
    alone = SSMCache.merge(None, solo)  # nothing to concatenate: solo's arrays are taken
    assert alone[1] is solo[1] and alone.offset == 10
    batch.extend(solo)
    assert batch.offsets == [13, 11, 10] and same(batch[1], merged[1])
    with pytest.raises(InvalidInput):
        batch.offset
    with pytest.raises(InvalidInput):
        batch.row_offset(3)


# -- mlx-lm's generation loops, unchanged ---------------------------------------------


@pytest.mark.parametrize("arch", HYBRIDS)
def test_generate_and_stream_generate_run_unchanged(arch):
    model, tokenizer = fixture(arch, False)
    want = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    want_text = generate(model, tokenizer, PROMPT, max_tokens=12)
    for m in (model, fixture(arch, True)[0]):
        cache = make_prompt_cache(m)
        got = [r.token for r in stream_generate(m, tokenizer, PROMPT, max_tokens=12, prompt_cache=cache)]
        assert got == want
        assert cache[0].offset == cache[1].offset > len(PROMPT)  # SSM coverage tracks attention's
        assert generate(m, tokenizer, PROMPT, max_tokens=12, prompt_cache=make_prompt_cache(m)) == want_text


def _batch_run(model, prompts, caches):
    gen = BatchGenerator(model, max_tokens=8, prefill_batch_size=4, completion_batch_size=4, prefill_step_size=5)
    uids = gen.insert(prompts, caches=caches)
    tokens, final = {u: [] for u in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                final[r.uid] = r.prompt_cache
    gen.close()
    return [tokens[u] for u in uids], [final[u] for u in uids]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_batch_generator_runs_unchanged(arch):
    plain, _ = fixture(arch, False)
    prompts = [PROMPT + [12, 13, 14], [4, 5, 6], [100, 200, 300, 301, 302, 303, 304]]
    want, want_caches = _batch_run(plain, prompts, None)
    for model in (plain, fixture(arch, True)[0]):
        got, caches = _batch_run(model, prompts, [make_prompt_cache(model) for _ in prompts])
        assert got == want
        for c, w in zip(caches, want_caches):
            assert type(c[0]) is SSMCache and c[0].offset == c[1].offset
            assert same_ssm(c, w)


def test_the_state_setter_refuses_slots_that_disagree():
    """Slots of different row counts (a row past one slot's end was then read
    out of bounds by extract, and stored), one slot without the other, or
    slots that are not arrays are InvalidInput; the cache is left as it was."""
    from promptstore.errors import InvalidInput
    from promptstore.ssm import SSMState

    conv, state = mx.zeros((2, 3, 8)), mx.ones((2, 2, 4, 4))
    c = SSMCache.from_parts(conv, state, [4, 4])
    for slots, offsets in (
        ([conv, state[:1]], [4, 4]),
        ([conv[:1], state], None),
        ([None, state], [4, 4]),
        ([conv, None], [4, 4]),
        ([conv.tolist(), state], [4, 4]),
    ):
        v = SSMState((slots, None, None), offsets=offsets) if offsets is not None else (slots, None, None)
        with pytest.raises(InvalidInput):
            c.state = v
        assert c.offsets == [4, 4] and c[0].shape == (2, 3, 8) and c[1].shape == (2, 2, 4, 4)
    c.state = SSMState(([conv[:1], state[:1]], None, None), offsets=[7])
    assert c.offsets == [7] and c.extract(0)[1].shape == (1, 2, 4, 4)


def test_malformed_constructor_input_is_invalid_input():
    """Every malformed argument is InvalidInput: they raised AttributeError,
    ValueError or TypeError, or were taken (a float row index truncated to
    row 0, a numpy slot that a later put failed on)."""
    import numpy as np

    from promptstore.errors import InvalidInput

    conv, state = mx.zeros((1, 3, 8)), mx.ones((1, 2, 4, 4))
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = conv, state
    cases = [
        lambda: SSMCache.from_parts([[0.0]], state, [4]),
        lambda: SSMCache.from_parts(np.zeros((1, 3, 8)), state, [4]),
        lambda: SSMCache.from_parts(conv, state, [4], left_padding=["a"]),
        lambda: SSMCache.from_parts(conv, state, [4], lengths=[1.5]),
        lambda: SSMCache(left_padding=["x"]),
        lambda: SSMCache.from_arrays_cache(arrays, None),
        lambda: SSMCache.from_arrays_cache(arrays, 4.0),
        lambda: SSMCache.from_parts(conv, state, [4]).filter([0.9]),
        lambda: SSMCache.from_parts(conv, state, [4]).prepare(lengths="ab"),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(InvalidInput):
            case()
    assert SSMCache(left_padding=mx.array([0, 2])).offsets == [0, 0]
    assert SSMCache.from_parts(mx.zeros((2, 3, 8)), mx.ones((2, 2, 4, 4)), [4, 5], left_padding=[np.int64(0), 1]).offsets == [4, 5]


def test_rows_of_other_slot_shapes_or_dtypes_cannot_join():
    """merge and extend refuse rows whose slots differ past the row axis or in
    dtype: mlx raised its own ValueError, or promoted the batch to float32."""
    from promptstore.errors import InvalidInput

    def row(width, dtype=mx.float16):
        return SSMCache.from_parts(mx.zeros((1, 3, width), dtype), mx.ones((1, 2, 4, 4)), [3])

    with pytest.raises(InvalidInput, match="cannot join"):
        SSMCache.merge([row(8), row(16)])
    with pytest.raises(InvalidInput, match="cannot join"):
        SSMCache.merge([row(8), row(8, mx.float32)])
    batch = SSMCache.merge([row(8), row(8)])
    with pytest.raises(InvalidInput, match="cannot join"):
        batch.extend(row(8, mx.float32))
    assert batch.offsets == [3, 3] and batch[0].dtype == mx.float16 and batch[0].shape == (2, 3, 8)
    batch.extend(row(8))
    assert batch.offsets == [3, 3, 3]
