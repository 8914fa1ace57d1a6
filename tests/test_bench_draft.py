"""The bench's draft row: greedy decode on the fixture hybrid without a draft,
with a self-draft and with a smaller draft, at tiny sizes.

No test asserts on a time: the bench reports, it never gates."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import MODELS
from promptstore.bench import _draft
from promptstore.bench._draft import draft_cases, smaller_draft
from promptstore.errors import InvalidInput, PromptStoreError


@pytest.mark.shape_dependent
def test_draft_row_is_greedy_identical_and_reports_the_acceptance(tmp_path):
    k, max_tokens = 3, 12
    res = draft_cases(1, max_tokens, num_draft_tokens=k, prompt_tokens=16, workdir=tmp_path)
    assert res["tokens_identical"] is True  # draft_cases raises when any run's tokens differ
    assert res["layers"] == {"target": 4, "small_draft": 2}
    for name in ("no_draft", "self_draft", "small_draft"):
        assert res[name]["seconds"] > 0 and res[name]["tokens_per_s"] == max_tokens / res[name]["seconds"]
    self_row, small = res["self_draft"], res["small_draft"]
    # a copy of the target always agrees with it: every drafted token accepted, k per round
    assert self_row["acceptance"] == 1.0 and self_row["accepted"] == self_row["draft_tokens"]
    # per run: 3 rounds of 3 drafted + 1 verified tokens make the 12; two runs (warm-up, timed)
    assert self_row["rounds"] == 2 * 3 and self_row["draft_tokens"] == 2 * 9
    # the cut-down draft agrees only sometimes, so rollbacks ran
    assert 0 < small["acceptance"] < 1 and small["accepted"] < small["draft_tokens"]
    assert small["rounds"] > self_row["rounds"]
    assert list(tmp_path.iterdir()) == []  # the scratch draft folder is removed
    json.dumps(res)  # the bench writes its results as JSON


def test_greedy_identity_is_required_only_where_kernels_are_shape_exact(tmp_path, monkeypatch):
    """Plain greedy decoding made to differ: on a shape-exact backend (the
    CPU) the case raises; elsewhere it reports the difference, as the
    fidelity contract promises no more there. A variant whose runs differ
    from each other raises everywhere."""
    real = _draft._plain

    def off_by_one(model, prompt, max_tokens):
        tokens, seconds = real(model, prompt, max_tokens)
        return tokens[:-1] + [tokens[-1] + 1], seconds

    monkeypatch.setattr(_draft, "_plain", off_by_one)
    monkeypatch.setattr(_draft, "shape_exact", lambda: True)
    with pytest.raises(PromptStoreError, match="must be greedy-identical"):
        draft_cases(1, 6, num_draft_tokens=2, prompt_tokens=8, workdir=tmp_path)
    monkeypatch.setattr(_draft, "shape_exact", lambda: False)
    res = draft_cases(1, 6, num_draft_tokens=2, prompt_tokens=8, workdir=tmp_path)
    assert res["tokens_identical"] is False
    calls = []

    def drifting(model, prompt, max_tokens):
        calls.append(1)
        tokens, seconds = real(model, prompt, max_tokens)
        return tokens[:-1] + [tokens[-1] + len(calls)], seconds

    monkeypatch.setattr(_draft, "_plain", drifting)
    with pytest.raises(PromptStoreError, match="its first run generated"):
        draft_cases(1, 6, num_draft_tokens=2, prompt_tokens=8, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_smaller_draft_is_the_targets_first_layers_with_its_tokenizer(tmp_path):
    src = MODELS / "qwen3_next"
    out = smaller_draft(src, tmp_path / "d", 2)
    config = json.loads((out / "config.json").read_text())
    want = json.loads((src / "config.json").read_text())
    assert config == {**want, "num_hidden_layers": 2}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    full, small = mx.load(str(src / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert small and all(mx.array_equal(full[k], v).item() for k, v in small.items())
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.")) for k in small)
    assert set(full) - set(small) == {k for k in full if k.startswith(("model.layers.2.", "model.layers.3."))}
    model, tokenizer = load(str(out))  # loads as an mlx-lm model, same vocabulary
    assert len(model.layers) == 2 and tokenizer.vocab_size == 512
    with pytest.raises(InvalidInput, match="num_hidden_layers"):
        smaller_draft(src, tmp_path / "e", 4)
