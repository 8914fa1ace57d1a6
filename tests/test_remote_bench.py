"""``promptstore.bench._remote.remote_cases`` at tiny sizes: a real
redis-server, a published entry restored bit-exact in B, figures that add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from _redis import redis_binary  # noqa: F401
from promptstore.bench import _data as data
from promptstore.bench._remote import remote_cases
from promptstore.remote._server import start_server


def test_remote_cases_measure_a_real_server(tmp_path, redis_binary):
    out = remote_cases(tmp_path / "bench", data.QUICK, 256, repeats=2)
    assert "skipped" not in out, out
    assert out["bits_exact"] is True and out["n_tokens"] == 256
    cache_bytes = data.QUICK.nbytes(256)
    assert cache_bytes < out["bytes"] < cache_bytes + 64 * 1024  # every block once, plus the manifest
    assert out["keys"] > 2
    for name in ("lookup_s", "fetch_s", "raw_s"):
        assert out[name] > 0
    assert out["ratio"] == out["raw_s"] / out["fetch_s"] and out["lookup_ratio"] == out["raw_s"] / out["lookup_s"]
    assert not (tmp_path / "bench" / "redis").exists()  # the server's folder goes with it


def test_remote_cases_skip_without_a_server_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTSTORE_REDIS_SERVER", str(tmp_path / "no-such-redis-server"))
    out = remote_cases(tmp_path / "bench", data.QUICK, 256, repeats=1)
    assert set(out) == {"skipped"} and "redis-server" in out["skipped"]


def test_remote_cases_run_in_a_relative_folder(tmp_path, monkeypatch, redis_binary):
    # `promptstore bench --dir scratch`: redis-server enters its --dir before
    # it opens its log, so a relative folder made it exit at once.
    monkeypatch.chdir(tmp_path)
    out = remote_cases(Path("bench"), data.QUICK, 256, repeats=1)
    assert "skipped" not in out, out
    assert out["bits_exact"] is True


def test_a_server_that_refuses_its_arguments_says_why(tmp_path, redis_binary):
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1: .*no-such-directive"):
        start_server(redis_binary, tmp_path, extra=["--no-such-directive", "1"])
