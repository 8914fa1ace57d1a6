"""``promptstore get``: longest-prefix lookup of a prompt; ``-o`` writes an mlx-lm prompt-cache file."""

from __future__ import annotations

import click

from promptstore import fingerprint
from promptstore.cli._common import command, emit_json, guarded, info_json, json_option, model_option
from promptstore.cli._prompt import prompt_options, prompt_tokens
from promptstore.cli.put import progress_bar
from promptstore.jobs.interop import write_mlx_cache_file
from promptstore.jobs.prefill import load_model, make_cache, prefill


@command()
@model_option()
@prompt_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write an mlx-lm prompt-cache file (.safetensors) covering the whole prompt, for "
    "`mlx_lm.generate --prompt-cache-file`; tokens the store lacks are prefilled.",
)
@json_option
@click.pass_obj
@guarded
def get(obj, model_dir, prompt, prompt_file, messages_file, no_chat_template, output, as_json):
    """Find the longest stored prefix of a prompt on MODEL.

    Reports the tokens matched and the tokens left to prefill. With -o, the
    rest is prefilled and the cache of the whole prompt is written in
    mlx-lm's prompt-cache format; pass the same --model string to
    mlx_lm.generate (it refuses another).
    """
    if output is not None and not output.endswith(".safetensors"):
        raise click.BadParameter("the file must end in .safetensors (mlx-lm appends it otherwise)", param_hint="-o")
    model, tokenizer = load_model(model_dir)
    tokens = prompt_tokens(tokenizer, prompt, prompt_file, messages_file, no_chat_template)
    if not tokens:
        raise click.UsageError("the prompt encodes to no tokens")
    fp = fingerprint(model_dir)
    hit = obj.store.lookup(fp, tokens)
    matched = hit.matched if hit else 0
    if output is not None:
        cache = hit.cache if hit else make_cache(model)
        rest = tokens[matched:]
        if rest:
            bar, progress = progress_bar(len(rest))
            with bar:
                prefill(model, rest, cache=cache, progress=progress)
        write_mlx_cache_file(output, cache, model_dir, tokens=tokens, fingerprint=fp)
    if as_json:
        emit_json({
            "tokens": len(tokens),
            "matched": matched,
            "to_prefill": len(tokens) - matched,
            "trimmed": hit.trimmed if hit else 0,
            "entry": info_json(hit.info) if hit else None,
            "output": output,
        })
        return
    if hit is None:
        click.echo(f"miss: 0 of {len(tokens)} tokens stored; {len(tokens)} to prefill")
    else:
        trimmed = f" (trimmed {hit.trimmed} from a longer entry)" if hit.trimmed else ""
        click.echo(f"hit {hit.info.id}: {matched} of {len(tokens)} tokens{trimmed}; {len(tokens) - matched} to prefill")
    if output is not None:
        click.echo(f"wrote {output}: {len(tokens)} tokens ({len(tokens) - matched} prefilled); "
                   f"use: mlx_lm.generate --model {model_dir} --prompt-cache-file {output} --prompt ...")
