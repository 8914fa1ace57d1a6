"""``promptstore export``: write a stored entry as an mlx-lm prompt-cache file."""

from __future__ import annotations

import click

from promptstore import fingerprint
from promptstore.cli._common import command, emit_json, format_size, guarded, info_json, json_option, warn
from promptstore.jobs.interop import export_entry


@command()
@click.argument("key")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True), help="The .safetensors file to write.")
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(file_okay=False, exists=True),
    help="The entry's model directory: checked against the entry, and recorded in the file "
    "(mlx_lm.generate refuses any other --model).",
)
@json_option
@click.pass_obj
@guarded
def export(obj, key, output, model_dir, as_json):
    """Write entry KEY (an id or unique prefix) as an mlx-lm prompt-cache file
    that `mlx_lm.generate --prompt-cache-file` reads."""
    if not output.endswith(".safetensors"):
        raise click.BadParameter("the file must end in .safetensors (mlx-lm appends it otherwise)", param_hint="-o")
    fp = fingerprint(model_dir) if model_dir else None
    info, tokens = export_entry(obj.store, key, output, model_path=model_dir, model=fp)
    if model_dir is None:
        warn(f"the file records the model as {info.model_name!r}; mlx_lm.generate loads that name and refuses any "
             "other --model: pass --model DIR to record the model directory")
    if as_json:
        doc = {"output": output, "tokens": len(tokens), "entry": info_json(info), "model": model_dir or info.model_name}
        emit_json(doc)
        return
    click.echo(f"wrote {output}: entry {info.id}, {len(tokens)} tokens, {format_size(info.nbytes)} of cache")
