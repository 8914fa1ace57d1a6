"""``promptstore stats``: entries, cache bytes vs stored bytes (shared
prefixes stored once) vs file size, per model, per kind, hits and misses;
with a shared tier, its entries, bytes, memory and counters."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, DefaultDict, Dict

import click

from promptstore import RemoteError
from promptstore.cli._common import command, emit_json, format_size, guarded, json_option, plural, store_option
from promptstore.cli.ls import remote_infos, render_table
from promptstore.remote import RemoteTier

# Counters every remote section shows, 0 when this process has not counted them.
REMOTE_COUNTERS = ("hits", "misses", "published", "dropped", "pending", "bytes_fetched", "bytes_published", "errors")


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


def collect_remote(tier: RemoteTier) -> Dict[str, Any]:
    """The remote section (raw integers): the namespace's entries and bytes
    (a scan of its manifests), the memory of every node (``INFO memory``) and
    this process's counters (``RemoteTier.stats()``). A remote that cannot
    be read gives ``error`` and the counters, not a failure."""
    doc: Dict[str, Any] = {"url": str(tier.url), "namespace": tier.url.namespace, "error": None}
    try:
        infos, stored = remote_infos(tier.remote)
        memory = tier.remote.client.memory()
    except RemoteError as err:
        tier.remote.failed("stats", err)
        doc["error"] = str(err)
    else:
        logical = sum(i.nbytes for i in infos)
        doc.update({
            "entries": len(infos),
            "live_bytes": logical,
            "stored_bytes": stored,
            "dedup_ratio": (logical / stored) if stored else None,
            "nodes": len(memory),
            "used_memory": sum(int(m.get("used_memory", 0)) for m in memory),
            "maxmemory": sum(int(m.get("maxmemory", 0)) for m in memory),
            "maxmemory_policy": sorted({str(m.get("maxmemory_policy", "")) for m in memory}),
        })
    counters = tier.stats()
    doc["counters"] = {**{k: 0 for k in REMOTE_COUNTERS}, **counters}
    return doc


@command()
@store_option
@json_option
@click.pass_obj
@guarded
def stats(obj, as_json):
    """Summarise the store: entries, live bytes vs file size, per model, per
    storage kind, and lookup hits and misses (recorded by every process).

    With a shared tier (--remote URL or PROMPTSTORE_REMOTE), a remote section
    too: its entries and bytes (every host's, in this namespace), its
    memory and eviction policy, and the tier's counters. The counters
    (hits, misses, published, dropped, bytes, errors.KIND) are this
    process's: a remote that cannot be read shows here as errors.unavailable.
    """
    store = obj.reader()  # read-only: never creates a store
    doc = collect(store)
    doc["remote"] = collect_remote(store.remote) if store.remote is not None else None
    if as_json:
        emit_json(doc)
        return
    live, stored, size = doc["live_bytes"], doc["stored_bytes"], doc["file_bytes"]
    pct = f" ({100 * stored / size:.0f}% live)" if size else ""
    # Only where sharing saved bytes: a store with nothing shared stores a little more than its
    # caches (manifests, index), and "0.97x shared prefixes" would read as a claim.
    ratio = doc["dedup_ratio"]
    dedup = f", {ratio:.2f}x smaller for shared prefixes stored once" if ratio and ratio > 1 else ""
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
    if doc["remote"] is not None:
        click.echo("")
        echo_remote(doc["remote"])
    click.echo(f"{plural(doc['entries'])}, {format_size(live)}")


def echo_remote(r: Dict[str, Any]) -> None:
    """The human remote section."""
    click.echo(f"remote  {r['url']}")
    if r["error"] is not None:
        click.echo(f"        unreadable: {r['error']}")
    else:
        dedup = f", {r['dedup_ratio']:.2f}x shared blocks" if r["dedup_ratio"] else ""
        cap = f" of {format_size(r['maxmemory'])}" if r["maxmemory"] else " (no maxmemory)"
        policy = ",".join(r["maxmemory_policy"])
        click.echo(f"entries {r['entries']}")
        click.echo(f"bytes   {format_size(r['live_bytes'])} of caches stored in {format_size(r['stored_bytes'])}{dedup}")
        click.echo(f"memory  {format_size(r['used_memory'])}{cap} on {plural(r['nodes'], 'node')}, {policy}")
    c = r["counters"]
    errors = ", ".join(f"{k[len('errors.'):]} {v}" for k, v in sorted(c.items()) if k.startswith("errors."))
    click.echo(f"this process: {c['hits']} hits, {c['misses']} misses, {c['published']} published, "
               f"{c['dropped']} dropped, {format_size(c['bytes_fetched'])} fetched, "
               f"{format_size(c['bytes_published'])} sent, {c['errors']} errors{f' ({errors})' if errors else ''}")
