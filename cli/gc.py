"""``promptstore gc``: evict least-recently-used entries down to the byte budget."""

from __future__ import annotations

import re
from decimal import Decimal, localcontext

import click

from promptstore import InvalidInput
from promptstore.cli._common import command, emit_json, fail, format_size, guarded, json_option, plural, store_option
from promptstore.cli.rm import interactive
from promptstore.store._budget import MAX_BUDGET, check_budget


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?)(B?)")


def parse_bytes(text: str) -> int:
    """``12GB``, ``500MB``, ``1.5G``, ``1000000``: decimal units, as format_size
    prints them; ``100KiB``, ``1.5GiB``: binary units (powers of 1024).

    Raises:
        click.BadParameter: anything else, or a size the store cannot hold
            as its budget (``2**64`` bytes or more).
    """
    m = _SIZE.fullmatch(text.strip().upper())
    if m is None or (m.group(3) and not m.group(2)):  # "5iB" is no unit
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500MB, 12GB, 100KiB)", param_hint="--budget")
    number, prefix, binary, _ = m.groups()
    power = " KMGT".index(prefix or " ")
    with localcontext() as ctx:
        ctx.prec = 60  # exact for any size this accepts: a float rounds large counts
        exact = Decimal(number) * (1024 if binary else 1000) ** power
    if exact != int(exact) and (power == 0 or exact < 1):  # 0.5 (bytes) meant a budget of 0
        raise click.BadParameter(f"{text!r} is not a whole number of bytes", param_hint="--budget")
    size = int(exact)  # 1.3GiB: rounded down to whole bytes
    try:
        check_budget(size)  # the API's own check, before the store is touched (dry run included)
    except InvalidInput as err:
        shown = text if len(text) <= 40 else text[:20] + "..." + text[-8:]
        raise click.BadParameter(f"{shown!r} is larger than a store's budget can be ({MAX_BUDGET} bytes)", param_hint="--budget") from err
    return size


@command()
@click.option("--budget", default=None, metavar="SIZE", help="Set the store's byte budget (remembered), e.g. 20GB or 16GiB; 'none' removes it.")
@click.option("--dry-run", is_flag=True, help="Show what would be evicted; change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Evict without asking (required without a terminal).")
@store_option
@json_option
@click.pass_obj
@guarded
def gc(obj, budget, dry_run, yes, as_json):
    """Evict least-recently-used unpinned entries until the store fits its budget.

    With --budget, the new budget is stored first (every later put then evicts
    by itself). Also removes blob and pack files no entry names (left by killed puts).
    The data file does not shrink: run `promptstore compact`.
    """
    # A dry run only reads: it plans on a store this user may only read, too.
    new_budget = None if budget is None or budget.lower() == "none" else parse_bytes(budget)  # a usage error first
    local = obj.local_only()
    store = local.reader() if dry_run else local.existing_store()
    target = new_budget if budget is not None else store.budget
    plan = store.gc(budget=target, dry_run=True) if target is not None else None
    evicting = plan.evicted if plan else ()
    if not as_json:
        click.echo(f"budget {format_size(target) if target is not None else 'none'}; in use {format_size(store.usage())}")
        if evicting:
            click.echo(f"plan: evict {plural(len(evicting))}, {format_size(plan.freed)} (least recently used first)")
    # Pinned entries are never evicted: past them the budget cannot be met (the real run refuses it).
    short = plan is not None and target is not None and plan.usage > target
    if short and not as_json:
        why = ("unpin entries or choose a larger budget" if list(store.pinned()) else
               "no entry is pinned: the blocks of damaged entries, or of a newer release's, still count (gc "
               "frees those no entry names after it evicts; `promptstore verify` lists them)")
        click.echo(f"the budget cannot be reached: after evicting every unpinned entry the store would hold "
                   f"{format_size(plan.usage)}; {why}", err=True)
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, "budget": target, "evict": list(evicting), "bytes": plan.freed if plan else 0,
                       "usage": plan.usage if plan else store.usage(), "reachable": not short})
        else:
            click.echo("dry run: nothing evicted")
        return
    if evicting and not yes:
        if not interactive():
            fail("NeedsConfirmation", f"refusing to evict {plural(len(evicting))} without a terminal to confirm; pass --yes", as_json)
        if not click.confirm(f"Evict {plural(len(evicting))}, {format_size(plan.freed)}?", default=False, err=True):
            fail("Aborted", "not confirmed; nothing evicted", as_json)
    # Exactly the confirmed plan is evicted: entries used or added since do not change it.
    if budget is not None:
        evicted = store.set_budget(new_budget, plan=plan).evicted
        store.gc(plan=plan)  # recounts sizes and sweeps stray blob files; the planned entries are gone already
    else:
        evicted = store.gc(plan=plan).evicted
    if as_json:
        emit_json({"dry_run": False, "budget": store.budget, "evicted": list(evicted),
                   "usage": store.usage(), "file_bytes": store.file_size()})
    else:
        click.echo(f"evicted {plural(len(evicted))}; in use {format_size(store.usage())}; "
                   f"file {format_size(store.file_size())} (run `promptstore compact` to shrink it)")
