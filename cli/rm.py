"""``promptstore rm``: delete entries by key, by model or by age; plan first."""

from __future__ import annotations

import sys
from datetime import datetime, timezone

import click

from promptstore.errors import CorruptEntry
from promptstore.cli._common import command, emit_json, fail, format_size, guarded, info_json, json_option, plural, store_option
from promptstore.cli._select import key_length, model_filter, model_help, parse_duration, unmatched_model
from promptstore.cli.ls import entry_rows, render_table


def interactive() -> bool:
    """Whether a person can answer the confirmation (standard input is a terminal)."""
    return sys.stdin.isatty()


@command()
@click.argument("keys", nargs=-1)
@click.option("--model", default=None, help=model_help("Remove"))
@click.option("--older-than", "older_than", default=None, metavar="DURATION", help="Remove entries last used longer ago than this (7d, 12h, 30m).")
@click.option("--dry-run", is_flag=True, help="Show the plan; delete nothing.")
@click.option("-y", "--yes", is_flag=True, help="Delete without asking (required without a terminal).")
@store_option
@json_option
@click.pass_obj
@guarded
def rm(obj, keys, model, older_than, dry_run, yes, as_json):
    """Delete entries: KEY... (ids or unique prefixes), or every entry matching
    --model and/or --older-than.

    Shows the plan first; asks before deleting unless --yes.
    """
    if keys and (model or older_than):
        raise click.UsageError("give KEYs, or --model/--older-than, not both")
    if not keys and not model and not older_than:
        raise click.UsageError("nothing selected: give KEYs, --model or --older-than")
    age = parse_duration(older_than) if older_than else None  # a usage error before the store is touched
    cutoff = None
    if age is not None:
        try:
            cutoff = datetime.now(timezone.utc) - age
        except OverflowError as err:  # before the year 1: as parse_duration refuses a longer one
            raise click.BadParameter(f"{older_than!r} is longer than any age an entry can have", param_hint="--older-than") from err
    # A dry run only reads: it plans on a store this user may only read, and
    # never upgrades one of an older layout (its release could not open it then).
    local = obj.local_only()
    store = local.reader() if dry_run else local.existing_store()
    everything = list(store.entries())
    if keys:
        plan, seen = [], set()
        for key in keys:
            try:
                info = store.info(key)  # EntryNotFound names the key: nothing is deleted
            except CorruptEntry as err:  # its manifest is what is damaged: rm cannot say what it would remove
                raise CorruptEntry(f"{err}; `promptstore verify --fix` removes damaged entries") from err
            if info.id not in seen:
                seen.add(info.id)
                plan.append(info)
    else:
        keep = model_filter(model)
        hint = unmatched_model(model, everything, [i for i in everything if keep(i)])
        if hint is not None:
            click.echo(hint, err=True)
        plan = [i for i in everything if keep(i) and (cutoff is None or i.last_used < cutoff)]
    total = sum(i.nbytes for i in plan)
    # What removing them together frees: their own bytes and manifests, and
    # the blocks no entry outside the plan references.
    own = store.frees([i.id for i in plan]) if plan else 0
    keylen = key_length(i.id for i in everything)

    def report(removed, missing=(), freed=0):
        if as_json:
            emit_json({
                "dry_run": dry_run,
                "planned": [info_json(i) for i in plan],
                "removed": [i.id for i in removed],
                "vanished": list(missing),
                "bytes": sum(i.nbytes for i in removed) if not dry_run else total,  # their caches' bytes
                "own_bytes": own,  # what removing them frees: not shared with entries outside the plan (before removal)
                "freed": freed,  # what the store's usage fell by
            })

    if not plan:
        if not as_json:
            click.echo("nothing to remove")
        report([])
        return
    if not as_json:
        render_table(entry_rows(plan, keylen), right={3, 4})
        click.echo(f"plan: remove {plural(len(plan))}, {format_size(total)} of cache; frees {format_size(own)} "
                   "(what no entry outside the plan shares)")
    if dry_run:
        if not as_json:
            click.echo("dry run: nothing removed")
        report([])
        return
    if not yes:
        if not interactive():
            fail("NeedsConfirmation", f"refusing to remove {plural(len(plan))} ({format_size(total)}) without a terminal to confirm; pass --yes", as_json)
        if not click.confirm(f"Remove {plural(len(plan))}, {format_size(total)}?", default=False, err=True):
            fail("Aborted", "not confirmed; nothing removed", as_json)
    # Exactly the planned entries, in one transaction: one removed or replaced
    # by another process since the plan is reported, not deleted.
    before = store.usage()
    removed, missing = store.remove_planned(plan)
    freed = max(0, before - store.usage())
    if as_json:
        report(removed, missing, freed)
        return
    click.echo(f"removed {plural(len(removed))}, {format_size(sum(i.nbytes for i in removed))} of cache; {format_size(freed)} freed")
