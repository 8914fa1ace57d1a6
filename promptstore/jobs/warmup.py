"""Offline warm-up: batched, resumable pre-computation of prompt caches.

An operator knows the hot prompts (system prompts, tool schemas, shared
documents). :func:`warmup` prefills each of them once and stores its cache,
so the first real request already hits.

How it works:

- Prompts are read and templated up front; a bad line is reported with its
  line number and reason, and the job goes on.
- Prompts already stored at exact coverage are skipped, which makes a job
  resumable: after a crash, run it again and it continues where it stopped.
  Entries appear whole or not at all (the store writes a manifest last), so
  a killed job leaves nothing partial behind.
- Prompts are sorted by length and prefilled in batches of ``batch_size``:
  rows are left-padded to the longest in the batch with mlx-lm's own batch
  caches (``BatchKVCache(left_padding)``, ``ArraysCache(left_padding=...)``)
  and each row is extracted with its padding stripped before it is stored.
- Caches that cannot be trimmed (recurrent layers, sliding windows) get
  checkpoints: at message boundaries (end of each system and user message,
  verified to be a token prefix of the whole conversation) and every
  ``checkpoint_every`` tokens, so later prompts that share a prefix hit.
  A checkpoint is stored at its position before prefill goes on.
- Batched entries must be byte-identical to one-prompt-at-a-time entries.
  On CPU that holds for the fixture models (measured, padding included), but
  it is a property of the kernels, not a law: so the first batch of a job is
  checked against a serial prefill of its most padded row, and if any array
  differs the job falls back to one prompt at a time (``summary.batched`` is
  False and ``summary.note`` says why).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import mlx.core as mx

from promptstore.codecs import codec_for_layer, encode_layer
from promptstore.jobs.checkpoints import message_boundaries, needs_checkpoints
from promptstore.errors import InvalidInput, PromptStoreError, StoreFull
from promptstore.format import _entry
from promptstore.format._blocks import BLOCK_TOKENS
from promptstore.identity import fingerprint
from promptstore.jobs.prefill import (
    PREFILL_STEP, CacheOptions, encode_prompt, eval_cache, id_error, load_model, make_cache, quantizer, vocab_size,
)
from promptstore.jobs.prompts import LineError, PromptRecord, read_prompts
from promptstore.rows import extract_row

__all__ = [
    "warmup",
    "WarmupSummary",
    "LineError",
    "PromptRecord",
    "read_prompts",
]

log = logging.getLogger("promptstore")

# (prompts done, prompts to do, tokens prefilled so far, seconds so far)
Progress = Callable[[int, int, int, float], None]


@dataclass(frozen=True)
class WarmupSummary:
    """What a warm-up job did.

    ``prompts`` input records (non-blank lines, bad ones included); ``stored`` prompts whose entry this job
    wrote; ``skipped`` prompts already stored (or repeated in the input);
    ``failed`` lines that failed (bad input, or a store error); ``checkpoints``
    checkpoint entries written; ``tokens`` tokens prefilled; ``bytes`` payload
    bytes written; ``batched`` whether rows were prefilled in batches;
    ``stopped`` why the job stopped early (None when it ran to the end).
    """

    prompts: int
    stored: int
    skipped: int
    failed: int
    checkpoints: int
    tokens: int
    bytes: int
    seconds: float
    batch_size: int
    batched: bool
    errors: Tuple[LineError, ...] = ()
    stopped: Optional[str] = None
    note: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when every line was warmed or skipped and the job ran to the end."""
        return self.failed == 0 and self.stopped is None


# -- the job -------------------------------------------------------------------


@dataclass
class _Plan:
    """One prompt to prefill: its tokens, checkpoint positions and metas.

    ``splits`` are where its prefill stops, every checkpoint position the
    prompt itself calls for; ``cuts`` those of them stored by this job (not
    already stored, nor claimed by another prompt). The cache at a split can
    depend on where prefill stopped before it (a sliding window's layout,
    quantized values), so the splits never depend on what the store holds:
    a resumed job stores what an uninterrupted one does."""

    record: PromptRecord
    tokens: List[int]
    cuts: Dict[int, Dict[str, Any]]  # checkpoint length -> entry meta
    meta: Dict[str, Any]
    splits: Tuple[int, ...] = ()


def _batchable(model: Any, options: CacheOptions) -> bool:
    """Whether every layer's codec can prefill rows left-padded in a batch
    (the cache ``options`` make; quantizing mid-prefill is serial only).

    Raises:
        UnknownStorageKind: a layer's exact class has no codec.
    """
    return options.kv_bits is None and all(codec_for_layer(layer).batchable for layer in make_cache(model, options))


def _batch_cache(model: Any, pads: List[int], options: CacheOptions) -> List[Any]:
    return [codec_for_layer(layer).batch_layer(layer, pads) for layer in make_cache(model, options)]


def _same_entry(a: List[Any], b: List[Any]) -> bool:
    """Bit-exact comparison of two encoded caches (lists of ``Encoded``)."""
    if len(a) != len(b):
        return False
    for ex, ey in zip(a, b):
        if (ex.kind, ex.version, ex.meta) != (ey.kind, ey.version, ey.meta) or set(ex.arrays) != set(ey.arrays):
            return False
        for k, u in ex.arrays.items():
            v = ey.arrays[k]
            if u.dtype != v.dtype or u.shape != v.shape or not mx.array_equal(u, v).item():
                return False
    return True


class _BudgetReached(Exception):
    """The next entry would take the job's bytes past the store's budget."""

    def __init__(self, written: int, need: int, budget: int):
        super().__init__(
            f"the job wrote {written} bytes and the next entry needs {need} more, past the store's byte budget of "
            f"{budget}; run it again after `promptstore gc`, or raise the budget"
        )


class _Job:
    def __init__(self, store, model, model_id: str, batch_size: int, options: CacheOptions, progress: Optional[Progress], total: int):
        self.store = store
        self.model = model
        self.model_id = model_id
        self.batch_size = batch_size
        self.options = options
        self.step = options.step
        self.quantize = quantizer(options)  # serial only (see _batchable)
        self.progress = progress
        self.total = total
        self.done = 0
        self.tokens = 0
        self.bytes = 0
        self.stored = 0
        self.checkpoints = 0
        self.start = time.perf_counter()
        self.cut = BLOCK_TOKENS  # the shortest block its entries' manifests name (set by the job)

    def _tick(self, tokens: int = 0, prompts: int = 0) -> None:
        self.tokens += tokens
        self.done += prompts
        if self.progress is not None:
            self.progress(self.done, self.total, self.tokens, time.perf_counter() - self.start)

    def put(self, tokens: List[int], cache: List[Any], meta: Dict[str, Any], final: bool) -> None:
        if not final and self.store.exists(self.model_id, tokens):
            return  # stored already (by an earlier run, or before its batch failed and its rows ran again): not written, not counted
        budget = self._budget()
        if budget is not None:
            # The entry's array bytes (lazy slices: nothing is copied to count
            # them) and its manifest's, as the store's budget counts them.
            arrays = [a for e in map(encode_layer, cache) for a in e.arrays.values()]
            need = sum(a.nbytes for a in arrays) + _entry.manifest_bound(len(tokens), len(arrays), meta, self.cut)
            if self.bytes + need > budget:
                raise _BudgetReached(self.bytes, need, budget)
        info = self.store.put(self.model_id, tokens, cache, meta=meta)
        # What the store took, its manifest included: blocks it already held (a shared prefix) count once.
        self.bytes += info.added if info.added is not None else info.nbytes
        if final:
            self.stored += 1
        else:
            self.checkpoints += 1

    def _budget(self) -> Optional[int]:
        """The store's byte budget now: read at each put, so one set while
        the job runs (another process's ``gc --budget``) stops it too."""
        budget = getattr(self.store, "budget", None)
        budget = budget() if callable(budget) else budget
        return budget if isinstance(budget, int) and budget > 0 else None

    def over_budget(self) -> bool:
        # Past its budget the store evicts by last use: the job would evict
        # the entries it has just warmed. Stop instead.
        budget = self._budget()
        return budget is not None and self.bytes >= budget

    def run(self, plans: List[_Plan], batched: bool, sink: Optional[List] = None) -> None:
        """Prefill ``plans`` as one batch (or serially when one), storing each
        checkpoint when reached and each final entry at the end. With ``sink``
        the entries are collected ``(row, tokens, cache, encoded, meta, final)``
        instead (a serial cache keeps changing: only its encoding is a snapshot)."""
        B = len(plans)
        lengths = [len(p.tokens) for p in plans]
        L = max(lengths)
        pads = [L - n for n in lengths]
        rows = batched and B > 1
        cache = _batch_cache(self.model, pads, self.options) if rows else make_cache(self.model, self.options)
        x = mx.array([[0] * pad + p.tokens for pad, p in zip(pads, plans)])
        events: Dict[int, List[Tuple[int, int]]] = {}
        for i, p in enumerate(plans):
            for n in p.splits:
                events.setdefault(pads[i] + n, []).append((i, n))
        pos = 0
        for stop in sorted(set(events) | {L}):
            while pos < stop:
                n = min(self.step, stop - pos)
                self.model(x[:, pos : pos + n], cache=cache)
                if self.quantize is not None:
                    self.quantize(cache)
                eval_cache(cache)
                live = sum(max(0, min(pos + n, L) - max(pos, pad)) for pad in pads)
                pos += n
                self._tick(tokens=live)
            for i, n in events.get(stop, ()):
                if n in plans[i].cuts:
                    self._emit(i, plans[i], n, self._row(cache, i, rows), False, sink)
        for i, p in enumerate(plans):
            self._emit(i, p, len(p.tokens), self._row(cache, i, rows), True, sink)

    @staticmethod
    def _row(cache: List[Any], i: int, rows: bool) -> List[Any]:
        if not rows:
            return cache
        return extract_row(cache, i)  # a compact, evaluated copy of row i, before prefill goes on

    def _emit(self, i: int, plan: _Plan, n: int, cache: List[Any], final: bool, sink: Optional[List]) -> None:
        meta = plan.meta if final else plan.cuts[n]
        if sink is not None:
            # Encoded now: a snapshot of the arrays, whatever prefill does next.
            encoded = [encode_layer(layer) for layer in cache]
            mx.eval([a for e in encoded for a in e.arrays.values()])
            sink.append((i, plan.tokens[:n], cache, encoded, meta, final))
        else:
            self.put(plan.tokens[:n], cache, meta, final)


@dataclass(frozen=True)
class _Templating:
    """How prompts become tokens: as ``promptstore put`` templates them, the
    longest prompt allowed (None: any) and the model's vocabulary (the rows
    of its embedding; None: unknown)."""

    chat_template: bool
    system_prompt: Optional[str]
    max_tokens: Optional[int]
    vocab: Optional[int] = None


def _plan(records: List[PromptRecord], tokenizer: Any, store, model_id: str, how: _Templating, checkpoints: bool, every: int, errors: List[LineError]):
    """Template every record; drop stored ones and repeats; choose checkpoints."""
    plans: List[_Plan] = []
    skipped = 0
    seen: Dict[Tuple[int, ...], int] = {}
    chat_template = how.chat_template
    for rec in records:
        try:
            msgs = list(rec.messages) if rec.messages is not None else None
            tokens = encode_prompt(tokenizer, rec.prompt, msgs, chat_template=chat_template, system_prompt=how.system_prompt)
        except PromptStoreError as err:
            errors.append(LineError(rec.line, rec.id, str(err)))
            continue
        except Exception as err:  # a template that raises on this input (jinja, tokenizer)
            errors.append(LineError(rec.line, rec.id, f"cannot template: {type(err).__name__}: {err}"))
            continue
        if not tokens:
            errors.append(LineError(rec.line, rec.id, "the prompt encodes to no tokens"))
            continue
        wrong = id_error(tokens, how.vocab)  # the batched prefill below runs the model without prefill()'s check
        if wrong is not None:
            errors.append(LineError(rec.line, rec.id, wrong))
            continue
        if how.max_tokens is not None and len(tokens) > how.max_tokens:
            errors.append(LineError(
                rec.line, rec.id,
                f"the prompt is {len(tokens):,} tokens, longer than the model's context of {how.max_tokens:,}; "
                "shorten it, or allow long prompts (--allow-long-prompt)",
            ))
            continue
        key = tuple(tokens)
        if key in seen:
            log.info("promptstore: warm-up line %d repeats line %d; skipped", rec.line, seen[key])
            skipped += 1
            continue
        seen[key] = rec.line
        if store.exists(model_id, tokens):
            skipped += 1
            continue
        cuts: Dict[int, Dict[str, Any]] = {}
        if checkpoints:
            if every > 0:
                for n in range(every, len(tokens), every):
                    cuts[n] = {"checkpoint": f"every {every}"}
            if msgs is None and how.system_prompt is not None:  # templated as these two turns
                msgs = [{"role": "system", "content": how.system_prompt}, {"role": "user", "content": rec.prompt}]
            if msgs is not None and chat_template:
                for n in message_boundaries(tokenizer, msgs, tokens):
                    cuts[n] = {"checkpoint": "boundary"}
        meta = dict(rec.meta or {})
        meta["warmup"] = str(rec.id) if rec.id is not None else f"line {rec.line}"
        plans.append(_Plan(rec, tokens, cuts, meta, tuple(sorted(cuts))))
    # A checkpoint equal to another prompt is that prompt's entry; a checkpoint
    # shared by several prompts is stored once (by the first in length order),
    # and one already in the store is not stored again.
    plans.sort(key=lambda p: len(p.tokens))
    claimed = set(seen)
    for p in plans:
        for n in sorted(p.cuts):
            key = tuple(p.tokens[:n])
            if key in claimed or store.exists(model_id, p.tokens[:n]):
                del p.cuts[n]
            else:
                claimed.add(key)
    return plans, skipped


def warmup(
    store,
    model_dir: Union[str, os.PathLike],
    prompts: Union[str, os.PathLike, Iterable[Dict[str, Any]]],
    *,
    batch_size: int = 8,
    checkpoint_every: int = 2048,
    checkpoints: Optional[bool] = None,
    chat_template: bool = True,
    progress: Optional[Progress] = None,
    check_batching: bool = True,
    step: int = PREFILL_STEP,
    loaded: Optional[Tuple[Any, Any]] = None,
    model_id: Optional[str] = None,
    options: Optional[CacheOptions] = None,
    system_prompt: Optional[str] = None,
    max_tokens: Optional[int] = None,
) -> WarmupSummary:
    """Prefill every prompt of a JSONL file (or iterable of records) and store its cache.

    Args:
        store: an open PromptStore.
        model_dir: the mlx-lm model directory (its fingerprint keys the entries).
        prompts: a JSONL path, or an iterable of ``{"id", "prompt"|"messages"}`` dicts.
        batch_size: rows per batched prefill (1: one prompt at a time).
        checkpoint_every: for untrimmable caches, also store a checkpoint every
            N tokens (0: only at message boundaries).
        checkpoints: store checkpoints; None decides by the model's cache
            (on when any layer is not a plain KV cache).
        chat_template: template prompts as ``promptstore put`` does.
        progress: called as ``progress(prompts_done, prompts_total, tokens, seconds)``.
        check_batching: compare the first batch against a serial prefill of
            its most padded row and fall back to serial prefill if any bit differs.
        step: prefill chunk length (unless ``options`` are given).
        loaded: ``(model, tokenizer)`` already loaded from ``model_dir``.
        model_id: the identity to store under; default ``fingerprint(model_dir)``
            (the CLI passes the identity of the model with its adapter).
        options: mlx-lm's cache options (``max_kv_size``, ``kv_bits``...,
            ``step``), as ``promptstore put`` takes them; quantized caches
            are prefilled one prompt at a time.
        system_prompt: a system message before each ``prompt`` line (as
            ``mlx_lm.generate --system-prompt``); a ``messages`` line with it
            is a line error (put the system message in the messages).
        max_tokens: the longest prompt allowed (the model's context); a
            longer one is a line error. None: any length.

    Returns:
        A WarmupSummary; ``summary.errors`` lists each failed line.

    Raises:
        InvalidInput: bad arguments, an unreadable prompt file or model directory.
        StoreError: the store failed as a whole (a full store ends the job
            with ``summary.stopped`` set instead).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInput(f"batch_size must be a positive integer, not {batch_size!r}")
    if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise InvalidInput(f"checkpoint_every must be 0 or a positive integer, not {checkpoint_every!r}")
    started = time.perf_counter()
    records, errors = read_prompts(prompts)
    n_bad_lines = len(errors)
    model, tokenizer = loaded if loaded is not None else load_model(str(model_dir))
    model_id = model_id if model_id is not None else fingerprint(model_dir)
    options = options if options is not None else CacheOptions(step=step)
    if checkpoints is None:
        checkpoints = needs_checkpoints(model, options=options)
    how = _Templating(chat_template, system_prompt, max_tokens, vocab_size(model))
    plans, skipped = _plan(records, tokenizer, store, model_id, how, checkpoints, checkpoint_every, errors)
    batched = batch_size > 1 and _batchable(model, options)
    note = None
    if batch_size > 1 and not batched:
        note = (
            "quantized KV caches (kv_bits) are prefilled one prompt at a time"
            if options.kv_bits is not None
            else "this model's cache types cannot be batched here; prefilled one prompt at a time"
        )
    job = _Job(store, model, model_id, batch_size, options, progress, len(plans))
    # Blocks end at the store's block size and at every checkpoint: the shortest a manifest may name.
    job.cut = min(getattr(store, "block_tokens", BLOCK_TOKENS), checkpoint_every or BLOCK_TOKENS)
    stopped = None
    size = batch_size if batched else 1
    groups = [plans[i : i + size] for i in range(0, len(plans), size)]
    gi = 0
    while gi < len(groups):
        group = groups[gi]
        try:
            if batched and check_batching and len(group) > 1:
                check_batching = False
                if not _probe(job, group):
                    batched = False
                    note = "batched prefill was not bit-identical to serial prefill on this device; prefilled one prompt at a time"
                    log.warning("promptstore: %s", note)
                    rest = [p for g in groups[gi:] for p in g]
                    groups[gi:] = [[p] for p in rest]
                    continue
                job._tick(prompts=len(group))
            else:
                job.run(group, batched)
                job._tick(prompts=len(group))
        except StoreFull as err:
            stopped = f"store full: {err}"
            break
        except _BudgetReached as err:  # past it, the store would evict what the job just warmed
            stopped = str(err)
            break
        except PromptStoreError as err:
            if len(group) > 1:  # find the row at fault: the rest one at a time (those stored stay stored and counted)
                left = [p for p in group if not store.exists(model_id, p.tokens)]
                groups[gi : gi + 1] = [[p] for p in left]
                job._tick(prompts=len(group) - len(left))
                continue
            for p in group:
                errors.append(LineError(p.record.line, p.record.id, f"{type(err).__name__}: {err}"))
            job._tick(prompts=len(group))
        gi += 1
        if job.over_budget() and gi < len(groups):
            stopped = f"the job wrote {job.bytes} bytes, the store's byte budget; run it again after `promptstore gc`, or raise the budget"
            break
    errors.sort(key=lambda e: e.line)
    return WarmupSummary(
        prompts=len(records) + n_bad_lines,
        stored=job.stored,
        skipped=skipped,
        failed=len(errors),
        checkpoints=job.checkpoints,
        tokens=job.tokens,
        bytes=job.bytes,
        seconds=time.perf_counter() - started,
        batch_size=batch_size,
        batched=batched,
        errors=tuple(errors),
        stopped=stopped,
        note=note,
    )


def _probe(job: _Job, group: List[_Plan]) -> bool:
    """Run ``group`` batched and its most padded row serially; store the batch
    only when every entry of that row is bit-identical. Returns that verdict."""
    before = job.tokens
    batched: List = []
    job.run(group, True, sink=batched)
    after_batch = job.tokens
    serial: List = []
    job.run([group[0]], False, sink=serial)
    job.tokens = after_batch  # the probe's serial tokens are not the job's work
    mine = [e for e in batched if e[0] == 0]
    if len(mine) != len(serial) or not all(a[1] == b[1] and _same_entry(a[3], b[3]) for a, b in zip(mine, serial)):
        job.tokens = before  # the group is prefilled (and counted) again, one prompt at a time
        return False
    for _, tokens, cache, _, meta, final in batched:
        job.put(tokens, cache, meta, final)
    return True
