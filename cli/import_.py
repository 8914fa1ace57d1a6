"""``promptstore import``: store the cache of an mlx-lm prompt-cache file."""

from __future__ import annotations

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, store_option
from promptstore.cli._model import load, model_options
from promptstore.cli._prompt import encode, prompt_options, read_prompt
from promptstore.cli.put import parse_meta
from promptstore.identity import model_dir
from promptstore.jobs.interop import import_mlx_cache_file


@command("import")
@model_options(cache=False)
@prompt_options
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--meta", "meta_pairs", multiple=True, metavar="KEY=VALUE", help="User metadata to store (repeatable).")
@click.option(
    "--trust-unverified",
    is_flag=True,
    help="Store the file even when its end cannot be checked against the prompt (a hybrid model's "
    "file of more than the first few tokens): you vouch that it was made from exactly this prompt.",
)
@store_option
@json_option
@click.pass_obj
@guarded
def import_(obj, margs, pargs, file, meta_pairs, trust_unverified, as_json):
    """Store FILE, an mlx-lm prompt-cache file (mlx_lm.cache_prompt), under MODEL.

    mlx-lm files carry no token ids: give the prompt the file was made from
    (templated as mlx_lm.cache_prompt does). The file's coverage must match
    the prompt's tokens exactly, and what its layers hold is checked
    against those tokens (the last tokens in every layer, the first ones in
    every layer that still holds them), or nothing is stored. A file whose
    end cannot be checked (a hybrid model's) is refused unless
    --trust-unverified. Files written by `promptstore get -o` / `export`
    record their tokens; for them the prompt may be left out. The file's
    metadata (tokenizer_config, other keys) is kept with the entry, and
    `export` writes it back.
    """
    meta = parse_meta(meta_pairs)
    text, messages = read_prompt(pargs) if pargs.given else (None, None)
    model_dir(margs.model)  # a missing model creates no store
    store = obj.store  # a store this user cannot write fails here, before the model loads
    loaded = load(margs)
    tokens = encode(loaded.tokenizer, text, messages, pargs) if pargs.given else None
    info = import_mlx_cache_file(
        store, loaded.identity, file, tokens=tokens, model=loaded.model, meta=meta, trust_unverified=trust_unverified,
        also=[loaded.legacy] if loaded.legacy else [],
    )
    if as_json:
        emit_json(info_json(info))
        return
    click.echo(f"imported {info.id}: {info.n_tokens} tokens, {format_size(info.nbytes)} ({','.join(sorted(set(info.kinds)))})")
