"""``promptstore compact``: rewrite the data file without its free pages."""

from __future__ import annotations

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, json_option


@command()
@json_option
@click.pass_obj
@guarded
def compact(obj, as_json):
    """Rewrite the store compactly (LMDB files never shrink by themselves).

    Safe while other processes use the store: they move to the new file at
    their next transaction. Needs free disk space for the compacted copy.
    """
    before, after = obj.store.compact()
    if as_json:
        emit_json({"before_bytes": before, "after_bytes": after, "generation": obj.store.env.generation})
    else:
        click.echo(f"compacted {format_size(before)} -> {format_size(after)}")
