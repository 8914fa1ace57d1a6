"""``promptstore compact``: rewrite the data file without its free pages, packs without dead blocks."""

from __future__ import annotations

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, json_option, store_option


@command()
@store_option
@json_option
@click.pass_obj
@guarded
def compact(obj, as_json):
    """Rewrite the store compactly (LMDB files never shrink by themselves),
    and every pack file that holds blocks no entry uses any more.

    Entries written before shared prefixes are rewritten into shared blocks
    first, so a store of an older release stores each shared prefix once.

    Safe while other processes use the store: they move to the new file at
    their next transaction. Needs free disk space for the compacted copy.
    """
    store = obj.local_only().existing_store()
    before = store.file_size()  # before the upgrade writes anything
    upgraded = store.upgrade()
    _, after = store.compact(upgrade=False)
    if as_json:
        emit_json({"before_bytes": before, "after_bytes": after, "upgraded": upgraded, "generation": obj.existing_store().env.generation})
    else:
        if upgraded:
            click.echo(f"rewrote {upgraded} {'entry' if upgraded == 1 else 'entries'} into shared blocks")
        click.echo(f"compacted {format_size(before)} -> {format_size(after)}")
