"""Checks for the tiny random-weight models under fixtures/models.

1. fixtures/make_fixtures.py is deterministic and the committed files are
   exactly what it produces.
2. Every fixture model loads offline with mlx_lm.load, builds the expected
   prompt-cache layer types and generates varied tokens.
"""

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "fixtures" / "make_fixtures.py"
MODELS_DIR = REPO_ROOT / "fixtures" / "models"

EXPECTED_CACHES = {
    "llama": ["KVCache", "KVCache"],
    "qwen3_next": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
    "qwen3_5": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
    "gemma3_text": ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"],
}

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, how are you today? Please summarize the document."},
]


def _files(root: Path) -> set:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_make_fixtures_reproduces_committed_files(tmp_path):
    out = tmp_path / "models"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    committed = _files(MODELS_DIR)
    generated = _files(out)
    assert generated == committed
    assert {f.split("/")[0] for f in committed} == set(EXPECTED_CACHES)
    differing = [
        f
        for f in sorted(committed)
        if not filecmp.cmp(MODELS_DIR / f, out / f, shallow=False)
    ]
    assert not differing, (
        f"regenerated fixtures differ from the committed ones: {differing} "
        "(rerun fixtures/make_fixtures.py if the change is intended)"
    )


@pytest.fixture(scope="module", params=sorted(EXPECTED_CACHES))
def loaded(request):
    name = request.param
    model, tokenizer = mlx_lm.load(str(MODELS_DIR / name))
    return name, model, tokenizer


def test_model_loads_and_makes_expected_caches(loaded):
    name, model, tokenizer = loaded
    cache = make_prompt_cache(model)
    assert [type(c).__name__ for c in cache] == EXPECTED_CACHES[name]
    if name == "gemma3_text":
        assert all(c.max_size == 16 for c in cache if type(c).__name__ == "RotatingKVCache")

    config = json.loads((MODELS_DIR / name / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.eos_token_ids == {tokenizer.eos_token_id}

    dtypes = {
        v.dtype for k, v in tree_flatten(model.parameters()) if not k.endswith("A_log")
    }
    assert dtypes == {getattr(mx, config["torch_dtype"])}


def test_greedy_generation_is_varied(loaded):
    name, model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt[:1] == [tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert len(prompt) > 16  # longer than gemma3_text's sliding window

    cache = make_prompt_cache(model)
    tokens = []
    for (token, _), _ in zip(
        generate_step(
            mx.array(prompt),
            model,
            prompt_cache=cache,
            sampler=lambda logits: mx.argmax(logits, axis=-1),
        ),
        range(16),
    ):
        tokens.append(int(token))
    assert len(tokens) == 16
    assert len(set(tokens)) >= 4, tokens
    assert all(0 <= t < len(tokenizer.get_vocab()) for t in tokens)
    # The attention caches hold the whole prompt (and more).
    for c in cache:
        if type(c).__name__ != "ArraysCache":
            assert c.offset > len(prompt)
