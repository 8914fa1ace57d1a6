"""The warm-up job's input: a JSONL file of prompts (or an iterable of
dicts), read into records and line errors; a bad line never stops the job."""

from __future__ import annotations

import codecs
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from promptstore.errors import InvalidInput
from promptstore.format._entry import check_meta

__all__ = ["LineError", "PromptRecord", "read_prompts"]

_KEYS = {"id", "prompt", "messages", "meta"}


@dataclass(frozen=True)
class LineError:
    """One input line that could not be warmed: where, which id, and why."""

    line: int
    id: Any
    reason: str


@dataclass(frozen=True)
class PromptRecord:
    """One valid input line: exactly one of ``prompt`` and ``messages`` is set."""

    line: int
    id: Any
    prompt: Optional[str] = None
    messages: Optional[Tuple[Dict[str, Any], ...]] = None
    meta: Optional[Dict[str, Any]] = None


def _check_record(obj: Any) -> Tuple[Any, Optional[str]]:
    """``(id, reason)``: reason is None when ``obj`` is a valid record."""
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    rid = obj.get("id")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        return rid, f"unknown keys {unknown}; allowed: id, prompt, messages, meta"
    if ("prompt" in obj) == ("messages" in obj):
        return rid, 'give exactly one of "prompt" or "messages"'
    if isinstance(rid, (dict, list)):
        return rid, '"id" must be a string or a number'
    if isinstance(rid, float) and not math.isfinite(rid):  # JSON has no NaN: a --json summary could not print it
        return str(rid), '"id" must be a string or a finite number'
    try:  # the entry's meta holds it as text: one that is not UTF-8 would fail the whole batch at put
        str(rid).encode("utf-8")
    except UnicodeEncodeError as err:
        return None, f'"id" is not valid UTF-8 ({err.reason} at {err.start})'
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        return rid, '"prompt" must be a non-empty string (not only white space, which `promptstore put` refuses too)'
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            return rid, '"messages" must be a non-empty list'
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return rid, f'messages[{j}] must be an object with string "role" and "content"'
    if "meta" in obj and not isinstance(obj["meta"], dict):
        return rid, '"meta" must be an object'
    try:  # the store's own check of the meta stored (the id goes in it), so one bad line never fails its batch
        check_meta({**obj.get("meta", {}), **({"warmup": str(rid)} if rid is not None else {})})
    except InvalidInput as err:
        return rid, str(err)
    return rid, None


def read_prompts(source: Union[str, os.PathLike, Iterable[Dict[str, Any]]]) -> Tuple[List[PromptRecord], List[LineError]]:
    """Parse a JSONL prompt file (or an iterable of dicts) into records and line errors.

    Each line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages":
    [...]}`` with an optional ``"meta": {...}`` stored with the entry. Blank
    lines are ignored. Line numbers count from 1 (for an iterable, its index + 1).

    Raises:
        InvalidInput: the file cannot be read at all.
    """
    records: List[PromptRecord] = []
    errors: List[LineError] = []
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            raw_lines = path.read_bytes().split(b"\n")
        except OSError as err:
            raise InvalidInput(f"{path}: cannot read the prompt file ({err.strerror or err})") from err
        items: List[Tuple[int, Any]] = []
        if raw_lines[0].startswith(codecs.BOM_UTF8):  # a byte-order mark some editors write first
            raw_lines[0] = raw_lines[0][len(codecs.BOM_UTF8):]
        for n, raw in enumerate(raw_lines, 1):
            if not raw.strip():
                continue
            try:
                items.append((n, json.loads(raw.decode("utf-8"))))
            except UnicodeDecodeError as err:
                errors.append(LineError(n, None, f"not UTF-8 ({err.reason} at byte {err.start})"))
            except ValueError as err:
                errors.append(LineError(n, None, f"not JSON ({err})"))
            except RecursionError:  # nested deeper than the JSON parser recurses
                errors.append(LineError(n, None, "not JSON that can be read (nested too deeply)"))
    else:
        items = list(enumerate(source, 1))
    for n, obj in items:
        rid, reason = _check_record(obj)
        if reason is not None:
            errors.append(LineError(n, rid, reason))
            continue
        msgs = obj.get("messages")
        records.append(
            PromptRecord(
                line=n,
                id=rid,
                prompt=obj.get("prompt"),
                messages=tuple(dict(m) for m in msgs) if msgs is not None else None,
                meta=dict(obj["meta"]) if "meta" in obj else None,
            )
        )
    errors.sort(key=lambda e: e.line)
    return records, errors
