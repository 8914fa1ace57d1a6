"""``promptstore verify``: check every manifest and checksum; ``--fix`` removes what is broken."""

from __future__ import annotations

import sys

import click

from promptstore.cli._common import command, emit_json, guarded, json_option, plural, store_option


@command()
@click.option(
    "--fix",
    is_flag=True,
    help="Delete damaged entries, orphaned chunks, blocks and blob files, repair block reference counts, "
    "and rebuild the index, entry ids and pack records (a block's lost place is restored from its pack file "
    "when its bytes there are intact). "
    "Entries written by a newer promptstore are kept.",
)
@store_option
@json_option
@click.pass_obj
@guarded
def verify(obj, fix, as_json):
    """Check every entry's manifest and array checksums.

    Exits 1 when problems were found (also when --fix removed them).
    """
    store = obj.local_only().reader()  # never creates a store; read-only unless --fix
    if fix:
        obj.close()
        store = obj.store
    report = store.verify(fix=fix)
    if as_json:
        emit_json({
            "checked": report.checked,
            "problems": [{"id": eid, "problem": what} for eid, what in report.problems],
            "newer": [{"id": eid, "problem": what} for eid, what in report.newer],
            "orphan_chunks": report.orphan_chunks,
            "orphan_blobs": report.orphan_blobs,
            "orphan_packs": report.orphan_packs,
            "bad_counts": report.bad_counts,
            "orphan_blocks": report.orphan_blocks,
            "bad_accounting": report.bad_accounting,
            "bad_records": report.bad_records,
            "removed": list(report.removed),
            "fixed": report.fixed and not report.ok,
            "ok": report.ok,
        })
    else:
        for eid, what in report.problems:
            click.echo(f"damaged {eid}: {what}")
        for eid, what in report.newer:
            click.echo(f"newer {eid}: {what} (kept: upgrade promptstore to read it)")
        if report.orphan_chunks:
            click.echo(f"{report.orphan_chunks} orphaned chunk(s)")
        if report.bad_counts:
            click.echo(f"{report.bad_counts} shared block(s) with a wrong reference count" + (" (repaired)" if fix else ""))
        if report.orphan_blocks:
            click.echo(f"{report.orphan_blocks} shared block(s) no entry references" + (" (removed)" if fix else ""))
        if report.bad_accounting:
            click.echo(f"{report.bad_accounting} wrong byte count(s) (entry sizes, store usage)" + (" (recounted)" if fix else ""))
        if report.bad_records:
            click.echo(f"{report.bad_records} wrong index record(s) (pack records, entry ids)" + (" (rebuilt)" if fix else ""))
        for count, what in ((report.orphan_blobs, "blob file(s) no entry names"), (report.orphan_packs, "pack file(s) the store does not record")):
            if count:
                click.echo(f"{count} {what} (left by killed puts; " + ("removed)" if fix else "`promptstore gc` removes them)"), err=True)
        if report.ok:
            click.echo(f"ok: {plural(report.checked)} checked")
        elif fix:
            kept = len(report.problems) - len(report.removed)
            click.echo(
                f"fixed: removed {plural(len(report.removed), 'damaged entry')} and {plural(report.orphan_chunks, 'orphaned chunk')} "
                f"of {report.checked} checked"
                + (f"; kept {plural(kept)} listed above, not found damaged (reading failed, or it changed meanwhile)" if kept else "")
            )
        elif report.problems:
            mends = ("; it first rebuilds the wrong index records, which may make some readable again"
                     if report.bad_records else "")
            click.echo(f"{len(report.problems)} damaged of {report.checked} checked; run `promptstore verify --fix` "
                       f"to remove them{mends}", err=True)
        else:  # counts or leftovers only: every entry is intact
            click.echo(f"{plural(report.checked)} checked, none damaged; `promptstore verify --fix` repairs what is listed above", err=True)
    if not report.ok:
        sys.exit(1)
