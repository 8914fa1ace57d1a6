"""``promptstore get``: longest-prefix lookup of a prompt; ``-o`` writes an mlx-lm prompt-cache file."""

from __future__ import annotations

from typing import Optional

import click

from promptstore.cli._common import check_output, command, emit_json, guarded, info_json, json_option, store_option
from promptstore.cli._model import best_lookup, check_length, load, model_options
from promptstore.cli._prompt import prompt_options, prompt_tokens
from promptstore.cli.put import progress_bar
from promptstore.jobs.interop import check_cache_file_name, file_metadata_of, write_mlx_cache_file
from promptstore.errors import InvalidInput
from promptstore.jobs.prefill import make_cache, prefill

# A match shorter than this share of the prompt (the chat template's opening,
# say) is reported as a partial hit, not a hit.
_PARTIAL = 0.5


@command()
@model_options()
@prompt_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write an mlx-lm prompt-cache file (.safetensors) covering the whole prompt, for "
    "`mlx_lm.generate --prompt-cache-file`; tokens the store lacks are prefilled.",
)
@store_option
@json_option
@click.pass_obj
@guarded
def get(obj, margs, pargs, output, as_json):
    """Find the longest stored prefix of a prompt on MODEL.

    Reports the tokens matched and the tokens left to prefill. With -o, the
    rest is prefilled and the cache of the whole prompt is written in
    mlx-lm's prompt-cache format; pass the same --model string to
    mlx_lm.generate (it refuses another). A store that does not exist yet
    is a miss, unless a shared tier is set (--remote, PROMPTSTORE_REMOTE):
    then the store is created to hold what the remote gives. One this user
    may only read is read without recording use.
    """
    if output is not None:
        try:
            check_cache_file_name(output)
        except InvalidInput as err:
            raise click.BadParameter(str(err), param_hint="-o") from err
        output = check_output(output)
    loaded = load(margs)
    tokens = prompt_tokens(loaded.tokenizer, pargs)
    if output is not None:
        check_length(loaded, len(tokens), margs)
    store = obj.reader_or_none(counted=True)
    if store is None and obj.remote:  # no local store yet: the remote may hold it, and the store keeps what it gives
        store = obj.store
    hit = best_lookup(store, loaded, tokens) if store is not None else None
    other = _other_layout(hit.cache, margs.cache) if hit is not None and output is not None else None
    if other is not None:  # mlx_lm.generate would refuse the file: prefill afresh with the flags given
        click.echo(f"entry {hit.info.id} holds {other}, not what --kv-bits/--kv-group-size ask for: not used", err=True)
        hit = None
    matched = hit.matched if hit else 0
    if output is not None:
        cache = hit.cache if hit else make_cache(loaded.model, margs.cache)
        rest = tokens[matched:]
        if rest:
            bar, progress = progress_bar(len(rest))
            with bar:
                cache = prefill(loaded.model, rest, cache=cache, progress=progress, options=margs.cache)
        # an imported entry's file metadata (tokenizer_config: mlx-lm's EOS token; user keys) goes back out, as export writes it
        write_mlx_cache_file(output, cache, loaded.spec, tokens=tokens, fingerprint=loaded.identity,
                             file_metadata=file_metadata_of(hit.info.meta) if hit else None)
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
        word = "hit" if matched >= _PARTIAL * len(tokens) else "partial hit"
        share = f" ({100 * matched / len(tokens):.1f}%)" if matched < len(tokens) else ""
        click.echo(f"{word} {hit.info.id}: {matched} of {len(tokens)} tokens{share}{trimmed}; {len(tokens) - matched} to prefill")
    if output is not None:
        click.echo(f"wrote {output}: {len(tokens)} tokens ({len(tokens) - matched} prefilled); "
                   f"use: mlx_lm.generate --model {loaded.spec} --prompt-cache-file {output} --prompt ...")


def _other_layout(cache, options) -> Optional[str]:
    """What a hit holds when its quantized layers differ from ``--kv-bits``
    and ``--kv-group-size`` (given), which ``mlx_lm.generate`` then refuses
    in the file; None when they agree, or no bits were asked for."""
    if options.kv_bits is None:
        return None
    for layer in cache:
        bits, group = getattr(layer, "bits", None), getattr(layer, "group_size", None)
        if bits is not None and (bits, group) != (options.kv_bits, options.kv_group_size):
            return f"{bits}-bit KV in groups of {group}"
    return None
