"""CLI: ``gc``, ``compact`` and ``salvage`` (CliRunner, --json parsed); no pickle anywhere."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from _raw import audit_blocks, flip_block, shared_block, stored_bytes
from _content import MODEL, chat_entry, same_cache
from conftest import ROOT
from promptstore import PromptStore
from promptstore.cli import main


def run(*args):
    res = CliRunner().invoke(main, list(map(str, args)))
    return res.exit_code, res.output


def test_gc_compact_salvage(tmp_path):
    """On the turns of three chats (entries sharing blocks): gc evicts some,
    compact and salvage keep the rest, their shared blocks counted right."""
    path = tmp_path / "s"
    items = [chat_entry(71 + i // 4, i % 4) for i in range(10)]
    with PromptStore(path) as store:
        infos = [store.put(MODEL, *item) for item in items]
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
        assert audit_blocks(copy) and copy.usage() == stored_bytes(copy) <= usage // 2
        for info, (tokens, cache) in zip(infos, items):
            if info.id not in plan["evict"]:
                assert same_cache(copy.get(MODEL, tokens), cache)
    code, out = run("salvage", path, tmp_path / "copy", "--json")
    assert code == 1 and "not empty" in json.loads(out)["message"]
    code, out = run("--store", path, "gc", "--budget", "lots")
    assert code == 2
    for dry in ((), ("--dry-run",)):  # a bad size is the usage error, even where no store is
        code, out = run("--store", tmp_path / "none", "gc", "--budget", "-1", *dry)
        assert code == 2 and "is not a size" in out, out


def test_salvage_that_saves_nothing_fails(tmp_path):
    """A store whose every entry is damaged: salvage says so and exits 1 (a
    script must not take an empty copy for a rescue); an empty store is no failure."""
    path = tmp_path / "s"
    with PromptStore(path) as store:
        info = store.put(MODEL, *chat_entry(91, 0))
        flip_block(store, shared_block(store, [info.id]))
    code, out = run("salvage", path, tmp_path / "copy", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["copied"] == [] and [d["id"] for d in doc["skipped"]] == [info.id] and not doc["ok"]
    code, out = run("salvage", path, tmp_path / "copy2")
    assert code == 1 and "nothing in" in out and "could be salvaged" in out
    PromptStore(tmp_path / "empty").close()
    code, out = run("salvage", tmp_path / "empty", tmp_path / "copy3", "--json")
    assert code == 0 and json.loads(out)["ok"]


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
