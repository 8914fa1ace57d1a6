"""`promptstore serve` and the CLI's model identity, through a real server
subprocess on 127.0.0.1 and the real command line: a Hugging Face id from the
local cache, entries of the older folder-named identity, and `get --messages`
of a chat the server stored (hybrid and dense)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from conftest import MODELS, load_fixture
from promptstore import PromptStore, fingerprint
from promptstore.jobs.prefill import prefill
from test_cli_newcomer_model import _fake_hf_cache
from test_serving_server import FIRST, Server, cached, text

LLAMA = MODELS / "llama"


def cli(store: Path, *args, env: Optional[Dict[str, str]] = None) -> object:
    out = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(store), *args, "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_serve_takes_a_cached_hugging_face_id_and_finds_entries_of_the_older_identity(tmp_path):
    hub = tmp_path / "hub"
    snapshot = _fake_hf_cache(hub, "tiny-org/tiny-llama")  # the fixture llama, as huggingface_hub lays it out
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    log = tmp_path / "server.log"
    fp = fingerprint(LLAMA)

    srv = Server(tmp_path / "a", "tiny-org/tiny-llama", log, env=env)
    try:
        r1 = srv.chat(FIRST)
        assert cached(r1) == 0
    except BaseException:
        srv.kill()
        raise
    done = srv.stop()
    assert done["model"] == "tiny-org/tiny-llama" and done["model_path"] == str(snapshot)
    assert done["cache"]["written"] == 3 and done["cache"]["errors"] == 0
    docs = cli(tmp_path / "a", "ls")
    assert {d["model"] for d in docs} == {fp}  # the content identity, not the snapshot's commit hash

    # An older release stored this chat's prompt under the folder-named identity of a copy.
    copy = tmp_path / "my-llama-copy"
    shutil.copytree(LLAMA, copy)
    model, tokenizer, _, _ = load_fixture("llama")
    prompt = list(tokenizer.apply_chat_template(FIRST, add_generation_prompt=True))
    assert len(prompt) == r1["usage"]["prompt_tokens"]
    with PromptStore(tmp_path / "b") as store:
        old = store.put(f"my-llama-copy@{fp.split('@')[1]}", prompt[:-1], prefill(model, prompt[:-1]))
    srv = Server(tmp_path / "b", str(copy), log)
    try:
        r2 = srv.chat(FIRST)  # memory is empty: a cached token can only come from the old entry
        assert cached(r2) == len(prompt) - 1
        assert text(r2) == text(r1)
    except BaseException:
        srv.kill()
        raise
    counters = srv.stop()["cache"]
    assert counters["store_hits"] == 1 and counters["errors"] == 0
    assert old.id in {d["id"] for d in cli(tmp_path / "b", "ls")}  # read, never rewritten or pruned


def test_serve_refuses_an_id_missing_from_the_local_cache(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(tmp_path / "s"), "serve", "--json",
                          "--model", "tiny-org/not-downloaded"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1
    err = json.loads(out.stdout)
    assert err["error"] == "InvalidInput" and "not in the local Hugging Face cache" in err["message"]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("model", ["qwen3_next", "llama"])
def test_get_messages_hits_what_serve_stored(tmp_path, model):
    store, log = tmp_path / "store", tmp_path / "server.log"
    srv = Server(store, str(MODELS / model), log)
    try:
        r1 = srv.chat(FIRST)
    except BaseException:
        srv.kill()
        raise
    counters = srv.stop()["cache"]
    # a hybrid's cache cannot be trimmed: the server also checkpoints the end of the messages
    assert counters["written"] == (4 if model == "qwen3_next" else 3) and counters["pending"] == 0

    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps(FIRST))
    got = cli(store, "get", "--model", str(MODELS / model), "--messages", str(messages))
    assert got["matched"] == got["tokens"] and got["to_prefill"] == 0
    assert got["entry"]["meta"]["source"] == "promptstore.serving"
    if model == "qwen3_next":
        assert got["entry"]["tokens"] == got["tokens"] and got["trimmed"] == 0
        assert "ssm.gated_delta" in got["entry"]["kinds"]

    srv = Server(store, str(MODELS / model), log)  # the server's own restart hit is unchanged
    try:
        r2 = srv.chat(FIRST)
        assert cached(r2) == r1["usage"]["prompt_tokens"] - 1 and text(r2) == text(r1)
    except BaseException:
        srv.kill()
        raise
    assert srv.stop()["cache"]["store_hits"] == 1
