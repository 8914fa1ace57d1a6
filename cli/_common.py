"""Shared CLI plumbing: the store handle, --json, error exits, the size formatter."""

from __future__ import annotations

import functools
import json
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import click

from promptstore import PromptStore, PromptStoreError


class Ctx:
    """``ctx.obj``: the store path, opened lazily so usage errors never touch it."""

    def __init__(self, store_path: Optional[str]):
        self.store_path = store_path
        self._store: Optional[PromptStore] = None

    @property
    def store(self) -> PromptStore:
        if self._store is None:
            self._store = PromptStore(self.store_path)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def format_size(n: int) -> str:
    """Human size with a unit, decimal (``3.4 GB``), for tables and footers."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def iso(dt: datetime) -> str:
    """ISO-8601 UTC with a Z, as every --json output uses."""
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout (raw integers, ISO-8601 UTC).")(fn)


def guarded(fn: Callable) -> Callable:
    """Expected errors exit 1 with one line (JSON with --json), never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except PromptStoreError as err:
            fail(type(err).__name__, str(err), as_json)
        except (OSError, ValueError) as err:
            fail(type(err).__name__, str(err), as_json)

    return wrapper


def fail(kind: str, message: str, as_json: bool, code: int = 1) -> None:
    if as_json:
        click.echo(json.dumps({"error": kind, "message": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


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
