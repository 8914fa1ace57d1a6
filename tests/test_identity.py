"""Model identity: config, weights (dtype, quantization) and tokenizer all count."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from conftest import MODELS, load_fixture
from promptstore import InvalidInput, fingerprint
from promptstore.identity import model_name_of


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(MODELS / "llama", d)
    return d


def test_stable_and_named(model_dir):
    a = fingerprint(model_dir)
    assert a == fingerprint(str(model_dir))
    assert model_name_of(a) == "llama" and len(a.split("@")[1]) == 32
    assert fingerprint(model_dir, name="prod") .startswith("prod@")


def test_config_change(model_dir):
    before = fingerprint(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
    (model_dir / "config.json").write_text(json.dumps(cfg))
    assert fingerprint(model_dir) != before


def test_weight_byte_change(model_dir):
    before = fingerprint(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert fingerprint(model_dir) != before


def test_tokenizer_change(model_dir):
    before = fingerprint(model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg.get("chat_template", "") + " "
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert fingerprint(model_dir) != before


def test_dtype_and_quantization(tmp_path):
    from mlx_lm.utils import load, save

    src = MODELS / "llama"
    base = fingerprint(src)
    model, tokenizer, config = load(str(src), return_config=True)
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    save(tmp_path / "fp16", str(src), model, tokenizer, config)
    fp16 = fingerprint(tmp_path / "fp16")

    from mlx_lm.utils import quantize_model

    model, tokenizer, config = load(str(src), return_config=True)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    save(tmp_path / "q4", str(src), model, tokenizer, config)
    q4 = fingerprint(tmp_path / "q4")
    assert len({base, fp16, q4}) == 3


def test_loaded_module_fingerprint():
    model, tokenizer, _, _ = load_fixture("llama")
    a = fingerprint(model, tokenizer)
    assert a == fingerprint(model, tokenizer)
    other, other_tok, _, _ = load_fixture("gemma3_text")
    assert fingerprint(other, other_tok) != a


def test_not_a_model(tmp_path):
    with pytest.raises(InvalidInput, match="config.json"):
        fingerprint(tmp_path)
    with pytest.raises(InvalidInput):
        fingerprint(tmp_path / "missing")
    with pytest.raises(InvalidInput):
        fingerprint(42)
