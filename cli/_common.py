"""Shared CLI plumbing: the store handle, --json, error exits, the size formatter."""

from __future__ import annotations

import functools
import json
import os
import select
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Union

import click

from promptstore import InvalidInput, PromptStore, PromptStoreError, StoreUnavailable, default_path
from promptstore._paths import user_path


class Ctx:
    """``ctx.obj``: the store path, opened lazily so usage errors never touch it.

    ``store`` opens it for writing (created when missing); ``reader()`` is for
    commands that only read: it never creates a store, and opens one this
    user may only read read-only.
    """

    def __init__(self, store_path: Optional[str], remote: Union[str, bool, None] = False):
        self.store_path = store_path
        self.remote = remote  # the --remote URL, or False (--no-remote, or none given)
        self._store: Optional[PromptStore] = None

    @property
    def path(self) -> Path:
        path = user_path(self.store_path, "--store") if self.store_path else default_path()
        if path.exists() and not path.is_dir():  # a folder given as --store was checked as it was parsed
            raise InvalidInput(f"{path}: is a file, not a store folder ($PROMPTSTORE_DIR or --store)")
        return path

    @property
    def store(self) -> PromptStore:
        if self._store is None:
            path = self.path
            if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
                raise StoreUnavailable(f"{path}: the store is read-only for this user; nothing was written. "
                                       "Use a store you may write (--store DIR) or ask its owner")
            self._store = PromptStore(self.store_path, remote=self.remote)
        return self._store

    def reader(self, counted: bool = False) -> PromptStore:
        """The store for a command that only reads; never creates one.

        ``counted``: record hits, misses and last use when this user may
        write the store (``get``); otherwise it is opened read-only, which
        also serves a store this user may only read.

        Raises:
            StoreUnavailable: no store at the path (nothing is created there).
        """
        if self._store is not None:
            return self._store
        path = self.path
        if not self.exists():
            self._missing()
        writable = all(os.access(p, os.W_OK) for p in (path, path / "data.mdb", path / "lock.mdb") if p.exists())
        self._store = PromptStore(path, readonly=not (counted and writable), remote=self.remote)
        return self._store

    def existing_store(self) -> PromptStore:
        """:attr:`store`, for a command that changes a store but never creates one (rm, gc, compact).

        Raises:
            StoreUnavailable: no store at the path.
        """
        if self._store is None and not self.exists():
            self._missing()
        return self.store

    def _missing(self) -> None:
        path = self.path
        what = "no such folder" if not path.exists() else "no data.mdb"
        raise StoreUnavailable(f"{path}: not a promptstore store ({what}); pass the --store DIR of a store "
                               "(`promptstore put` creates one)")

    def exists(self) -> bool:
        """Whether the path holds a store (generation 0's data file, or a compacted one's CURRENT)."""
        return (self.path / "data.mdb").is_file() or (self.path / "CURRENT").is_file()

    def reader_or_none(self, counted: bool = False) -> Optional[PromptStore]:
        """:meth:`reader`, or None when there is no store yet: no folder, or
        an empty one (a folder holding something else is still an error)."""
        path = self.path
        if not path.exists():
            above = next((p for p in path.parents if p.exists()), None)
            if above is not None and not above.is_dir():
                raise InvalidInput(f"{path}: {above} is a file, so no store can be there; check --store")
        if self._store is None and not self.exists() and (not path.exists() or (path.is_dir() and not any(path.iterdir()))):
            return None
        return self.reader(counted)

    def local_only(self) -> "Ctx":
        """This context, for a command that never uses the shared tier (ls of
        the local store, rm, gc, compact, verify, export): the store opens
        without it, so a malformed or unreachable ``--remote`` /
        ``$PROMPTSTORE_REMOTE`` cannot stop local maintenance."""
        if self._store is None:
            self.remote = False
        return self

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def check_output(path: str, hint: str = "-o") -> str:
    """Refuse, before any work, an output file whose folder is missing or not
    writable; return the path to write, a leading ``~`` expanded (a shell
    leaves ``--out=~/x`` and a quoted ``'~/x'`` alone), as the check saw it.

    Raises:
        InvalidInput: naming the folder, or a name that is not UTF-8 (mlx
            writes files by UTF-8 names only).
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInput(f"{hint} {path!r}: the name is not UTF-8 (character {err.start}); choose another name") from err
    target = user_path(path, hint)
    folder = target.resolve().parent
    if not folder.is_dir():
        raise InvalidInput(f"{folder}: no such folder for {hint} {path}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInput(f"{folder}: not writable by this user, so {hint} {path} cannot be written")
    return str(target)


def format_size(n: int) -> str:
    """Human size with a unit, decimal (``3.4 GB``), for tables and footers."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def plural(n: int, word: str = "entry") -> str:
    """``1 entry``, ``2 entries``, ``3 nodes``."""
    return f"{n} {word if n == 1 else (word[:-1] + 'ies' if word.endswith('y') else word + 's')}"


def iso(dt: datetime) -> str:
    """ISO-8601 UTC with a Z, as every --json output uses."""
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout (raw integers, ISO-8601 UTC).")(fn)


def nonempty_store(_ctx: click.Context, _param: click.Parameter, value: Optional[str]) -> Optional[str]:
    """Refuse ``--store ""`` (an unset shell variable, say): it named the
    current directory to a command that writes and the default store to
    one that reads."""
    if value == "":
        raise click.BadParameter("the store directory is empty; name one, or leave --store out for the default store")
    return value


def global_store(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    """The group's ``--store``: checked as a folder when given on the command
    line; from ``$PROMPTSTORE_DIR`` only when used (``Ctx.path``), so that a
    command's own ``--store`` still works beside a stale variable."""
    value = nonempty_store(ctx, param, value)
    if value is not None and ctx.get_parameter_source(param.name or "") is not click.core.ParameterSource.ENVIRONMENT:
        click.Path(file_okay=False).convert(value, param, ctx)  # a usage error naming the file
    return value


def _store_here(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    value = nonempty_store(ctx, param, value)
    obj = ctx.find_object(Ctx)
    if value is not None and obj is not None:
        obj.store_path = value  # the store opens lazily, in the command's body: nothing is open yet
    return value


def store_option(fn: Callable) -> Callable:
    """``--store DIR`` after the command as well as before it
    (``promptstore ls --store DIR``): the group's option, which it overrides."""
    return click.option(
        "--store", "store_path", type=click.Path(file_okay=False), default=None, expose_value=False,
        callback=_store_here, help="Store directory, as the global --store (given here, it wins).",
    )(fn)


def _wants_json(args) -> bool:
    """``--json`` among the arguments, also as ``--json=VALUE`` (a usage error of its own)."""
    return any(a == "--json" or str(a).startswith("--json=") for a in args)


class Command(click.Command):
    """A click command whose usage errors are JSON too when ``--json`` was given.

    Parsing happens before the command body runs, so ``guarded`` cannot see
    those errors; ``make_context`` is where click raises them.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        wants_json = _wants_json(args)
        try:
            return super().make_context(info_name, list(args), parent=parent, **extra)
        except click.UsageError as err:
            if not wants_json:
                raise
            fail("UsageError", err.format_message(), True, code=2)


class Group(click.Group):
    """The command group, whose own usage errors (a bad ``--store``, an
    unknown command) are JSON too when ``--json`` is among the arguments.

    Use as ``@click.group(cls=Group)``.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        wants_json = _wants_json(args)
        try:
            ctx = super().make_context(info_name, list(args), parent=parent, **extra)
        except click.UsageError as err:
            if not wants_json:
                raise
            fail("UsageError", err.format_message(), True, code=2)
        ctx.meta["promptstore.json"] = wants_json
        return ctx

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as err:
            if not ctx.meta.get("promptstore.json"):
                raise
            fail("UsageError", err.format_message(), True, code=2)


def command(name: Optional[str] = None, **kwargs) -> Callable:
    """``@click.command`` with :class:`Command` (JSON usage errors)."""
    return click.command(name, cls=Command, **kwargs)


def guarded(fn: Callable) -> Callable:
    """Expected errors exit 1 with one line (JSON with --json), never a traceback.

    Usage errors raised in the body exit 2 (JSON with --json). Anything
    unexpected is one line too, unless ``PROMPTSTORE_DEBUG`` is set.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except click.UsageError as err:
            if not as_json:
                raise
            fail("UsageError", err.format_message(), as_json, code=2)
        except click.Abort:  # no answer to a confirmation (end of input, Ctrl-C at the prompt)
            if not as_json:
                raise
            fail("Aborted", "not confirmed; nothing was changed", as_json)
        except (click.exceptions.Exit, SystemExit):
            raise
        except PromptStoreError as err:
            fail(type(err).__name__, str(err), as_json)
        except BrokenPipeError as err:
            if not _stdout_gone():  # another pipe (a subprocess's, a socket's): an error like any other
                fail(type(err).__name__, str(err), as_json)
            # The reader of our output left (`promptstore ls | head`): nothing
            # to tell it, and Python's flush of stdout at exit would fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except (OSError, ValueError) as err:
            fail(type(err).__name__, str(err), as_json)
        except KeyboardInterrupt:
            fail("Interrupted", "interrupted; nothing half-written is ever visible in the store", as_json, code=130)
        except Exception as err:  # never a traceback for a user; a bug report line instead
            if os.environ.get("PROMPTSTORE_DEBUG"):
                raise
            fail(
                type(err).__name__,
                f"unexpected {type(err).__name__}: {err} (a bug: rerun with PROMPTSTORE_DEBUG=1 for the traceback and report it)",
                as_json,
            )

    return wrapper


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no such descriptor, or no poll here
        return False


def fail(kind: str, message: str, as_json: bool, code: int = 1) -> None:
    """Print one error line (a JSON object with --json) and exit with ``code``."""
    message = " ".join(str(message).split())  # one line, whatever the message held
    if as_json:
        click.echo(json.dumps({"error": kind, "message": message, "exit_code": code}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


def warn(message: str) -> None:
    """A warning on stderr (never on stdout, which --json keeps for JSON)."""
    click.echo(f"warning: {message}", err=True)


def model_option(required: bool = True, help: str = "mlx-lm model directory.") -> Callable:
    return click.option("--model", "model_dir", required=required, type=click.Path(file_okay=False), metavar="DIR|ORG/NAME", help=help)


def info_json(info) -> dict:
    return {
        "id": info.id,
        "model": info.model,
        "model_name": info.model_name,
        "tokens": info.n_tokens,
        "kinds": list(info.kinds),
        "bytes": info.nbytes,
        "created": iso(info.created),
        "last_used": iso(info.last_used),
        "trimmable": info.trimmable,
        "meta": info.meta,
    }
