"""Token ids that a prompt-cache file records (or that a caller gives) are
checked before the model runs them: an embedding lookup with an id outside the
model's vocabulary reads out of bounds in mlx (a SIGSEGV on the CPU), and one
past int64 makes mlx throw ``std::bad_cast``. Every case runs the installed CLI
in a subprocess, so a crash fails the test instead of killing pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import MODELS

from promptstore import PromptStore

LLAMA = str(MODELS / "llama")  # vocab_size 512
EXE = str(Path(sys.executable).parent / "promptstore")
KEY = "0.promptstore_tokens"  # as mlx-lm's save_prompt_cache flattens the metadata


def _run(args, store: Path, **kw):
    env = dict(os.environ, PROMPTSTORE_DIR=str(store))
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A file written by `promptstore export` (it records its token ids)."""
    d = tmp_path_factory.mktemp("exported")
    put = _run([EXE, "put", "--model", LLAMA, "--prompt", "Hello there, how are you?", "--json"], d / "store")
    assert put.returncode == 0, put.stderr
    out = d / "ok.safetensors"
    exp = _run([EXE, "export", json.loads(put.stdout)["id"], "-o", str(out), "--model", LLAMA, "--json"], d / "store")
    assert exp.returncode == 0, exp.stderr
    return out


def _recorded(path: Path) -> list:
    _, meta = mx.load(str(path), return_metadata=True)
    return json.loads(meta[KEY])


def _tampered(src: Path, dst: Path, raw_tokens: str) -> Path:
    arrays, meta = mx.load(str(src), return_metadata=True)
    meta[KEY] = raw_tokens
    mx.save_safetensors(str(dst), arrays, meta)
    return dst


def _assert_refused(proc, store: Path, kind: str, *words: str) -> dict:
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout, proc.stderr)  # 139/-11: a segfault
    err = json.loads(proc.stdout)
    assert err["error"] == kind, err
    assert "unexpected" not in err["message"] and "\n" not in err["message"]
    for w in words:
        assert w in err["message"], err
    if store.exists():
        with PromptStore(store, readonly=True) as opened:
            assert list(opened.entries()) == [], "nothing was stored"
    return err


def _ids(recorded: list, bad: str, where: str) -> str:
    """JSON of the recorded ids with ``bad`` (raw JSON) at the first or last position."""
    ids = [str(t) for t in recorded]
    ids[0 if where == "first" else -1] = bad
    return "[" + ", ".join(ids) + "]"


def test_reviewer_repro_out_of_vocab_ids_are_refused(exported, tmp_path):
    """The reviewer's file: every id 10**9 (SIGSEGV in the tail check before)."""
    n = len(_recorded(exported))
    f = _tampered(exported, tmp_path / "oob.safetensors", json.dumps([10**9] * n))
    store = tmp_path / "store"
    proc = _run([EXE, "--store", str(store), "import", "--model", LLAMA, str(f), "--json"], store)
    _assert_refused(proc, store, "CorruptEntry", "1000000000", "512")


@pytest.mark.parametrize(
    "bad, words, where",  # first: the head check's prefill; last: the tail check's re-run
    [
        ("512", ("512", "vocabulary"), "first"),  # the first id past the vocabulary
        ("4294967295", ("4294967295",), "last"),  # the largest uint32: still out of vocabulary
        (str(2**32), (str(2**32),), "first"),
        (str(2**70), (str(2**70),), "last"),  # std::bad_cast before
        ("-1", ("-1",), "first"),
        ("1e400", ("inf",), "last"),
        ("true", ("True",), "first"),
        ('"7"', ("'7'",), "last"),
    ],
)
def test_bad_recorded_token_id_is_refused(exported, tmp_path, bad, words, where):
    recorded = _recorded(exported)
    n = len(recorded)
    f = _tampered(exported, tmp_path / "bad.safetensors", _ids(recorded, bad, where))
    store = tmp_path / "store"
    proc = _run([EXE, "--store", str(store), "import", "--model", LLAMA, str(f), "--json"], store)
    err = _assert_refused(proc, store, "CorruptEntry", *words)
    assert f"position {0 if where == 'first' else n - 1}" in err["message"]


def test_recorded_ids_that_are_not_a_list_are_refused(exported, tmp_path):
    n = len(_recorded(exported))
    f = _tampered(exported, tmp_path / "dict.safetensors", json.dumps({str(i): 1 for i in range(n)}))
    store = tmp_path / "store"
    proc = _run([EXE, "--store", str(store), "import", "--model", LLAMA, str(f), "--json"], store)
    _assert_refused(proc, store, "CorruptEntry", "list")


def test_valid_recorded_ids_still_import(exported, tmp_path):
    store = tmp_path / "store"
    proc = _run([EXE, "--store", str(store), "import", "--model", LLAMA, str(exported), "--json"], store)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == len(_recorded(exported))


def test_caller_token_ids_out_of_vocab_are_refused_by_the_api(exported, tmp_path):
    """Ids given by the caller (for a file that records none) go through the
    same check: InvalidInput, in a subprocess so that a segfault is a failure."""
    arrays, meta = mx.load(str(exported), return_metadata=True)
    del meta[KEY]
    bare = tmp_path / "bare.safetensors"
    mx.save_safetensors(str(bare), arrays, meta)
    recorded = _recorded(exported)
    script = textwrap.dedent(
        f"""
        import json, sys
        from promptstore import PromptStore
        from promptstore.errors import InvalidInput
        from promptstore.jobs.interop import check_cache_tokens, import_mlx_cache_file, read_mlx_cache_file
        from mlx_lm import load
        model, _ = load({LLAMA!r})
        f = read_mlx_cache_file({str(bare)!r})
        bad = {recorded!r}
        bad[-1] = 10**9
        store = PromptStore({str(tmp_path / "store")!r})
        out = []
        try:
            import_mlx_cache_file(store, f.fingerprint, {str(bare)!r}, tokens=bad, model=model)
        except InvalidInput as err:
            out.append(str(err))
        try:
            check_cache_tokens(f.cache, model, [2**70] * len(bad), "cache")
        except InvalidInput as err:
            out.append(str(err))
        out.append(len(list(store.entries())))
        print(json.dumps(out))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    first, second, stored = json.loads(proc.stdout)
    assert "1000000000" in first and "512" in first
    assert str(2**70) in second
    assert stored == 0
