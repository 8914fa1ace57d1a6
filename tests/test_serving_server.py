"""`promptstore serve`: mlx-lm's real HTTP server on 127.0.0.1 with the persistent cache."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from conftest import MODELS
from promptstore import PromptStore, fingerprint

SYSTEM = "You are a terse assistant that answers in one line."
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colours of the rainbow, please."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `promptstore serve --json` subprocess on 127.0.0.1.

    ``model``: a fixture's name, or as the CLI takes it (a folder, a Hugging
    Face id); ``extra``: more serve options; ``env``: the process's environment."""

    def __init__(self, store: Path, model: str, log: Path, *extra: str, env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        self.log = open(log, "ab")
        where = str(MODELS / model) if "/" not in model else model
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "promptstore.cli", "--store", str(store), "serve", "--json",
             "--model", where, *extra, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=self.log, env=env,
        )
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                raise AssertionError(f"server exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"server did not come up in 90 s; see {log}")
            time.sleep(0.1)

    def chat(self, messages, max_tokens: int = 6, **extra) -> dict:
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def stop(self) -> dict:
        """SIGTERM; returns the --json document printed after the flush."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        self.log.close()
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}"
        return json.loads(out)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)
        self.log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, kind, *_) -> None:
        """Kill the server when the block raised (nothing may keep running);
        otherwise it stays up: :meth:`stop` it to read its --json document."""
        if kind is not None:
            self.kill()


def cli_json(store: Path, *args) -> object:
    out = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(store), *args, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for_entries(store: Path, n: int, timeout: float = 20) -> list:
    """`promptstore ls --json` (another process) until the server's writes show up."""
    deadline = time.monotonic() + timeout
    while True:
        docs = cli_json(store, "ls")
        if len(docs) >= n or time.monotonic() > deadline:
            return docs
        time.sleep(0.2)


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(resp) -> str:
    return resp["choices"][0]["message"]["content"]


@pytest.mark.parametrize("model", ["qwen3_next", "llama"])
def test_restart_serves_the_conversation_from_the_store(tmp_path, model):
    store = tmp_path / "store"
    log = tmp_path / "server.log"
    fp = fingerprint(MODELS / model)

    srv = Server(store, model, log)
    try:
        r1 = srv.chat(FIRST)
        assert cached(r1) == 0  # an empty store
        # While the server runs, another process lists what it wrote: the system
        # prompt, the prompt up to its last token, and prompt + answer; on a
        # hybrid (no trim) also the messages without the generation prompt,
        # which `promptstore get --messages` looks up.
        hybrid = model == "qwen3_next"
        docs = wait_for_entries(store, 4 if hybrid else 3)
        assert len(docs) == (4 if hybrid else 3), docs
        assert {d["model"] for d in docs} == {fp}
        assert sorted(d["meta"]["cache_type"] for d in docs) == ["assistant", "system", "user"] + (["user"] if hybrid else [])
        prompt_tokens = r1["usage"]["prompt_tokens"]
        assert sorted(d["tokens"] for d in docs)[-2:] == [prompt_tokens - 1, prompt_tokens + r1["usage"]["completion_tokens"]]
        stats = cli_json(store, "stats")
        assert stats  # `promptstore stats` reads the store while the server holds it open
    except BaseException:
        srv.kill()
        raise
    first = srv.stop()["cache"]
    assert first["written"] == (4 if hybrid else 3) and first["pending"] == 0 and first["store_hits"] == 0

    follow = FIRST + [{"role": "assistant", "content": text(r1)}, {"role": "user", "content": "And two more?"}]
    srv = Server(store, model, log)
    try:
        r2 = srv.chat(follow)  # memory is empty: whatever is cached came from the store
        assert cached(r2) >= prompt_tokens - 1, (cached(r2), prompt_tokens)
        assert cached(r2) < r2["usage"]["prompt_tokens"]
        r3 = srv.chat(FIRST)
        assert text(r3) == text(r1)  # the restored cache answers exactly as the cold prefill did
        assert cached(r3) == prompt_tokens - 1
    except BaseException:
        srv.kill()
        raise
    second = srv.stop()["cache"]
    assert second["store_hits"] >= 1 and second["pending"] == 0 and second["errors"] == 0


def test_sigkill_loses_only_uncommitted_writes(tmp_path):
    """SIGKILL skips the flush: what was committed stays readable, nothing is half-written."""
    store = tmp_path / "store"
    log = tmp_path / "server.log"
    srv = Server(store, "llama", log)
    try:
        r1 = srv.chat(FIRST)
        docs = wait_for_entries(store, 3)
        assert len(docs) == 3
    finally:
        srv.kill()
    assert srv.proc.returncode == -signal.SIGKILL
    with PromptStore(store) as s:
        report = s.verify()
        assert report.ok, report.problems
        assert len(list(s.entries())) == 3
    srv = Server(store, "llama", log)
    try:
        r2 = srv.chat(FIRST)
        assert cached(r2) == r1["usage"]["prompt_tokens"] - 1 and text(r2) == text(r1)
    except BaseException:
        srv.kill()
        raise
    assert srv.stop()["cache"]["store_hits"] == 1


def test_readme_serving_loop_is_the_example_and_runs(tmp_path):
    root = MODELS.parents[1]
    example = (root / "examples" / "serving_loop.py").read_text()
    readme = (root / "README.md").read_text()
    section = readme.split("<!-- section:serving -->", 1)[1].split("<!-- section:", 1)[0]
    assert "```python\n" + example + "```" in section  # the README shows exactly the file that runs
    for model in ("llama", "qwen3_next"):
        env = {**os.environ, "PROMPTSTORE_DIR": str(tmp_path / "store")}
        out = subprocess.run([sys.executable, "examples/serving_loop.py", str(MODELS / model)],
                             cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.splitlines()
        assert first.startswith("first: 0 cached prompt tokens, answer ")
        n = int(second.split(":")[1].split()[0])
        assert n > 0 and second.startswith("restarted: ")
        assert first.split("answer ", 1)[1] == second.split("answer ", 1)[1]
    docs = cli_json(tmp_path / "store", "ls")
    assert sorted(d["model_name"] for d in docs) == ["llama", "llama", "qwen3_next", "qwen3_next"]


def test_an_empty_prompt_is_refused_and_the_server_keeps_serving(tmp_path):
    """A /v1/completions request with an empty prompt killed mlx-lm's
    generation thread (its BatchGenerator raised outside any try): every later
    request got "generation thread died" and /health 503 until a restart."""
    store, log = tmp_path / "store", tmp_path / "server.log"
    with Server(store, "llama", log) as srv:
        def complete(prompt: str) -> Tuple[int, dict]:
            body = json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.load(r)
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read() or b"{}")

        assert complete("Hello")[0] == 200
        status, doc = complete("")
        assert 400 <= status < 500 and "empty" in json.dumps(doc), (status, doc)
        status, doc = complete("Hello")
        assert status == 200 and doc["choices"][0]["text"], doc
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10) as r:
            assert r.status == 200
        srv.stop()


