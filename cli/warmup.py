"""``promptstore warmup``: pre-compute the prompt caches of a JSONL prompt file."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

import click

from promptstore import warmup as run_warmup
from promptstore.cli._common import command, emit_json, format_size, guarded, json_option, store_option
from promptstore.cli._model import load, model_options
from promptstore.cli._prompt import templating_options
from promptstore.identity import context_length, model_dir

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar


class _Bar:
    """A click progress bar on stderr, made once the number of prompts is known."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.bar: Optional[ProgressBar[int]] = None

    def __call__(self, done: int, total: int, tokens: int, secs: float) -> None:
        if not self.enabled or total == 0:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label="warmup", show_eta=True, show_pos=True, file=sys.stderr)
            self.bar.__enter__()
        if self.tty:  # elsewhere click prints the label on every change
            self.bar.label = f"warmup {tokens / max(secs, 1e-9):.0f} tok/s"
        self.bar.update(done - self.bar.pos)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@command()
@model_options()
@templating_options
@click.argument("prompts_file", metavar="PROMPTS.jsonl", type=click.Path(dir_okay=False, exists=True))
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1), help="Prompts prefilled together.")
@click.option(
    "--checkpoint-every",
    default=2048,
    show_default=True,
    type=click.IntRange(min=0),
    help="For caches that cannot be trimmed (hybrid models), also store a checkpoint every N tokens; 0: message boundaries only.",
)
@store_option
@json_option
@click.pass_obj
@guarded
def warmup(obj, margs, system_prompt, no_chat_template, prompts_file, batch_size, checkpoint_every, as_json):
    """Prefill every prompt of PROMPTS.jsonl on MODEL and store its cache.

    Each line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}.
    Prompts already stored are skipped, so re-running a job that stopped
    continues where it stopped. A bad line is reported with its line number;
    the job goes on and exits 1 at the end. Prompts are templated as
    `promptstore put` templates them (--system-prompt goes before each
    "prompt" line; a "messages" line carries its own), with mlx-lm's cache
    flags as put takes them; a prompt longer than the model's context is a
    line error unless --allow-long-prompt.
    """
    model_dir(margs.model)  # a missing model creates no store
    store = obj.store  # a store this user cannot write fails here, before the model loads
    loaded = load(margs)
    bar = _Bar(True)  # stderr: --json keeps stdout for the summary alone
    try:
        summary = run_warmup(
            store,
            loaded.path,
            prompts_file,
            batch_size=batch_size,
            checkpoint_every=checkpoint_every,
            chat_template=not no_chat_template,
            progress=bar,
            loaded=(loaded.model, loaded.tokenizer),
            model_id=loaded.identity,
            options=margs.cache,
            system_prompt=system_prompt,
            max_tokens=None if margs.allow_long_prompt else context_length(loaded.config),
        )
    finally:
        bar.close()
    for err in summary.errors:
        who = f" ({err.id})" if err.id is not None else ""
        click.echo(f"{prompts_file}:{err.line}{who}: {err.reason}", err=True)
    if summary.note:
        click.echo(f"note: {summary.note}", err=True)
    if summary.stopped:
        click.echo(f"stopped: {summary.stopped}", err=True)
    if as_json:
        emit_json(summary_json(summary))
    else:
        rate = summary.tokens / summary.seconds if summary.seconds > 0 else 0.0
        click.echo(
            f"{summary.prompts} prompts: {summary.stored} stored, {summary.skipped} skipped, {summary.failed} failed; "
            f"{summary.checkpoints} checkpoints; {format_size(summary.bytes)} in {summary.seconds:.1f} s ({rate:.0f} tok/s)"
        )
    if not summary.ok:
        sys.exit(1)


def summary_json(summary) -> dict:
    """The --json document of a WarmupSummary: raw integers, seconds as a float."""
    return {
        "prompts": summary.prompts,
        "stored": summary.stored,
        "skipped": summary.skipped,
        "failed": summary.failed,
        "checkpoints": summary.checkpoints,
        "tokens": summary.tokens,
        "bytes": summary.bytes,
        "seconds": summary.seconds,
        "batch_size": summary.batch_size,
        "batched": summary.batched,
        "stopped": summary.stopped,
        "note": summary.note,
        "errors": [{"line": e.line, "id": e.id, "reason": e.reason} for e in summary.errors],
    }
