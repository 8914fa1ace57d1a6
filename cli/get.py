"""``promptstore get``: longest-prefix lookup of a prompt."""

from __future__ import annotations

import click

from promptstore import fingerprint
from promptstore.cli._common import emit_json, guarded, info_json, json_option
from promptstore.cli._prompt import prompt_options, prompt_tokens
from promptstore.prefill import load_model


@click.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False), help="mlx-lm model directory.")
@prompt_options
@json_option
@click.pass_obj
@guarded
def get(obj, model_dir, prompt, prompt_file, messages_file, no_chat_template, as_json):
    """Find the longest stored prefix of a prompt on MODEL."""
    _, tokenizer = load_model(model_dir)
    tokens = prompt_tokens(tokenizer, prompt, prompt_file, messages_file, no_chat_template)
    hit = obj.store.lookup(fingerprint(model_dir), tokens)
    matched = hit.matched if hit else 0
    if as_json:
        emit_json({
            "tokens": len(tokens),
            "matched": matched,
            "to_prefill": len(tokens) - matched,
            "trimmed": hit.trimmed if hit else 0,
            "entry": info_json(hit.info) if hit else None,
        })
    elif hit is None:
        click.echo(f"miss: 0 of {len(tokens)} tokens stored; {len(tokens)} to prefill")
    else:
        trimmed = f" (trimmed {hit.trimmed} from a longer entry)" if hit.trimmed else ""
        click.echo(f"hit {hit.info.id}: {matched} of {len(tokens)} tokens{trimmed}; {len(tokens) - matched} to prefill")
