"""Issue 22: mlx-lm's flags on put/get/warmup, and model identity by weights
(a copied folder, a Hugging Face id from the local cache, the remembered
weight digest). Through the real command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from click.testing import CliRunner
from conftest import MODELS, load_fixture

import promptstore.identity as identity
from promptstore import PromptStore
from promptstore.cli import main
from promptstore.jobs.interop import read_mlx_cache_file
from promptstore.jobs.prefill import encode_prompt, prefill
from _bits import bits_equal

LLAMA = str(MODELS / "llama")
PROMPT = "You are a terse assistant. Explain prompt caches."


def invoke(store, *args, input=None, code=0, env=None):
    res = CliRunner().invoke(main, ["--store", str(store), *map(str, args)], input=input, env=env)
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert "Traceback" not in res.stdout + res.stderr
    return res


def js(store, *args, **kw):
    return json.loads(invoke(store, *args, "--json", **kw).stdout)


# -- mlx-lm's flags ------------------------------------------------------------------------


def test_kv_bits_make_quantized_entries_and_files(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    s = tmp_path / "s"
    entry = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert entry["kinds"] == ["kv.quantized", "kv.quantized"]
    with PromptStore(s) as store:
        cache = store.get(entry["model"], store.tokens(entry["id"]))
    assert all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (4, 32) for c in cache)
    plain = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--kv-bits", "4")  # under mlx-lm's 5000-token start
    assert plain["kinds"] == ["kv", "kv"]
    out = tmp_path / "q.safetensors"
    longer = PROMPT + " And one more question."
    js(s, "get", "--model", LLAMA, "--prompt", longer, "-o", out, "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    layers = load_prompt_cache(str(out))
    assert all(type(c) is QuantizedKVCache and c.bits == 4 for c in layers)
    # an 8-bit entry under --kv-bits 4: get -o wrote it 8-bit, which mlx_lm.generate --kv-bits 4 refuses;
    # it is not used now, and the file is prefilled afresh at 4 bits
    eight = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0")
    res = invoke(s, "get", "--model", LLAMA, "--prompt", longer, "-o", out, "--kv-bits", "4", "--kv-group-size", "32",
                 "--quantized-kv-start", "0", "--json")
    got = json.loads(res.stdout)
    assert got["matched"] == 0 and got["entry"] is None and f"entry {eight['id']} holds 8-bit KV" in res.stderr
    assert all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (4, 32) for c in load_prompt_cache(str(out)))
    same = js(s, "get", "--model", LLAMA, "--prompt", longer, "-o", out, "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert same["entry"]["id"] == eight["id"] and same["matched"] > 0  # the flags it was stored with: used
    assert invoke(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--kv-bits", "7", code=2).stderr


def test_max_kv_size_makes_a_rotating_cache(tmp_path, monkeypatch):
    from mlx_lm.models import llama

    s = tmp_path / "s"
    res = invoke(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--max-kv-size", "8", "--json")
    assert "--max-kv-size is ignored" in res.stderr  # the fixture makes its own cache: mlx-lm ignores the flag
    # a model without its own make_cache gets mlx-lm's RotatingKVCache(max_size, keep=4)
    monkeypatch.delattr(llama.Model, "make_cache")
    res = invoke(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--max-kv-size", "8", "--json")
    entry = json.loads(res.stdout)
    assert entry["kinds"] == ["kv.rotating", "kv.rotating"] and "ignored" not in res.stderr
    with PromptStore(s) as store:
        cache = store.get(entry["model"], store.tokens(entry["id"]))
    assert [(c.max_size, c.keep, c.offset) for c in cache] == [(8, 4, entry["tokens"])] * 2
    # exported, that window (its 4 kept tokens, then a window that has moved on) imports back: the
    # model check took the shape of its positions from consecutive ones, and raised a TypeError
    out = tmp_path / "window.safetensors"
    js(s, "export", entry["id"], "--model", LLAMA, "-o", out)
    js(s, "rm", entry["id"], "--yes")
    back = js(s, "import", "--model", LLAMA, "--prompt", PROMPT, out)  # short: checked by a fresh prefill of it all
    assert back["id"] == entry["id"] and back["kinds"] == ["kv.rotating", "kv.rotating"]
    with PromptStore(s) as store:
        again = store.get(entry["model"], store.tokens(entry["id"]))
    assert all(bits_equal(a.keys, b.keys).item() and bits_equal(a.values, b.values).item() and a._idx == b._idx
               for a, b in zip(again, cache))


def test_system_prompt_and_ignore_chat_template(tmp_path):
    _, tok, _, _ = load_fixture("llama")
    s = tmp_path / "s"
    entry = js(s, "put", "--model", LLAMA, "--prompt", "Hi.", "--system-prompt", "Be brief.")
    want = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
        add_generation_prompt=False, continue_final_message=True,
    )
    with PromptStore(s) as store:
        assert store.tokens(entry["id"]) == list(want)
    assert js(s, "get", "--model", LLAMA, "--prompt", "Hi.", "--system-prompt", "Be brief.")["to_prefill"] == 0
    raw = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--ignore-chat-template")
    assert raw["id"] == js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--no-chat-template")["id"]  # the old name stays
    assert raw["tokens"] == len(tok.encode(PROMPT))
    err = js(s, "put", "--model", LLAMA, "--prompt", "Hi.", "--system-prompt", "x", "--ignore-chat-template", code=1)
    assert err["error"] == "InvalidInput" and "chat template" in err["message"]


def test_prefill_step_size_and_warmup_flags(tmp_path, monkeypatch):
    import promptstore.jobs.prefill as prefill_mod

    s = tmp_path / "s"
    seen = []
    real = prefill_mod.eval_cache
    monkeypatch.setattr(prefill_mod, "eval_cache", lambda cache, *a: seen.append(cache[0].offset) or real(cache, *a))
    entry = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--prefill-step-size", "4")
    assert seen == list(range(4, entry["tokens"], 4)) + [entry["tokens"]]  # one forward per 4 tokens
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n")
    done = js(s, "warmup", "--model", LLAMA, prompts, "--ignore-chat-template", "--prefill-step-size", "16")
    assert done["stored"] == 1
    _, tok, _, _ = load_fixture("llama")
    assert js(s, "get", "--model", LLAMA, "--prompt", PROMPT, "--no-chat-template")["matched"] == len(tok.encode(PROMPT))


def _make_adapter(path):
    """A tiny LoRA adapter for the llama fixture, as mlx_lm.lora saves one."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(LLAMA)
    params = {"rank": 2, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    weights = {k: mx.random.normal(v.shape) * 0.5 for k, v in tree_flatten(model.trainable_parameters()) if "lora" in k}
    path.mkdir()
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))


def test_adapter_path_is_its_own_model(tmp_path):
    s = tmp_path / "s"
    adapter = tmp_path / "adapter"
    _make_adapter(adapter)
    base = js(s, "put", "--model", LLAMA, "--prompt", PROMPT)
    adapted = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--adapter-path", adapter)
    assert adapted["model"] != base["model"] and adapted["model_name"] == "llama+adapter"
    assert js(s, "get", "--model", LLAMA, "--prompt", PROMPT, "--adapter-path", adapter)["entry"]["id"] == adapted["id"]
    assert js(s, "get", "--model", LLAMA, "--prompt", PROMPT)["entry"]["id"] == base["id"]
    # the stored cache is the adapted model's
    from mlx_lm import load

    model, tok = load(LLAMA, adapter_path=str(adapter))
    tokens = encode_prompt(tok, PROMPT)
    with PromptStore(s) as store:
        got = store.get(adapted["model"], tokens)
    want = prefill(model, tokens)
    import mlx.core as mx

    assert all(mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]).item() for a, b in zip(got, want))
    # export takes the adapter too (it had no --adapter-path: an adapter's entry could not be exported)
    out = tmp_path / "adapted.safetensors"
    err = js(s, "export", adapted["id"], "--model", LLAMA, "-o", out, code=1)
    assert err["error"] == "ModelMismatch" and "pass that --adapter-path" in err["message"]
    err = js(s, "export", base["id"], "--model", LLAMA, "--adapter-path", adapter, "-o", out, code=1)
    assert err["error"] == "ModelMismatch" and "no --adapter-path" in err["message"]
    done = js(s, "export", adapted["id"], "--model", LLAMA, "--adapter-path", adapter, "-o", out)
    assert done["entry"]["id"] == adapted["id"] and read_mlx_cache_file(out).coverage == len(tokens)
    empty = tmp_path / "empty"
    empty.mkdir()
    err = js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--adapter-path", empty, code=1)
    assert err["error"] == "InvalidInput" and "adapter_config.json" in err["message"]
    assert js(s, "put", "--model", LLAMA, "--prompt", PROMPT, "--adapter-path", tmp_path / "none", code=2)["error"] == "UsageError"


# -- identity by weights ----------------------------------------------------------------------


def test_a_copied_folder_is_the_same_model_and_old_entries_stay_reachable(tmp_path):
    s = tmp_path / "s"
    copy = tmp_path / "my-llama-copy"
    shutil.copytree(LLAMA, copy)
    entry = js(s, "put", "--model", LLAMA, "--prompt", PROMPT)
    assert entry["model_name"] == "llama"
    got = js(s, "get", "--model", copy, "--prompt", PROMPT)
    assert got["entry"]["id"] == entry["id"] and got["to_prefill"] == 0
    assert [r["id"] for r in js(s, "ls", "--model", copy)] == [entry["id"]]
    # an entry an older release stored under the folder-named identity is still found
    digest = entry["model"].split("@")[1]
    model, tok, _, _ = load_fixture("llama")
    old_tokens = encode_prompt(tok, "An older prompt.")
    with PromptStore(s) as store:
        old = store.put(f"my-llama-copy@{digest}", old_tokens, prefill(model, old_tokens))
    got = js(s, "get", "--model", copy, "--prompt", "An older prompt.")
    assert got["entry"]["id"] == old.id and got["to_prefill"] == 0
    assert {r["id"] for r in js(s, "ls", "--model", copy)} == {entry["id"], old.id}
    out = tmp_path / "old.safetensors"
    assert js(s, "export", old.id, "--model", copy, "-o", out)["entry"]["id"] == old.id


def test_the_weight_digest_is_remembered_by_size_mtime_and_inode(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTSTORE_IDENTITY_CACHE", str(tmp_path / "ids.json"))
    copy = tmp_path / "m"
    shutil.copytree(LLAMA, copy)
    s = tmp_path / "s"
    entry = js(s, "put", "--model", copy, "--prompt", PROMPT)
    assert (tmp_path / "ids.json").is_file()
    hashed = []
    real = identity._hash_file
    monkeypatch.setattr(identity, "_hash_file", lambda h, p: hashed.append(p.name) or real(h, p))
    monkeypatch.setattr(identity, "_CACHE", {})  # a new process: only the file on disk remembers
    assert js(s, "get", "--model", copy, "--prompt", PROMPT)["entry"]["id"] == entry["id"]
    assert hashed == []  # not one weight byte re-read
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert js(s, "get", "--model", copy, "--prompt", PROMPT)["entry"]["id"] == entry["id"]
    assert "model.safetensors" in hashed  # a touched file is hashed again (and still the same model)


def _fake_hf_cache(root, repo):
    """The layout huggingface_hub keeps: models--org--name/{refs/main,snapshots/<rev>/...}."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for f in os.listdir(LLAMA):
        os.symlink(os.path.join(LLAMA, f), snap / f)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(snap.name)
    return snap


def test_a_hugging_face_id_resolves_offline_from_the_local_cache(tmp_path):
    hub = tmp_path / "hub"
    _fake_hf_cache(hub, "tiny-org/tiny-llama")
    env = dict(os.environ, PROMPTSTORE_DIR=str(tmp_path / "s"), HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    exe = [sys.executable, "-m", "promptstore"]

    def run(*args):
        return subprocess.run([*exe, *args], capture_output=True, text=True, env=env, timeout=300)

    put = run("put", "--model", "tiny-org/tiny-llama", "--prompt", PROMPT, "--json")
    assert put.returncode == 0, put.stderr
    entry = json.loads(put.stdout)
    assert entry["model_name"] == "llama"  # not the snapshot folder's commit hash
    got = run("get", "--model", LLAMA, "--prompt", PROMPT, "--json")  # the same files in another folder
    assert got.returncode == 0 and json.loads(got.stdout)["entry"]["id"] == entry["id"]
    missing = run("get", "--model", "tiny-org/not-downloaded", "--prompt", PROMPT)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "not in the local Hugging Face cache" in missing.stderr and "hf download tiny-org/not-downloaded" in missing.stderr
    nodir = run("get", "--model", str(tmp_path / "nope"), "--prompt", PROMPT)
    assert nodir.returncode == 1 and "no such directory" in nodir.stderr
