"""``promptstore put``: prefill a prompt on a model and store its cache."""

from __future__ import annotations

import sys

import click

from promptstore import fingerprint
from promptstore.jobs.checkpoints import message_boundaries, needs_checkpoints, prefill_with_checkpoints
from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, model_option
from promptstore.cli._prompt import prompt_options, read_prompt
from promptstore.jobs.prefill import encode_prompt, load_model


def parse_meta(pairs) -> dict:
    meta = {}
    for pair in pairs:
        if "=" not in pair or not pair.split("=", 1)[0]:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--meta")
        k, v = pair.split("=", 1)
        meta[k] = v
    return meta


def progress_bar(total: int):
    """A prefill progress bar on stderr (tokens, tokens/s); returns (bar, callback)."""
    bar = click.progressbar(length=total, label="prefill", file=sys.stderr, show_pos=True)

    def progress(done, _total, secs):
        bar.label = f"prefill {done / max(secs, 1e-9):,.0f} tok/s"
        bar.update(done - bar.pos)

    return bar, progress


@command()
@model_option()
@prompt_options
@click.option("--meta", "meta_pairs", multiple=True, metavar="KEY=VALUE", help="User metadata to store (repeatable).")
@click.option(
    "--checkpoints/--no-checkpoints",
    default=True,
    show_default=True,
    help="With --messages on a model whose cache cannot be trimmed (hybrid, sliding window): "
    "also store the cache at the end of the system message and of each user turn.",
)
@json_option
@click.pass_obj
@guarded
def put(obj, model_dir, prompt, prompt_file, messages_file, no_chat_template, meta_pairs, checkpoints, as_json):
    """Prefill a prompt on MODEL and store its prompt cache.

    The chat template is applied as mlx_lm.cache_prompt does (one open user
    turn), unless --no-chat-template.
    """
    meta = parse_meta(meta_pairs)
    text, messages = read_prompt(prompt, prompt_file, messages_file)
    model, tokenizer = load_model(model_dir)
    tokens = encode_prompt(tokenizer, text, messages, chat_template=not no_chat_template)
    if not tokens:
        raise click.UsageError("the prompt encodes to no tokens")
    fp = fingerprint(model_dir)
    boundaries = []
    if checkpoints and messages is not None and needs_checkpoints(model, len(tokens)):
        boundaries = message_boundaries(tokenizer, messages, tokens)
    bar, progress = progress_bar(len(tokens))
    with bar:
        info, stored = prefill_with_checkpoints(obj.store, fp, model, tokens, boundaries, meta=meta, progress=progress)
    if as_json:
        doc = info_json(info)
        doc["checkpoints"] = [info_json(c) for c in stored]
        emit_json(doc)
        return
    kinds = ",".join(sorted(set(info.kinds)))
    click.echo(f"stored {info.id}: {info.n_tokens} tokens, {format_size(info.nbytes)} ({kinds})")
    for c in stored:
        click.echo(f"  checkpoint {c.id}: {c.n_tokens} tokens, {format_size(c.nbytes)}")
