"""CLI: ``gc``, ``compact`` and ``salvage`` (CliRunner, --json parsed); no pickle anywhere."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from _workers import MODEL, make_entry, same_cache
from conftest import ROOT
from promptstore import PromptStore
from promptstore.cli import main


def run(*args):
    res = CliRunner().invoke(main, list(map(str, args)))
    return res.exit_code, res.output


def test_gc_compact_salvage(tmp_path):
    path = tmp_path / "s"
    with PromptStore(path) as store:
        infos = [store.put(MODEL, *make_entry(71, i, big_every=0)) for i in range(10)]
        store.pin(infos[0].id)
        usage = store.usage()
    code, out = run("--store", path, "gc", "--budget", str(usage // 2), "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"] and plan["evict"] and infos[0].id not in plan["evict"]
    code, out = run("--store", path, "gc", "--budget", str(usage // 2), "--json")
    assert code == 1 and json.loads(out)["error"] == "NeedsConfirmation"  # no terminal, no --yes
    code, out = run("--store", path, "gc", "--budget", str(usage // 2), "--yes", "--json")
    done = json.loads(out)
    assert code == 0 and done["evicted"] == plan["evict"] and done["budget"] == usage // 2
    assert done["usage"] <= usage // 2
    code, out = run("--store", path, "compact", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["after_bytes"] < doc["before_bytes"] and doc["generation"] == "gen-1"
    code, out = run("salvage", path, tmp_path / "copy", "--json")
    doc = json.loads(out)
    assert code == 0 and len(doc["copied"]) == 10 - len(plan["evict"]) and doc["skipped"] == []
    with PromptStore(tmp_path / "copy") as copy:
        assert copy.verify().ok and copy.budget == usage // 2 and copy.pinned() == [infos[0].id]
        assert same_cache(copy.get(MODEL, make_entry(71, 0, big_every=0)[0]), make_entry(71, 0, big_every=0)[1])
    code, out = run("salvage", path, tmp_path / "copy", "--json")
    assert code == 1 and "not empty" in json.loads(out)["message"]
    code, out = run("--store", path, "gc", "--budget", "lots")
    assert code == 2


def test_no_pickle_in_our_code():
    offenders = []
    for sub in ("promptstore", "codecs", "cli", "tests", "fixtures"):
        for f in (ROOT / sub).rglob("*.py"):
            if f.name == "test_reliability_cli.py":
                continue
            text = f.read_text()
            if re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|joblib)\b", text, re.M) or "allow_pickle" + "=True" in text:
                offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []
