"""Selecting entries at the command line: by model, by age, and short keys."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Callable, Iterable, List, Optional

import click

from promptstore import InvalidInput
from promptstore._paths import user_path
from promptstore.cli._model import identities

MIN_KEY = 12
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+)\s*([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or a sum like ``1d12h``.

    Raises:
        click.BadParameter: anything else.
    """
    s = text.strip().lower()
    parts = _DURATION.findall(s)
    if not parts or _DURATION.sub("", s).strip():
        raise click.BadParameter(f"{text!r} is not a duration like 7d, 12h, 30m, 45s, 2w or 1d12h", param_hint="--older-than")
    try:
        return timedelta(seconds=sum(int(n) * _UNITS[u] for n, u in parts))
    except OverflowError as err:
        raise click.BadParameter(f"{text!r} is longer than any age an entry can have", param_hint="--older-than") from err


def key_length(ids: Iterable[str]) -> int:
    """The shortest prefix length (at least 12) that keeps every id unique, like a git short hash."""
    ids = sorted(set(ids))
    n = MIN_KEY
    for a, b in zip(ids, ids[1:]):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        n = max(n, common + 1)
    return n


def model_filter(model: Optional[str]) -> Callable:
    """A predicate on EntryInfo: a model folder (or a Hugging Face id in the
    local cache) matches its identities (and the folder-named identity of
    older releases); anything else matches the readable model name (as
    ``ls`` shows it) or a whole identity string."""
    if model is None:
        return lambda info: True
    path = user_path(model, "--model")
    if model.startswith(("/", "./", "../", "~")) and not path.exists():  # a path, mistyped: it would match nothing
        raise InvalidInput(f"--model {model}: no such folder; give a model directory, or the name `ls` shows")
    if (path / "config.json").is_file() or (not path.exists() and model.count("/") == 1 and "@" not in model):
        try:
            ids = set(identities(model))
        except InvalidInput:
            if path.exists():
                raise
        else:
            return lambda info: info.model in ids
    return lambda info: info.model_name == model or info.model == model


def unmatched_model(model: Optional[str], everything: List, matched: List) -> Optional[str]:
    """A hint for a ``--model`` that matches none of the store's entries
    (a mistyped name would otherwise list or remove nothing, silently): the
    model names the store does hold. None when it matched, or the store is empty."""
    if model is None or matched or not everything:
        return None
    names = sorted({i.model_name for i in everything})
    return (f"no entry is of model {model!r}; the store holds entries of {', '.join(names)} "
            "(give one of these names, or a model directory)")


def model_help(verb: str) -> str:
    return f"{verb} only entries of this model (a model directory, or the name `ls` shows)."


def keys_of(infos: List) -> dict:
    """``{id: displayed key}`` for a list of EntryInfo."""
    n = key_length(i.id for i in infos)
    return {i.id: i.id[:n] for i in infos}
