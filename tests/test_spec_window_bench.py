"""The bench's ``one_at_a_time`` measurement (promptstore.bench._draft): concurrent
requests served one at a time with a self-draft, against mlx-lm's batch
without a draft, at tiny sizes. No assertion on a time: the bench reports."""

from __future__ import annotations

import json

import pytest
from mlx_lm import load

from conftest import MODELS
from promptstore._backend import shape_exact
from promptstore.bench import _draft
from promptstore.bench._draft import one_at_a_time
from promptstore.errors import PromptStoreError
from promptstore.ssm import adapt

PROMPTS = [[5, 17, 99, 3, 250, 11], [8, 9, 10, 11, 12, 13], [300, 2, 77, 14, 15, 16]]


def _models():
    plain, _ = load(str(MODELS / "qwen3_next"))
    target, _ = load(str(MODELS / "qwen3_next"))
    draft, _ = load(str(MODELS / "qwen3_next"))
    adapt(target)
    adapt(draft)
    return plain, target, draft


def test_one_at_a_time_reports_every_variant_over_the_same_tokens():
    res = one_at_a_time(*_models(), PROMPTS, max_tokens=6, num_draft_tokens=3, repeats=1)
    assert res["requests"] == 3 and res["tokens"] == 18 and res["repeats"] == 1
    for name in ("serial_self_draft", "serial_no_draft", "batched_no_draft"):
        assert res[name]["seconds"] > 0 and res[name]["tokens_per_s"] == 18 / res[name]["seconds"]
    assert res["self_draft_vs_batched"] == res["batched_no_draft"]["seconds"] / res["serial_self_draft"]["seconds"]
    assert isinstance(res["batched_tokens_identical"], bool)
    assert res["self_draft_tokens_identical"] is True or not shape_exact()
    json.dumps(res)


def test_one_at_a_time_raises_when_the_draft_changes_the_tokens_where_kernels_are_shape_exact(monkeypatch):
    """On the CPU the self-draft's tokens must equal plain greedy decoding's;
    on a GPU backend the difference is reported (README, "Fidelity contract")."""
    plain, target, _ = _models()
    other, _ = load(str(MODELS / "qwen3_5"))  # a model of other weights in the target's place
    adapt(other)
    monkeypatch.setattr(_draft, "shape_exact", lambda: True)
    with pytest.raises(PromptStoreError, match="must give the same tokens"):
        one_at_a_time(plain, other, other, PROMPTS, max_tokens=6, num_draft_tokens=3, repeats=1)
    monkeypatch.setattr(_draft, "shape_exact", lambda: False)
    res = one_at_a_time(plain, other, other, PROMPTS, max_tokens=6, num_draft_tokens=3, repeats=1)
    assert res["self_draft_tokens_identical"] is False
