"""``promptstore put``: prefill a prompt on a model and store its cache."""

from __future__ import annotations

import click

from promptstore import fingerprint
from promptstore.cli._common import emit_json, format_size, guarded, info_json, json_option
from promptstore.cli._prompt import prompt_options, prompt_tokens
from promptstore.prefill import load_model, prefill


def parse_meta(pairs) -> dict:
    meta = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--meta")
        k, v = pair.split("=", 1)
        meta[k] = v
    return meta


@click.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False), help="mlx-lm model directory.")
@prompt_options
@click.option("--meta", "meta_pairs", multiple=True, metavar="KEY=VALUE", help="User metadata to store (repeatable).")
@json_option
@click.pass_obj
@guarded
def put(obj, model_dir, prompt, prompt_file, messages_file, no_chat_template, meta_pairs, as_json):
    """Prefill a prompt on MODEL and store its prompt cache."""
    meta = parse_meta(meta_pairs)
    model, tokenizer = load_model(model_dir)
    tokens = prompt_tokens(tokenizer, prompt, prompt_file, messages_file, no_chat_template)
    if not tokens:
        raise click.UsageError("the prompt encodes to no tokens")
    with click.progressbar(length=len(tokens), label="prefill", file=click.get_text_stream("stderr")) as bar:
        def progress(done, total, secs):
            bar.update(done - bar.pos)
            bar.label = f"prefill {done / max(secs, 1e-9):.0f} tok/s"

        cache = prefill(model, tokens, progress=progress)
    info = obj.store.put(fingerprint(model_dir), tokens, cache, meta=meta)
    if as_json:
        emit_json(info_json(info))
    else:
        click.echo(f"stored {info.id}: {info.n_tokens} tokens, {format_size(info.nbytes)} ({','.join(sorted(set(info.kinds)))})")
