"""``promptstore ls``: list stored entries."""

from __future__ import annotations

import click

from promptstore.cli._common import emit_json, format_size, guarded, info_json, json_option


@click.command()
@json_option
@click.pass_obj
@guarded
def ls(obj, as_json):
    """List the entries in the store."""
    infos = sorted(obj.store.entries(), key=lambda i: i.last_used, reverse=True)
    if as_json:
        emit_json([info_json(i) for i in infos])
        return
    rows = [("KEY", "MODEL", "KINDS", "TOKENS", "SIZE", "LAST USED")]
    for i in infos:
        rows.append((
            i.id[:12],
            i.model_name,
            ",".join(sorted(set(i.kinds))),
            str(i.n_tokens),
            format_size(i.nbytes),
            i.last_used.strftime("%Y-%m-%d %H:%M"),
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    right = {3, 4}
    for r in rows:
        click.echo("  ".join(v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip())
    total = sum(i.nbytes for i in infos)
    click.echo(f"{len(infos)} entr{'y' if len(infos) == 1 else 'ies'}, {format_size(total)}")
