"""The README's main-job command works in a fresh clone of the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import ROOT


def _block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert m, f"README has no {marker} block"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == _block("test-command")


@pytest.mark.skipif(
    os.environ.get("PROMPTSTORE_OFFLINE") == "1",
    reason="PROMPTSTORE_OFFLINE=1: no package index to install from (the GPU machine, docs/gpu.md)",
)
def test_main_job_in_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = dict(os.environ, PROMPTSTORE_DIR=str(tmp_path / "store"))
    env.pop("VIRTUAL_ENV", None)
    out = subprocess.run(
        ["bash", "-c", _block("main-job")], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"stored [0-9a-f]{16}: \d+ tokens", out.stdout)
    assert re.search(r"hit [0-9a-f]{16}: (\d+) of \1 tokens; 0 to prefill", out.stdout)
    assert re.search(r"^1 entry, ", out.stdout, re.M)
    listing = subprocess.run(
        [str(clone / ".venv" / "bin" / "promptstore"), "ls", "--json"], env=env, capture_output=True, text=True
    )
    entries = json.loads(listing.stdout)
    assert [e["model_name"] for e in entries] == ["qwen3_next"]
