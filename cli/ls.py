"""``promptstore ls``: list stored entries."""

from __future__ import annotations

from typing import Dict, Optional

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option
from promptstore.cli._select import key_length, model_filter, model_help

SORTS = {
    "used": lambda i: i.last_used,
    "size": lambda i: i.nbytes,
    "tokens": lambda i: i.n_tokens,
    "created": lambda i: i.created,
}


def render_table(rows, right=()) -> None:
    """Print rows as aligned columns (the first row is the header)."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip())


def entry_rows(infos, keylen: int, own: Optional[Dict[str, int]] = None):
    """Table rows of ``infos``; with ``own`` (bytes per id no other entry
    shares), an OWN and a SHARED column split each entry's SIZE."""
    head = ("KEY", "MODEL", "KINDS", "TOKENS", "SIZE") + (("OWN", "SHARED") if own is not None else ()) + ("LAST USED",)
    rows = [head]
    for i in infos:
        mine = own.get(i.id, i.nbytes) if own is not None else 0
        split = (format_size(mine), format_size(i.nbytes - mine)) if own is not None else ()
        rows.append((
            i.id[:keylen],
            i.model_name,
            ",".join(sorted(set(i.kinds))),
            str(i.n_tokens),
            format_size(i.nbytes),
            *split,
            local_time(i.last_used),
        ))
    return rows


def local_time(dt) -> str:
    """A table's time: this machine's local time, to the minute."""
    return dt.astimezone().strftime("%Y-%m-%d %H:%M")


def plural(n: int, word: str = "entry") -> str:
    return f"{n} {word if n == 1 else (word[:-1] + 'ies' if word.endswith('y') else word + 's')}"


@command()
@click.option("--model", default=None, help=model_help("List"))
@click.option("--sort", type=click.Choice(sorted(SORTS)), default="used", show_default=True, help="Order, largest or latest first.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most N entries.")
@json_option
@click.pass_obj
@guarded
def ls(obj, model, sort, limit, as_json):
    """List the entries in the store.

    KEY is a unique prefix of the entry id: pass it to rm or export. SIZE is
    the entry's cache bytes; OWN the part no other entry shares (what `rm`
    frees), SHARED the part in prefix blocks it shares with other entries.
    LAST USED is local time (--json: ISO-8601 UTC). The store is opened
    read-only; a path with no store yet lists nothing.
    """
    store = obj.reader_or_none()  # read-only; no store yet lists nothing and creates none
    everything = list(store.entries()) if store is not None else []
    keylen = key_length(i.id for i in everything)
    keep = model_filter(model)
    infos = sorted((i for i in everything if keep(i)), key=SORTS[sort], reverse=True)
    shown = infos[:limit] if limit else infos
    own = store.own_bytes(i.id for i in shown) if store is not None else {}
    if as_json:
        docs = []
        for i in shown:
            d = info_json(i)
            d["key"] = i.id[:keylen]
            d["own_bytes"] = own.get(i.id, i.nbytes)
            d["shared_bytes"] = i.nbytes - d["own_bytes"]
            docs.append(d)
        emit_json(docs)
        return
    if shown:
        render_table(entry_rows(shown, keylen, own), right={3, 4, 5, 6})
    total = sum(i.nbytes for i in infos)
    more = f" (showing {len(shown)})" if len(shown) < len(infos) else ""
    click.echo(f"{plural(len(infos))}, {format_size(total)}{more}")
