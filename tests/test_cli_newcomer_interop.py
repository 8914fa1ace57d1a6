"""Issue 22, the rest: `import` checks every layer it can (sliding-window,
quantized and hybrid files included) and refuses what it cannot verify
unless --trust-unverified; mlx-lm file metadata survives import and export;
the prefill progress bar moves within a step; warmup takes mlx-lm's flags.
Through the real command line (CliRunner on promptstore.cli.main), with
files from the real `mlx_lm cache_prompt`."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import MODEL_NAMES, MODELS, load_fixture
from mlx.utils import tree_flatten

from promptstore import PromptStore
from promptstore.cli import main
from promptstore.jobs.interop import read_mlx_cache_file
from promptstore.jobs.prefill import CacheOptions, encode_prompt, prefill
from _bits import bits_equal

LLAMA = str(MODELS / "llama")
GEMMA = str(MODELS / "gemma3_text")
QNEXT = str(MODELS / "qwen3_next")
# Over 64 tokens (the head the check prefills afresh) and over gemma3_text's 16-token window.
LONG = "You are a careful assistant who explains prompt caches, sliding windows and recurrent state to newcomers. " * 2 + "Begin now."


def invoke(store, *args, code=0):
    res = CliRunner().invoke(main, ["--store", str(store), *map(str, args)])
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert "Traceback" not in res.stdout + res.stderr and "a bug" not in res.stdout + res.stderr
    return res


def js(store, *args, code=0):
    return json.loads(invoke(store, *args, "--json", code=code).stdout)


def cache_prompt(model, prompt, out, *flags):
    """A prompt-cache file from the real `mlx_lm cache_prompt` CLI."""
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", model, "--prompt", prompt, "--prompt-cache-file", str(out), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def same_length(name, prompt, change):
    """``change(prompt)``, checked to encode to as many tokens as ``prompt``."""
    _, tok, _, _ = load_fixture(name)
    other = change(prompt)
    assert other != prompt and len(encode_prompt(tok, other)) == len(encode_prompt(tok, prompt))
    return other


# -- import checks every layer it can ----------------------------------------------------


def test_sliding_window_file_is_checked_at_its_end(tmp_path):
    out = cache_prompt(GEMMA, LONG, tmp_path / "g.safetensors")
    f = read_mlx_cache_file(out)
    assert f.coverage > 64 and [type(c).__name__ for c in f.cache][:2] == ["RotatingKVCache", "KVCache"]
    assert f.cache[0].keys.shape[2] == 16  # the window holds its last 16 positions only
    s = tmp_path / "s"
    other = same_length("gemma3_text", LONG, lambda p: p[:-4] + "now!")
    err = js(s, "import", "--model", GEMMA, "--prompt", other, out, code=1)
    assert err["error"] == "CoverageMismatch" and "last 1 " in err["message"]
    assert not (s / "data.mdb").exists() or js(s, "ls") == []
    entry = js(s, "import", "--model", GEMMA, "--prompt", LONG, out)
    assert entry["meta"]["import_check"] == f"first 64 and last 1 of {f.coverage} tokens"
    assert js(s, "get", "--model", GEMMA, "--prompt", LONG)["matched"] == f.coverage


def test_hybrid_file_is_refused_unless_trusted_and_its_attention_head_is_checked(tmp_path):
    out = cache_prompt(QNEXT, LONG, tmp_path / "h.safetensors")
    n = read_mlx_cache_file(out).coverage
    assert n > 64
    s = tmp_path / "s"
    err = js(s, "import", "--model", QNEXT, "--prompt", LONG, out, code=1)
    assert err["error"] == "InvalidInput" and "--trust-unverified" in err["message"] and "recurrent" in err["message"]
    plain = invoke(s, "import", "--model", QNEXT, "--prompt", LONG, out, code=1)
    assert plain.stderr.startswith("error: ") and len(plain.stderr.strip().splitlines()) == 1
    # its attention layers' first positions are still checked: another start is refused even when trusted
    other = same_length("qwen3_next", LONG, lambda p: "The" + p[3:])
    err = js(s, "import", "--model", QNEXT, "--prompt", other, out, "--trust-unverified", code=1)
    assert err["error"] == "CoverageMismatch" and "first 64 tokens" in err["message"] and "KVCache" in err["message"]
    entry = js(s, "import", "--model", QNEXT, "--prompt", LONG, out, "--trust-unverified")
    assert entry["meta"]["import_check"] == f"first 64 of {n} tokens; end unverified (stored with --trust-unverified)"
    assert js(s, "get", "--model", QNEXT, "--prompt", LONG)["matched"] == n


def test_short_hybrid_file_is_checked_whole(tmp_path):
    prompt = "Hello there. You are kind."
    out = cache_prompt(QNEXT, prompt, tmp_path / "h.safetensors")
    s = tmp_path / "s"
    other = same_length("qwen3_next", prompt, lambda p: p[:-1] + "!")
    err = js(s, "import", "--model", QNEXT, "--prompt", other, out, "--trust-unverified", code=1)
    assert err["error"] == "CoverageMismatch"
    entry = js(s, "import", "--model", QNEXT, "--prompt", prompt, out)  # every layer compared: no flag needed
    assert entry["meta"]["import_check"] == f"first {entry['tokens']} of {entry['tokens']} tokens"


@pytest.mark.missing_kernel(backend="cuda", op="quantized_matmul")  # in mlx_lm.cache_prompt's own prefill
def test_quantized_file_from_cache_prompt_kv_bits_imports_and_is_checked(tmp_path):
    prompt = "Hello there. You are kind and patient."
    out = cache_prompt(LLAMA, prompt, tmp_path / "q.safetensors", "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert [type(c).__name__ for c in read_mlx_cache_file(out).cache] == ["QuantizedKVCache"] * 2
    s = tmp_path / "s"
    other = same_length("llama", prompt, lambda p: p[:-1] + "!")
    err = js(s, "import", "--model", LLAMA, "--prompt", other, out, code=1)
    assert err["error"] == "CoverageMismatch" and "last" in err["message"]
    entry = js(s, "import", "--model", LLAMA, "--prompt", prompt, out)
    assert entry["kinds"] == ["kv.quantized", "kv.quantized"] and entry["meta"]["import_check"].startswith("last 4 of")


def test_a_quantized_file_whose_bits_do_not_fit_its_arrays_is_refused_typed(tmp_path):
    """A quantized layer's bits (or group size) changed in the file: refused as
    CorruptEntry, naming the layer, trusted or not. mlx's own ValueError from
    dequantize reached the user ("unexpected ValueError ... a bug")."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    prompt = "Hello there. You are kind and patient."
    out = cache_prompt(LLAMA, prompt, tmp_path / "q.safetensors", "--kv-bits", "4", "--kv-group-size", "64", "--quantized-kv-start", "0")
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    for field, value in (("bits", 8), ("group_size", 32)):
        for layer in cache:
            setattr(layer, field, value)
        bad = tmp_path / f"bad-{field}.safetensors"
        save_prompt_cache(str(bad), cache, meta)
        for trust in ((), ("--trust-unverified",)):
            err = js(tmp_path / "s", "import", "--model", LLAMA, "--prompt", prompt, bad, *trust, code=1)
            assert err["error"] == "CorruptEntry" and "layer 0" in err["message"] and "do not fit" in err["message"], err
        cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert js(tmp_path / "s", "ls") == []


# -- mlx-lm file metadata through import and export ---------------------------------------


def test_file_metadata_survives_import_and_export(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    prompt = "Hello there. You are kind."
    out = cache_prompt(LLAMA, prompt, tmp_path / "a.safetensors", "--eos-token", "</s>")
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    assert json.loads(meta["tokenizer_config"])["eos_token"] == "</s>"
    s = tmp_path / "s"
    entry = js(s, "import", "--model", LLAMA, "--prompt", prompt, out)
    assert entry["meta"]["mlx_lm_metadata"]["tokenizer_config"] == meta["tokenizer_config"]
    back = tmp_path / "back.safetensors"
    js(s, "export", entry["id"], "--model", LLAMA, "-o", back)
    _, again = load_prompt_cache(str(back), return_metadata=True)
    assert again["tokenizer_config"] == meta["tokenizer_config"] and again["model"] == LLAMA
    # get -o of the prompt, and of a longer one (the rest prefilled), too: it wrote "{}", and
    # mlx_lm.generate with the file lost the EOS token cache_prompt was given
    for asked in (prompt, prompt + " And then some more words."):
        got = tmp_path / "got.safetensors"
        hit = js(s, "get", "--model", LLAMA, "--prompt", asked, "-o", got)
        assert hit["entry"]["id"] == entry["id"]
        _, again = load_prompt_cache(str(got), return_metadata=True)
        assert again["tokenizer_config"] == meta["tokenizer_config"] and again["model"] == LLAMA
    # user keys written by save_prompt_cache(metadata=...), dotted ones included
    cache, _ = load_prompt_cache(str(out), return_metadata=True)
    mine = tmp_path / "mine.safetensors"
    save_prompt_cache(str(mine), cache, {"model": LLAMA, "tokenizer_config": "{\"eos_token\": \"x\"}", "owner": "ops", "run.id": "7"})
    js(s, "rm", entry["id"], "--yes")
    entry = js(s, "import", "--model", LLAMA, "--prompt", prompt, mine)
    js(s, "export", entry["id"], "--model", LLAMA, "-o", back)
    _, again = load_prompt_cache(str(back), return_metadata=True)
    assert again["owner"] == "ops" and again["run"] == {"id": "7"} and again["tokenizer_config"] == "{\"eos_token\": \"x\"}"
    # an entry that was not imported still writes mlx-lm's required tokenizer_config
    plain = js(s, "put", "--model", LLAMA, "--prompt", "Something else.")
    js(s, "export", plain["id"], "--model", LLAMA, "-o", back)
    assert load_prompt_cache(str(back), return_metadata=True)[1]["tokenizer_config"] == "{}"
    err = js(s, "import", "--model", LLAMA, "--prompt", prompt, mine, "--meta", "mlx_lm_metadata=x", code=1)
    assert err["error"] == "InvalidInput" and "mlx_lm_metadata" in err["message"]


# -- the progress bar moves within a prefill step -----------------------------------------


def test_put_progress_moves_within_one_prefill_step(tmp_path, monkeypatch):
    import promptstore.cli.put as put_mod

    seen = []
    real = put_mod.progress_bar

    def recording(total):
        bar, progress = real(total)
        return bar, lambda done, t, secs: seen.append(done) or progress(done, t, secs)

    monkeypatch.setattr(put_mod, "progress_bar", recording)
    entry = js(tmp_path / "s", "put", "--model", str(MODELS / "qwen3_next"), "--prompt", LONG)
    n = entry["tokens"]
    assert n < 2048  # one prefill step
    assert seen[-1] == n and seen == sorted(seen) and len([d for d in seen if 0 < d < n]) >= 3


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_progress_leaves_the_prefill_bit_identical(name):
    model, tok, _, _ = load_fixture(name)
    tokens = encode_prompt(tok, LONG)
    for step in (2048, 7):
        calls = []
        with_bar = prefill(model, tokens, options=CacheOptions(step=step), progress=lambda d, t, s: calls.append(d))
        plain = prefill(model, tokens, options=CacheOptions(step=step))
        assert len(calls) > len(range(0, len(tokens), step))  # more reports than steps
        a = [v for _, v in tree_flatten([c.state for c in with_bar]) if isinstance(v, mx.array)]
        b = [v for _, v in tree_flatten([c.state for c in plain]) if isinstance(v, mx.array)]
        assert a and len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and bits_equal(x, y).item() for x, y in zip(a, b))


# -- warmup takes mlx-lm's flags --------------------------------------------------------------


def _jsonl(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_warmup_takes_kv_bits_system_prompt_and_refuses_long_prompts(tmp_path):
    s = tmp_path / "s"
    prompts = _jsonl(tmp_path / "p.jsonl", {"id": "a", "prompt": "Hi."}, {"id": "b", "prompt": "Explain prompt caches."})
    done = js(s, "warmup", "--model", LLAMA, prompts, "--system-prompt", "Be brief.",
              "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert done["stored"] == 2 and done["failed"] == 0 and not done["batched"]
    hit = js(s, "get", "--model", LLAMA, "--prompt", "Hi.", "--system-prompt", "Be brief.")
    assert hit["to_prefill"] == 0 and hit["entry"]["kinds"] == ["kv.quantized", "kv.quantized"]
    with PromptStore(s) as store:
        cache = store.get(hit["entry"]["model"], store.tokens(hit["entry"]["id"]))
    assert all((c.bits, c.group_size) == (4, 32) for c in cache)
    long = _jsonl(tmp_path / "long.jsonl", {"id": "big", "prompt": "word " * 1400}, {"id": "ok", "prompt": "Short one."})
    res = invoke(s, "warmup", "--model", LLAMA, long, "--json", code=1)
    doc = json.loads(res.stdout)
    assert doc["stored"] == 1 and [e["id"] for e in doc["errors"]] == ["big"]
    assert "context of 4,096" in doc["errors"][0]["reason"] and "--allow-long-prompt" in doc["errors"][0]["reason"]
    assert invoke(s, "warmup", "--model", LLAMA, prompts, "--kv-bits", "7", code=2).stderr


def test_warmup_max_kv_size_and_system_prompt_checkpoint_on_a_hybrid(tmp_path, monkeypatch):
    from mlx_lm.models import llama

    s = tmp_path / "s"
    prompts = _jsonl(tmp_path / "p.jsonl", {"id": "a", "prompt": "Hi there, how are you today?"})
    monkeypatch.delattr(llama.Model, "make_cache")  # mlx-lm's own cache: --max-kv-size applies
    done = js(s, "warmup", "--model", LLAMA, prompts, "--max-kv-size", "8")
    assert done["stored"] == 1
    entry = js(s, "ls")[0]
    assert entry["kinds"] == ["kv.rotating", "kv.rotating"]
    # a hybrid's prompts share the system prompt: a checkpoint at its end lets every later prompt hit
    _, tok, _, _ = load_fixture("qwen3_next")
    sys_len = len(tok.apply_chat_template([{"role": "system", "content": "Be brief."}], add_generation_prompt=False))
    done = js(s, "warmup", "--model", QNEXT, prompts, "--system-prompt", "Be brief.", "--prefill-step-size", "5")
    assert done["stored"] == 1 and done["checkpoints"] == 1
    got = js(s, "get", "--model", QNEXT, "--prompt", "Something else entirely.", "--system-prompt", "Be brief.")
    assert got["matched"] == sys_len
