"""``promptstore salvage SRC DST``: copy every intact entry into a fresh store."""

from __future__ import annotations

import sys

import click

from promptstore.store._salvage import salvage as run_salvage
from promptstore.cli._common import command, emit_json, guarded, json_option, plural


@command()
@click.argument("src", type=click.Path(file_okay=False, exists=True))
@click.argument("dst", type=click.Path(file_okay=False))
@json_option
@guarded
def salvage(src, dst, as_json):
    """Copy every intact entry of the store SRC into a new store DST.

    SRC is only read (a damaged store may not even open normally); each entry
    is fully checked before it is copied. When the data file's tree cannot be
    walked (cut short, header pages destroyed), its bytes are scanned for
    intact entries. Then point --store at DST.

    Exits 1 when SRC held entries (or unreadable tables) and none could be
    copied.
    """
    report = run_salvage(src, dst)
    failed = not report.copied and bool(report.skipped or report.unreadable_tables)
    if as_json:
        emit_json({"src": report.src, "dst": report.dst, "copied": list(report.copied),
                   "skipped": [{"id": i, "why": w} for i, w in report.skipped],
                   "unreadable_tables": list(report.unreadable_tables), "scanned": list(report.scanned),
                   "ok": not failed})
        if failed:
            sys.exit(1)
        return
    for eid, why in report.skipped:
        click.echo(f"skipped {eid}: {why}", err=True)
    if report.unreadable_tables:
        click.echo(f"warning: tables partly unreadable: {', '.join(report.unreadable_tables)}", err=True)
    scanned = f" ({len(report.scanned)} found by scanning the data file's bytes)" if report.scanned else ""
    click.echo(f"salvaged {plural(len(report.copied))} into {report.dst}{scanned}; {len(report.skipped)} left behind")
    if failed:
        click.echo(f"error: nothing in {report.src} could be salvaged; {report.dst} holds an empty store", err=True)
        sys.exit(1)
