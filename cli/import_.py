"""``promptstore import``: store the cache of an mlx-lm prompt-cache file."""

from __future__ import annotations

import click

from promptstore import fingerprint
from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, model_option
from promptstore.cli._prompt import prompt_options, read_prompt
from promptstore.cli.put import parse_meta
from promptstore.jobs.interop import import_mlx_cache_file
from promptstore.jobs.prefill import encode_prompt, load_model


@command("import")
@model_option()
@prompt_options
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--meta", "meta_pairs", multiple=True, metavar="KEY=VALUE", help="User metadata to store (repeatable).")
@json_option
@click.pass_obj
@guarded
def import_(obj, model_dir, prompt, prompt_file, messages_file, no_chat_template, file, meta_pairs, as_json):
    """Store FILE, an mlx-lm prompt-cache file (mlx_lm.cache_prompt), under MODEL.

    mlx-lm files carry no token ids: give the prompt the file was made from
    (templated as mlx_lm.cache_prompt does). The file's coverage must match
    the prompt's tokens exactly, or nothing is stored. Files written by
    `promptstore get -o` / `export` record their tokens; for them the prompt
    may be left out.
    """
    meta = parse_meta(meta_pairs)
    given = any(x is not None for x in (prompt, prompt_file, messages_file))
    text, messages = read_prompt(prompt, prompt_file, messages_file) if given else (None, None)
    model, tokenizer = load_model(model_dir)
    tokens = encode_prompt(tokenizer, text, messages, chat_template=not no_chat_template) if given else None
    info = import_mlx_cache_file(obj.store, fingerprint(model_dir), file, tokens=tokens, model=model, meta=meta)
    if as_json:
        emit_json(info_json(info))
        return
    click.echo(f"imported {info.id}: {info.n_tokens} tokens, {format_size(info.nbytes)} ({','.join(sorted(set(info.kinds)))})")
