"""``promptstore put``: prefill a prompt on a model and store its cache."""

from __future__ import annotations

import sys

import click

from promptstore import InvalidInput
from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, store_option
from promptstore.cli._model import check_length, load, model_options
from promptstore.cli._prompt import encode, prompt_options, read_prompt
from promptstore.format._entry import check_meta
from promptstore.identity import model_dir
from promptstore.jobs.checkpoints import message_boundaries, needs_checkpoints, prefill_with_checkpoints


def parse_meta(pairs) -> dict:
    """``--meta K=V`` pairs as the entry's meta, checked as every put checks it.

    Raises:
        click.BadParameter: not KEY=VALUE, or a pair the store would refuse.
    """
    meta = {}
    for pair in pairs:
        if "=" not in pair or not pair.split("=", 1)[0]:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--meta")
        k, v = pair.split("=", 1)
        meta[k] = v
    try:
        check_meta(meta)  # e.g. bytes that are not UTF-8: refused before any prefill
    except InvalidInput as err:
        raise click.BadParameter(str(err), param_hint="--meta") from err
    return meta


def progress_bar(total: int):
    """A prefill progress bar on stderr (tokens, tokens/s); returns (bar, callback)."""
    bar = click.progressbar(length=total, label="prefill", file=sys.stderr, show_pos=True)
    tty = sys.stderr.isatty()

    def progress(done, _total, secs):
        if tty:  # elsewhere click prints the label on every change: one line per update
            bar.label = f"prefill {done / max(secs, 1e-9):,.0f} tok/s"
        bar.update(done - bar.pos)

    return bar, progress


@command()
@model_options()
@prompt_options
@click.option("--meta", "meta_pairs", multiple=True, metavar="KEY=VALUE", help="User metadata to store (repeatable).")
@click.option(
    "--checkpoints/--no-checkpoints",
    default=True,
    show_default=True,
    help="With --messages on a model whose cache cannot be trimmed (hybrid, sliding window): "
    "also store the cache at the end of the system message and of each user turn.",
)
@store_option
@json_option
@click.pass_obj
@guarded
def put(obj, margs, pargs, meta_pairs, checkpoints, as_json):
    """Prefill a prompt on MODEL and store its prompt cache.

    The chat template is applied as mlx_lm.cache_prompt does (one open user
    turn, after --system-prompt), unless --ignore-chat-template. A prompt
    longer than the model's context is refused before prefill.
    """
    meta = parse_meta(meta_pairs)
    text, messages = read_prompt(pargs)
    model_dir(margs.model)  # a missing model creates no store
    store = obj.store  # a store this user cannot write fails here, before any prefill
    loaded = load(margs)
    tokens = encode(loaded.tokenizer, text, messages, pargs)
    check_length(loaded, len(tokens), margs)
    boundaries = []
    if checkpoints and messages is not None and needs_checkpoints(loaded.model, len(tokens), margs.cache):
        boundaries = message_boundaries(loaded.tokenizer, messages, tokens)
    bar, progress = progress_bar(len(tokens))
    with bar:
        info, stored = prefill_with_checkpoints(
            store, loaded.identity, loaded.model, tokens, boundaries, meta=meta, progress=progress, options=margs.cache
        )
    if as_json:
        doc = info_json(info)
        doc["checkpoints"] = [info_json(c) for c in stored]
        emit_json(doc)
        return
    kinds = ",".join(sorted(set(info.kinds)))
    click.echo(f"stored {info.id}: {info.n_tokens} tokens, {format_size(info.nbytes)} ({kinds})")
    for c in stored:
        click.echo(f"  checkpoint {c.id}: {c.n_tokens} tokens, {format_size(c.nbytes)}")
