"""``promptstore serve``: mlx-lm's HTTP server with a persistent prompt cache."""

from __future__ import annotations

from pathlib import Path

import click

from promptstore.cli._common import command, emit_json, guarded, json_option, model_option, store_option
from promptstore.cli._model import MODEL_HELP, model_folder
from promptstore.errors import InvalidInput
from promptstore.jobs.prefill import check_tokenizer
from promptstore.serving import DEFAULT_CHECKPOINTS
from promptstore.serving._server import check_server_args
from promptstore.serving._server import serve as run_server


@command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@model_option(help=MODEL_HELP)
@click.option(
    "--checkpoints",
    type=click.IntRange(min=0),
    default=DEFAULT_CHECKPOINTS,
    show_default=True,
    metavar="K",
    help="Checkpoints kept per conversation of a model whose cache cannot be trimmed (hybrid): "
    "the K latest plus the system prompt's; superseded ones are deleted. 0 keeps all.",
)
@click.option(
    "--draft-model",
    "draft_dir",
    default=None,
    metavar="DIR|ORG/NAME",
    help="A draft model, folder or Hugging Face id in the local cache (same tokenizer): speculative decoding, hybrid models included. "
    "Requests are then served one at a time, as mlx_lm.server does with a draft.",
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Tokens drafted per verify round (mlx_lm.server's default: 3).",
)
@store_option
@json_option
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
@guarded
def serve(obj, model_dir, checkpoints, draft_dir, num_draft_tokens, as_json, server_args):
    """Run mlx_lm.server on MODEL with its prompt cache kept in the store.

    Every cache the server makes is also written to the store in the
    background; lookups fall back to the store, so a restarted server (or
    `promptstore get --model MODEL`) finds the caches again. Further options
    go to mlx_lm.server (e.g. --port 8080 --prompt-cache-size 10; see
    `mlx_lm.server --help`). SIGTERM or Ctrl-C stops the server after the
    pending writes are committed; with --json their counters are printed then.

    With --draft-model, requests run speculatively: the draft proposes
    --num-draft-tokens tokens, the model verifies them in one forward. Hybrid
    (gated-DeltaNet) layers take verify rounds instead of trim, which
    mlx_lm.server alone refuses; sliding windows drop rejected positions
    from their ring. Greedy output is the same as without a draft. Not with
    logits processors (penalties, logit bias), --kv-bits or images. Requests
    run one at a time. The counters (--json) give the draft tokens and the
    acceptance.

    Recurrent state cannot be shared between entries, so for a model whose
    cache cannot be trimmed each conversation keeps a bounded history: the
    system-prompt checkpoint plus the --checkpoints latest turn boundaries
    (a turn makes two, and on such a model a third at the end of the chat's
    messages, which `promptstore get --messages` of the same chat looks up).
    Pinned entries and entries written by `put` or `warmup` are never deleted.

    MODEL may be a Hugging Face id already in the local cache: mlx_lm.server
    is given its snapshot folder, so nothing is downloaded. Entries an older
    release stored under the folder-named identity are found as by `get`.
    """
    path = model_folder(model_dir)
    args = list(server_args)
    if draft_dir is not None:
        args += ["--draft-model", str(model_folder(draft_dir))]
    if num_draft_tokens is not None:
        args += ["--num-draft-tokens", str(num_draft_tokens)]
    try:
        tokenizer_config = check_server_args(str(path), args)  # before the store is opened: a typo creates nothing
    except InvalidInput as err:
        raise click.UsageError(str(err)) from None
    if tokenizer_config is not None:  # mlx_lm.server loads it only for the first request, in its generation thread
        check_tokenizer(str(path), tokenizer_config)
    stats = run_server(str(path), args, store=obj.store, checkpoints=checkpoints)
    if as_json:
        emit_json({"store": str(obj.store.path), "model": str(Path(model_dir)), "model_path": str(path),
                   "draft_model": draft_dir, "cache": stats})
    else:
        drafted = (
            f", {stats.get('draft_tokens', 0)} draft tokens ({stats.get('acceptance', 0.0):.0%} accepted)"
            if draft_dir is not None else ""
        )
        click.echo(
            f"stopped: {stats.get('written', 0)} caches written, {stats.get('store_hits', 0)} store hits, "
            f"{stats.get('memory_hits', 0)} memory hits, {stats.get('pending', 0)} writes lost{drafted}",
            err=True,
        )
