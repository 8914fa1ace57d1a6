"""``promptstore stats``: entries, cache bytes vs stored bytes (shared
prefixes stored once) vs file size, per model, per kind, hits and misses."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, DefaultDict, Dict

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, json_option
from promptstore.cli.ls import plural, render_table


def collect(store) -> dict:
    """The stats document (raw integers) of a store."""
    infos = list(store.entries())
    models: DefaultDict[str, Dict[str, Any]] = defaultdict(lambda: {"entries": 0, "bytes": 0, "tokens": 0})
    kinds: DefaultDict[str, Dict[str, int]] = defaultdict(lambda: {"entries": 0, "layers": 0, "entry_bytes": 0})
    for i in infos:
        m = models[i.model]
        m["name"] = i.model_name
        m["entries"] += 1
        m["bytes"] += i.nbytes
        m["tokens"] += i.n_tokens
        for kind in set(i.kinds):
            k = kinds[kind]
            k["entries"] += 1
            k["layers"] += i.kinds.count(kind)
            k["entry_bytes"] += i.nbytes
    counters = store.counters()
    lookups = counters["hits"] + counters["misses"]
    logical = sum(i.nbytes for i in infos)
    stored = store.usage()
    return {
        "path": str(store.path),
        "entries": len(infos),
        "live_bytes": logical,
        "stored_bytes": stored,
        "dedup_ratio": (logical / stored) if stored else None,
        "file_bytes": store.file_size(),
        "hits": counters["hits"],
        "misses": counters["misses"],
        "hit_rate": (counters["hits"] / lookups) if lookups else None,
        "models": {fp: dict(v) for fp, v in sorted(models.items())},
        "kinds": {k: dict(v) for k, v in sorted(kinds.items())},
    }


@command()
@json_option
@click.pass_obj
@guarded
def stats(obj, as_json):
    """Summarise the store: entries, live bytes vs file size, per model, per
    storage kind, and lookup hits and misses (recorded by every process)."""
    doc = collect(obj.reader())  # read-only: never creates a store
    if as_json:
        emit_json(doc)
        return
    live, stored, size = doc["live_bytes"], doc["stored_bytes"], doc["file_bytes"]
    pct = f" ({100 * stored / size:.0f}% live)" if size else ""
    dedup = f", {doc['dedup_ratio']:.2f}x shared prefixes" if doc["dedup_ratio"] else ""
    click.echo(f"store   {doc['path']}")
    click.echo(f"entries {doc['entries']}")
    click.echo(f"bytes   {format_size(live)} of caches stored in {format_size(stored)}{dedup}")
    click.echo(f"file    {format_size(size)}{pct}")
    rate = f" ({100 * doc['hit_rate']:.0f}% hits)" if doc["hit_rate"] is not None else ""
    click.echo(f"lookups {doc['hits']} hits, {doc['misses']} misses{rate}")
    if doc["models"]:
        click.echo("")
        rows = [("MODEL", "ENTRIES", "TOKENS", "SIZE")]
        for m in doc["models"].values():
            rows.append((m["name"], str(m["entries"]), str(m["tokens"]), format_size(m["bytes"])))
        render_table(rows, right={1, 2, 3})
    if doc["kinds"]:
        click.echo("")
        rows = [("KIND", "ENTRIES", "LAYERS")]
        for kind, k in doc["kinds"].items():
            rows.append((kind, str(k["entries"]), str(k["layers"])))
        render_table(rows, right={1, 2})
    click.echo(f"{plural(doc['entries'])}, {format_size(live)}")
