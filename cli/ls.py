"""``promptstore ls``: list stored entries."""

from __future__ import annotations

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


def entry_rows(infos, keylen: int):
    rows = [("KEY", "MODEL", "KINDS", "TOKENS", "SIZE", "LAST USED")]
    for i in infos:
        rows.append((
            i.id[:keylen],
            i.model_name,
            ",".join(sorted(set(i.kinds))),
            str(i.n_tokens),
            format_size(i.nbytes),
            i.last_used.strftime("%Y-%m-%d %H:%M"),
        ))
    return rows


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

    KEY is a unique prefix of the entry id: pass it to rm or export.
    """
    everything = list(obj.store.entries())
    keylen = key_length(i.id for i in everything)
    keep = model_filter(model)
    infos = sorted((i for i in everything if keep(i)), key=SORTS[sort], reverse=True)
    shown = infos[:limit] if limit else infos
    if as_json:
        docs = []
        for i in shown:
            d = info_json(i)
            d["key"] = i.id[:keylen]
            docs.append(d)
        emit_json(docs)
        return
    if shown:
        render_table(entry_rows(shown, keylen), right={3, 4})
    total = sum(i.nbytes for i in infos)
    more = f" (showing {len(shown)})" if len(shown) < len(infos) else ""
    click.echo(f"{plural(len(infos))}, {format_size(total)}{more}")
