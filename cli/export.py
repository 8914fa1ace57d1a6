"""``promptstore export``: write a stored entry as an mlx-lm prompt-cache file."""

from __future__ import annotations

import click

from promptstore import InvalidInput, ModelMismatch
from promptstore.cli._common import check_output, command, emit_json, format_size, guarded, info_json, json_option, store_option
from promptstore.cli._model import MODEL_HELP, identities
from promptstore.jobs.interop import check_cache_file_name, export_entry


@command()
@click.argument("key")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True), help="The .safetensors file to write.")
@click.option(
    "--model",
    "model_dir",
    required=True,
    metavar="DIR|ORG/NAME",
    help=MODEL_HELP + " Checked against the entry and recorded in the file: mlx_lm.generate loads "
    "the model the file names, and refuses any other --model.",
)
@click.option(
    "--adapter-path",
    default=None,
    type=click.Path(file_okay=False, exists=True),
    help="The mlx-lm adapter folder (LoRA) the entry was stored with (put/import/warmup --adapter-path).",
)
@store_option
@json_option
@click.pass_obj
@guarded
def export(obj, key, output, model_dir, adapter_path, as_json):
    """Write entry KEY (an id or unique prefix) as an mlx-lm prompt-cache file
    that `mlx_lm.generate --prompt-cache-file` reads (an adapter's entry:
    give its --adapter-path here and to mlx_lm.generate)."""
    try:
        check_cache_file_name(output)
    except InvalidInput as err:
        raise click.BadParameter(str(err), param_hint="-o") from err
    output = check_output(output)
    ids = identities(model_dir, adapter_path)
    store = obj.local_only().reader()
    entry = store.info(key)  # EntryNotFound names the key
    if entry.model not in ids:
        adapted = "+adapter@" in entry.model
        hint = ("it was stored with an adapter: pass that --adapter-path" if adapted and adapter_path is None
                else "pass the --model it was stored with" + (" and no --adapter-path" if adapter_path is not None and not adapted else ""))
        raise ModelMismatch(f"entry {entry.id} belongs to model {entry.model!r}, not {ids[0]!r} ({model_dir}); {hint}")
    info, tokens = export_entry(store, entry.id, output, model_path=model_dir, model=entry.model)
    if as_json:
        emit_json({"output": output, "tokens": len(tokens), "entry": info_json(info), "model": model_dir})
        return
    click.echo(f"wrote {output}: entry {info.id}, {len(tokens)} tokens, {format_size(info.nbytes)} of cache")
