"""The installed command line in real subprocesses, with the real mlx-lm CLIs
(`mlx_lm.generate --prompt-cache-file`, `mlx_lm.cache_prompt`), and hybrid-model
chat checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import MODELS, load_fixture
from mlx.utils import tree_flatten

from promptstore import PromptStore
from promptstore.cli import main
from promptstore.jobs.interop import read_mlx_cache_file
from promptstore.jobs.prefill import encode_prompt, prefill
from _bits import bits_equal

LLAMA = str(MODELS / "llama")
QNEXT = str(MODELS / "qwen3_next")
QWEN35 = str(MODELS / "qwen3_5")
BIN = Path(sys.executable).parent


def run(args, env_store, check=True, **kw):
    env = dict(os.environ, PROMPTSTORE_DIR=str(env_store))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, **kw)
    if check:
        assert proc.returncode == 0, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def test_installed_entry_point_and_module(tmp_path):
    store = tmp_path / "store"
    exe = BIN / "promptstore"
    assert exe.is_file(), "the package is installed with its `promptstore` script"
    put = run([str(exe), "put", "--model", LLAMA, "--prompt", "Hello there.", "--json"], store)
    entry = json.loads(put.stdout)
    assert entry["tokens"] > 0 and "prefill" in put.stderr  # progress goes to stderr, JSON alone on stdout
    ls = run([sys.executable, "-m", "promptstore.cli", "ls", "--json"], store)
    assert [r["id"] for r in json.loads(ls.stdout)] == [entry["id"]]
    bad = run([str(exe), "get", "--model", str(tmp_path / "missing"), "--prompt", "x"], store, check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    usage = run([str(exe), "ls", "--limit", "zero", "--json"], store, check=False)
    assert usage.returncode == 2 and json.loads(usage.stdout)["error"] == "UsageError"


def _generate(args):
    """Greedy text from the real `mlx_lm generate` CLI (stdout only)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--temp", "0", "--max-tokens", "24", "--verbose", "False", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_get_o_file_continues_in_mlx_lm_generate_exactly_as_the_uncached_prompt(tmp_path, name):
    model_dir = str(MODELS / name)
    head, tail = "Hello there. Tell me", " about prompt caches, please."
    _, tok, _, _ = load_fixture(name)
    # mlx_lm.generate tokenizes the cached prompt and the new one separately: pick
    # text whose tokens split cleanly, so both runs see the same token stream.
    full = tok.apply_chat_template([{"role": "user", "content": head + tail}], add_generation_prompt=True, tokenize=False)
    assert tok.encode(full, add_special_tokens=False)[: len(encode_prompt(tok, head))] == encode_prompt(tok, head)
    store = tmp_path / "store"
    exe = str(BIN / "promptstore")
    run([exe, "put", "--model", model_dir, "--prompt", head[:12]], store)  # a shorter entry: get -o prefills the rest
    out = tmp_path / "cache.safetensors"
    got = json.loads(run([exe, "get", "--model", model_dir, "--prompt", head, "-o", str(out), "--json"], store).stdout)
    assert got["output"] == str(out) and got["tokens"] == len(encode_prompt(tok, head))
    assert 0 < got["matched"] < got["tokens"]  # restored from the store, the rest prefilled
    assert read_mlx_cache_file(out).coverage == got["tokens"]
    cached = _generate(["--model", model_dir, "--prompt-cache-file", str(out), "--prompt", tail])
    uncached = _generate(["--model", model_dir, "--prompt", head + tail])
    assert cached.strip() and cached == uncached
    other = _generate(["--model", model_dir, "--prompt", "Goodbye" + tail])
    assert other != uncached  # the comparison can tell prompts apart


@pytest.mark.shape_dependent  # the reference: a fresh prefill of the prompt
def test_import_of_a_real_cache_prompt_file_then_get_hits(tmp_path):
    prompt = "You are a helpful assistant. Summarise the design of prompt caches."
    out = tmp_path / "mlx.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", QNEXT, "--prompt", prompt, "--prompt-cache-file", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    model, tok, fp, _ = load_fixture("qwen3_next")
    tokens = encode_prompt(tok, prompt)
    f = read_mlx_cache_file(out)
    # generate_step(max_tokens=0) also runs the last prompt token: the file covers ALL tokens
    assert f.coverage == len(tokens) and f.tokens is None
    runner = CliRunner()
    store = str(tmp_path / "store")
    res = runner.invoke(main, ["--store", store, "import", "--model", QNEXT, "--prompt", prompt, str(out), "--json"])
    assert res.exit_code == 0, res.output
    entry = json.loads(res.stdout)
    assert entry["tokens"] == len(tokens) and entry["meta"]["imported_from"] == out.name
    res = runner.invoke(main, ["--store", store, "get", "--model", QNEXT, "--prompt", prompt, "--json"])
    hit = json.loads(res.stdout)
    assert hit["matched"] == len(tokens) and hit["entry"]["id"] == entry["id"]
    # the imported cache is the file's, and continues like a fresh prefill of the prompt
    with PromptStore(store) as s:
        cache = s.get(fp, tokens)
    fresh = prefill(model, tokens)
    nxt = mx.array([[tokens[-1]]])
    assert bits_equal(model(nxt, cache=cache), model(nxt, cache=fresh)).item()
    bad = runner.invoke(main, ["--store", store, "import", "--model", QNEXT, "--prompt", prompt + " More.", str(out), "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["error"] == "CoverageMismatch"


def test_import_checks_a_dense_files_last_tokens_against_the_prompt(tmp_path):
    out = tmp_path / "llama.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", LLAMA, "--prompt", "Hello there. You are kind.", "--prompt-cache-file", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    _, tok, _, _ = load_fixture("llama")
    same_length = "Hello there. You are kind!"
    assert len(encode_prompt(tok, same_length)) == read_mlx_cache_file(out).coverage
    runner = CliRunner()
    store = str(tmp_path / "store")
    bad = runner.invoke(main, ["--store", store, "import", "--model", LLAMA, "--prompt", same_length, str(out), "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["error"] == "CoverageMismatch"
    assert "last" in json.loads(bad.stdout)["message"]
    good = runner.invoke(main, ["--store", store, "import", "--model", LLAMA, "--prompt", "Hello there. You are kind.", str(out), "--json"])
    assert good.exit_code == 0, good.output
    res = runner.invoke(main, ["--store", store, "ls", "--json"])
    assert [r["id"] for r in json.loads(res.stdout)] == [json.loads(good.stdout)["id"]]


def _states(cache):
    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def test_hybrid_chat_of_three_turns_hits_at_each_turn_boundary(tmp_path):
    model, tok, fp, _ = load_fixture("qwen3_5")
    system = {"role": "system", "content": "You are a terse assistant."}
    turns = [
        [{"role": "user", "content": "What is a prompt cache?"}],
        [{"role": "assistant", "content": "Saved attention state."}, {"role": "user", "content": "Why store it?"}],
        [{"role": "assistant", "content": "To skip prefill."}, {"role": "user", "content": "And on hybrids?"}],
    ]
    chats = [[system] + turns[0], [system] + turns[0] + turns[1], [system] + turns[0] + turns[1] + turns[2]]
    toks = [list(tok.apply_chat_template(c, add_generation_prompt=False)) for c in chats]
    sys_len = len(tok.apply_chat_template([system], add_generation_prompt=False))
    runner = CliRunner()
    store = str(tmp_path / "store")

    def cli(*args):
        res = runner.invoke(main, ["--store", store, *args, "--json"])
        assert res.exit_code == 0, (res.output, res.stderr)
        return json.loads(res.stdout)

    files = []
    for i, chat in enumerate(chats):
        f = tmp_path / f"chat{i}.json"
        f.write_text(json.dumps(chat))
        files.append(str(f))
    entry = cli("put", "--model", QWEN35, "--messages", files[0])
    assert entry["tokens"] == len(toks[0]) and [c["tokens"] for c in entry["checkpoints"]] == [sys_len]
    hit = cli("get", "--model", QWEN35, "--messages", files[1])
    assert hit["matched"] == len(toks[0]) and hit["entry"]["id"] == entry["id"] and hit["trimmed"] == 0
    entry2 = cli("put", "--model", QWEN35, "--messages", files[1])
    assert [c["tokens"] for c in entry2["checkpoints"]] == [sys_len, len(toks[0])]
    hit = cli("get", "--model", QWEN35, "--messages", files[2])
    assert hit["matched"] == len(toks[1]) and hit["entry"]["id"] == entry2["id"]
    # a new conversation with the same system message hits at the system boundary
    f = tmp_path / "new.json"
    f.write_text(json.dumps([system, {"role": "user", "content": "Something else."}]))
    assert cli("get", "--model", QWEN35, "--messages", str(f))["matched"] == sys_len
    # each checkpoint holds exactly the boundary state, though prefill went on
    # writing into the same KV buffers after it was stored
    with PromptStore(store) as s:
        ref = prefill(model, toks[0][:sys_len])
        _same(s.get(fp, toks[0][:sys_len]), ref)
        prefill(model, toks[0][sys_len:], cache=ref)
        _same(s.get(fp, toks[0]), ref)


def _same(stored, ref):
    """Bit-identical layers; a KV layer's padded buffer is compared over its covered positions."""
    assert stored is not None and len(stored) == len(ref)
    for x, y in zip(stored, ref):
        assert type(x) is type(y)
        if hasattr(y, "offset") and hasattr(y, "keys"):
            assert x.offset == y.offset
            pairs = [(x.keys[..., : y.offset, :], y.keys[..., : y.offset, :]), (x.values[..., : y.offset, :], y.values[..., : y.offset, :])]
        else:
            pairs = list(zip(_states([x]), _states([y])))
            assert pairs
        for u, v in pairs:
            assert u.dtype == v.dtype and u.shape == v.shape and bits_equal(u, v).item()


def test_dense_model_messages_need_no_checkpoints_but_sliding_window_does(tmp_path):
    runner = CliRunner()
    store = str(tmp_path / "store")
    long_user = " ".join(["word"] * 40)  # past gemma3_text's 16-token window
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": long_user}]))
    res = runner.invoke(main, ["--store", store, "put", "--model", str(MODELS / "gemma3_text"), "--messages", str(f), "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["checkpoints"]) == 1
    res = runner.invoke(main, ["--store", store, "put", "--model", LLAMA, "--messages", str(f), "--no-checkpoints", "--json"])
    assert json.loads(res.stdout)["checkpoints"] == []


def test_an_entry_under_the_older_folder_named_identity_exports_and_imports_back(tmp_path):
    """get and export accept an entry an earlier release stored under the
    model's folder-named identity; import refused that entry's own export
    ("made by model 'mymodel@...', not 'llama@...'"): the same model."""
    import shutil

    from mlx_lm import load

    from promptstore.identity import fingerprint, legacy_fingerprint

    folder = tmp_path / "mymodel"
    shutil.copytree(LLAMA, folder)
    assert legacy_fingerprint(folder) != fingerprint(folder)
    model, tok = load(str(folder))
    tokens = encode_prompt(tok, "Hello there, an entry from an older release.")
    cache = prefill(model, tokens)
    with PromptStore(tmp_path / "old") as s:
        key = s.put(legacy_fingerprint(folder), tokens, cache).id
    out = tmp_path / "e.safetensors"
    cli = [sys.executable, "-m", "promptstore.cli"]
    run(cli + ["export", key, "--model", str(folder), "-o", str(out)], tmp_path / "old")
    res = run(cli + ["import", "--model", str(folder), str(out), "--json"], tmp_path / "new")
    assert json.loads(res.stdout)["model"] == fingerprint(folder)
    with PromptStore(tmp_path / "new") as s:
        back = s.get(fingerprint(folder), tokens)
    from _samples import assert_same, visible_state

    assert len(back) == len(cache)
    for a, b in zip(cache, back):
        assert_same(visible_state(a), visible_state(b))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_import_refuses_nan_or_inf_where_the_prompt_makes_numbers(tmp_path, bad):
    """NaN compared false with the tolerance: a file of NaN keys passed the
    token check as verified and replaced the stored entry of its prompt."""
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    model, tok, _, _ = load_fixture("llama")
    prompt = "Explain prompt caches in one line."
    cache = make_prompt_cache(model)
    model(mx.array(encode_prompt(tok, prompt))[None], cache=cache)
    for layer in cache:  # one position of one head, in the head the check compares
        keys = layer.keys
        keys[0, 0, 2, :] = mx.array(bad, dtype=keys.dtype)
        layer.keys = keys
    out = tmp_path / "bad.safetensors"
    save_prompt_cache(str(out), cache)
    runner = CliRunner()
    store = str(tmp_path / "store")
    good = runner.invoke(main, ["--store", store, "put", "--model", LLAMA, "--prompt", prompt, "--json"])
    assert good.exit_code == 0, good.output
    res = runner.invoke(main, ["--store", store, "import", "--model", LLAMA, "--prompt", prompt, str(out), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["error"] == "CoverageMismatch", res.output
    with PromptStore(store) as s:  # the stored entry is the put's, untouched
        (info,) = list(s.entries())
        assert info.id == json.loads(good.stdout)["id"] and info.meta.get("source") != "import"
        cached, _, _ = s.load(info.id)
        assert all(bool(mx.isfinite(a).all()) for a in _states(cached))


def test_a_template_that_refuses_a_system_only_prefix_costs_that_checkpoint_only(tmp_path):
    """Qwen3's template raises "No user query found in messages." for a
    system message alone: `put --messages` and a whole warm-up job failed
    with an unexpected TemplateError instead of skipping that checkpoint."""
    import shutil

    model = tmp_path / "strict"
    shutil.copytree(QNEXT, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    guard = ("{%- set ns = namespace(user=false) %}{%- for m in messages %}{%- if m.role == 'user' %}"
             "{%- set ns.user = true %}{%- endif %}{%- endfor %}"
             "{%- if not ns.user %}{{- raise_exception('No user query found in messages.') }}{%- endif %}")
    config["chat_template"] = guard + config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is a prompt cache?"}]
    (tmp_path / "msgs.json").write_text(json.dumps(msgs))
    runner = CliRunner()
    store = str(tmp_path / "store")
    res = runner.invoke(main, ["--store", store, "put", "--model", str(model), "--messages", str(tmp_path / "msgs.json"), "--json"])
    assert res.exit_code == 0, res.output
    _, tok, _, _ = load_fixture("qwen3_next")
    first_turn = len(tok.apply_chat_template(msgs[:2], add_generation_prompt=False))
    with PromptStore(store) as s:  # the first user turn's checkpoint, and the whole prompt
        assert sorted(e.n_tokens for e in s.entries()) == [first_turn, len(tok.apply_chat_template(msgs, add_generation_prompt=False))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"id": "a", "prompt": "A fine prompt."}, {"id": "b", "messages": msgs[:2]}, {"id": "c", "prompt": "Another fine prompt."}]) + "\n")
    res = runner.invoke(main, ["--store", str(tmp_path / "warm"), "warmup", "--model", str(model), str(prompts), "--json"])
    assert res.exit_code == 0, res.output
    with PromptStore(tmp_path / "warm") as s:
        assert len(list(s.entries())) == 3


def test_the_fit_check_refuses_another_window_or_dtype():
    """A file whose sliding-window layers claimed another window than the
    model's was imported as verified (and one of another dtype): the check
    compared classes and shapes only. One window of 32 against 16 crashed
    the token check with a raw broadcast ValueError instead."""
    from mlx_lm.models.cache import make_prompt_cache

    from promptstore import ModelMismatch
    from promptstore.jobs.interop import check_cache_fits_model

    model, _, _, _ = load_fixture("gemma3_text")
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 33))]), cache=cache)
    check_cache_fits_model(cache, model)
    window = next(i for i, layer in enumerate(cache) if hasattr(layer, "max_size"))
    cache[window].max_size = 32
    with pytest.raises(ModelMismatch, match=f"layer {window} is a window of 32 tokens .* the model's is 16"):
        check_cache_fits_model(cache, model)
    model, _, _, _ = load_fixture("llama")
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 13))]), cache=cache)
    check_cache_fits_model(cache, model)
    cache[0].keys = cache[0].keys.astype(mx.float16)
    cache[0].values = cache[0].values.astype(mx.float16)
    with pytest.raises(ModelMismatch, match="layer 0 holds arrays of dtypes"):
        check_cache_fits_model(cache, model)
