"""``promptstore ls``: list stored entries."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import click

from promptstore import EntryInfo
from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, plural, store_option
from promptstore.cli._select import key_length, model_filter, model_help, unmatched_model
from promptstore.remote import Remote
from promptstore.store._keys import entry_id
from promptstore.store._results import utc

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


@contextmanager
def remote_of(obj, option: str) -> Iterator[Remote]:
    """The shared tier the global ``--remote URL`` (or ``$PROMPTSTORE_REMOTE``)
    names, connected without a local store, closed after.

    Raises:
        click.UsageError: no remote is set.
        RemoteURLError: a URL the tier cannot use.
    """
    if not obj.remote:
        raise click.UsageError(f"{option} needs a shared tier: promptstore --remote redis://HOST:PORT ... "
                               "(or set PROMPTSTORE_REMOTE)")
    remote = Remote(obj.remote)
    try:
        yield remote
    finally:
        remote.close()


def remote_infos(remote: Remote) -> Tuple[List[EntryInfo], int]:
    """EntryInfo of every readable remote entry (ids as the local store names
    the same entry; ``last_used`` is the publish time: the remote records no use;
    ``shared`` the bytes in blocks another remote entry names too), and the
    bytes of the distinct blocks they name (each stored once on the remote).

    Raises:
        RemoteUnavailable: the remote cannot be read.
    """
    found = list(remote.entries())
    users: Dict[bytes, int] = {}
    sizes: Dict[bytes, int] = {}
    for _, man in found:
        for addr, n in man.parts():
            users[addr] = users.get(addr, 0) + 1
            sizes[addr] = n
    infos = []
    for ekey, man in found:
        shared = sum(n for addr, n in man.parts() if users[addr] > 1)
        when = utc(man.created)
        infos.append(EntryInfo(id=entry_id(ekey), model=man.model, model_name=man.name, n_tokens=len(man.tokens),
                               kinds=man.kinds, nbytes=man.nbytes, created=when, last_used=when,
                               trimmable=man.trimmable, meta=dict(man.meta), shared=min(shared, man.nbytes)))
    return infos, sum(sizes.values())


@command()
@click.option("--model", default=None, help=model_help("List"))
@click.option("--sort", type=click.Choice(sorted(SORTS)), default="used", show_default=True, help="Order, largest or latest first.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most N entries.")
@click.option("--remote", "from_remote", is_flag=True,
              help="List the shared tier's entries (the global --remote URL or PROMPTSTORE_REMOTE), not the local store's.")
@store_option
@json_option
@click.pass_obj
@guarded
def ls(obj, model, sort, limit, from_remote, as_json):
    """List the entries in the store.

    KEY is a unique prefix of the entry id: pass it to rm or export. SIZE is
    the entry's cache bytes; OWN the part no other entry shares (what `rm`
    frees), SHARED the part in prefix blocks it shares with other entries.
    LAST USED is local time (--json: ISO-8601 UTC). The store is opened
    read-only; a path with no store yet lists nothing.

    With --remote, the entries of the shared tier (every host's), read with
    a scan of its manifests: KEY is the id the local store gives the same
    entry; OWN and SHARED split SIZE by the blocks other remote entries name
    too; PUBLISHED (--json: created and last_used) is when it was published.
    """
    if from_remote:
        with remote_of(obj, "ls --remote") as remote:
            everything, _ = remote_infos(remote)
        store = None
    else:
        store = obj.local_only().reader_or_none()  # read-only; no store yet lists nothing and creates none
        everything = list(store.entries()) if store is not None else []
    keylen = key_length(i.id for i in everything)
    keep = model_filter(model)
    infos = sorted((i for i in everything if keep(i)), key=SORTS[sort], reverse=True)
    shown = infos[:limit] if limit else infos
    hint = unmatched_model(model, everything, infos)
    if hint is not None:
        click.echo(hint, err=True)
    if from_remote:
        own = {i.id: i.own for i in shown}
    else:
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
        rows = entry_rows(shown, keylen, own)
        if from_remote:  # a remote keeps no record of use
            rows[0] = rows[0][:-1] + ("PUBLISHED",)
        render_table(rows, right={3, 4, 5, 6})
    total = sum(i.nbytes for i in infos)
    more = f" (showing {len(shown)})" if len(shown) < len(infos) else ""
    click.echo(f"{plural(len(infos))}, {format_size(total)}{more}")
