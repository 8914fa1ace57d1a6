"""A tokenizer whose ids go past the model's embedding is refused before any
prefill: mlx does not bounds-check an embedding lookup, so such an id read
other memory and ``put`` stored a cache computed from it (a segfault for ids
far enough out). Every command that prefills from a tokenizer (put, get,
warmup) goes through ``jobs.prefill.prefill``, which checks the ids first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS

from promptstore import PromptStore
from promptstore.errors import InvalidInput
from promptstore.jobs.prefill import load_model, prefill

EXE = str(Path(sys.executable).parent / "promptstore")
EXTRA = "<extra>"


@pytest.fixture(scope="module")
def wide_tokenizer(tmp_path_factory) -> Path:
    """The llama fixture (512 embedding rows) with a tokenizer that has one
    added token more: the tokenizer gives it id 512."""
    d = tmp_path_factory.mktemp("wide") / "llama"
    shutil.copytree(MODELS / "llama", d)
    doc = json.loads((d / "tokenizer.json").read_text())
    doc.setdefault("added_tokens", []).append(
        {"id": 100000, "content": EXTRA, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    )
    (d / "tokenizer.json").write_text(json.dumps(doc))
    return d


def _run(args, store: Path, **kw):
    env = dict(os.environ, PROMPTSTORE_DIR=str(store))
    return subprocess.run([EXE, *args, "--json"], capture_output=True, text=True, env=env, timeout=300, **kw)


def _refused(proc) -> dict:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)  # -11: a segfault
    err = json.loads(proc.stdout.strip().splitlines()[-1])
    assert err["error"] == "InvalidInput", err
    assert "token id 512" in err["message"] and "vocabulary of 512" in err["message"], err
    return err


def test_the_tokenizer_gives_an_id_past_the_embedding(wide_tokenizer):
    _model, tokenizer = load_model(str(wide_tokenizer))
    assert 512 in tokenizer.encode(f"hi {EXTRA} there")


def test_prefill_refuses_ids_past_the_embedding(wide_tokenizer):
    model, _ = load_model(str(wide_tokenizer))
    for bad in ([1, 2, 512], [-1], [1, 2**40]):
        with pytest.raises(InvalidInput, match="outside the model's vocabulary of 512 ids"):
            prefill(model, bad)
    with pytest.raises(InvalidInput, match="must be ints"):
        prefill(model, [1.5, 2.0])
    assert prefill(model, [1, 511])[0].offset == 2


def test_put_refuses_and_stores_nothing(wide_tokenizer, tmp_path):
    store = tmp_path / "store"
    ok = _run(["put", "--model", str(wide_tokenizer), "--prompt", "hi there"], store)
    assert ok.returncode == 0, ok.stderr
    _refused(_run(["put", "--model", str(wide_tokenizer), "--prompt", f"hi {EXTRA} there"], store))
    with PromptStore(store) as s:
        assert len(list(s.entries())) == 1  # the good put, untouched


def test_get_refuses_to_prefill_the_rest(wide_tokenizer, tmp_path):
    store = tmp_path / "store"
    assert _run(["put", "--model", str(wide_tokenizer), "--prompt", "hi there"], store).returncode == 0
    _refused(_run(["get", "--model", str(wide_tokenizer), "--prompt", f"hi there {EXTRA}", "-o", str(tmp_path / "o.safetensors")], store))
    assert not (tmp_path / "o.safetensors").exists()


def test_warmup_reports_the_line_and_goes_on(wide_tokenizer, tmp_path):
    store = tmp_path / "store"
    jobs = tmp_path / "prompts.jsonl"
    jobs.write_text(
        json.dumps({"id": "bad", "prompt": f"hi {EXTRA}"}) + "\n" + json.dumps({"id": "good", "prompt": "hello"}) + "\n"
    )
    proc = _run(["warmup", str(jobs), "--model", str(wide_tokenizer)], store)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "token id 512" in proc.stdout + proc.stderr
    with PromptStore(store) as s:
        assert len(list(s.entries())) == 1  # the good line
