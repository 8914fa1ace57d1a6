"""`promptstore serve` refuses options mlx_lm.server would refuse before it
opens the store: a typo is a usage error (JSON under --json) and creates
nothing (a reviewer found argparse's usage text on stderr, nothing on
stdout under --json, and a new store left behind)."""

from __future__ import annotations

import pytest
from conftest import MODELS
from test_cli_newcomer import error

from promptstore.serving._server import check_server_args


@pytest.mark.parametrize("args, says", [(["--bogus-opt"], "unrecognized arguments: --bogus-opt"),
                                        (["--port", "notaport"], "invalid int value: 'notaport'"),
                                        (["--port", "99999"], "--port 99999 is not a TCP port"),
                                        (["--port", "-1"], "--port -1 is not a TCP port"),
                                        (["--prefill-step-size", "0"], "--prefill-step-size 0 must be at least 1"),
                                        # The server started, then refused every request with this reason.
                                        (["--draft-model", str(MODELS / "llama"), "--kv-bits", "8"],
                                         "speculative decoding does not quantize the KV cache")])
def test_serve_refuses_bad_server_options_before_opening_the_store(tmp_path, args, says):
    doc = error(tmp_path / "store", "serve", "--model", str(MODELS / "llama"), *args, code=2)
    assert doc["error"] == "UsageError" and says in doc["message"]
    assert not (tmp_path / "store").exists()


def test_good_server_options_pass_the_check():
    check_server_args(str(MODELS / "llama"), ["--port", "8123", "--prompt-cache-size", "4", "--log-level", "DEBUG"])
    check_server_args(str(MODELS / "llama"), [])


def test_serve_refuses_a_model_whose_tokenizer_cannot_load_before_opening_the_store(tmp_path):
    """mlx_lm.server loads the tokenizer in its generation thread: the server
    started, every request answered "generation thread died", and it exited 0."""
    import shutil

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MODELS / "llama" / name, broken / name)
    doc = error(tmp_path / "store", "serve", "--model", str(broken), "--port", "1", code=1)
    assert doc["error"] == "InvalidInput" and "tokenizer" in doc["message"] and str(broken) in doc["message"]
    assert not (tmp_path / "store").exists()


def test_the_tokenizer_check_loads_as_the_server_will(tmp_path):
    """With --trust-remote-code a tokenizer with custom code loads (the check
    refused it, where the server would have loaded it); --chat-template too."""
    import json
    import shutil

    from promptstore import InvalidInput
    from promptstore.jobs.prefill import check_tokenizer

    custom = tmp_path / "custom"
    shutil.copytree(MODELS / "llama", custom)
    (custom / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    assert check_server_args(str(custom), []) == {"trust_remote_code": False}
    with pytest.raises(InvalidInput, match="tokenizer"):
        check_tokenizer(str(custom), check_server_args(str(custom), []))
    trusted = check_server_args(str(custom), ["--trust-remote-code", "--chat-template", "{{ 'x' }}"])
    assert trusted == {"trust_remote_code": True, "chat_template": "{{ 'x' }}"}
    check_tokenizer(str(custom), trusted)
