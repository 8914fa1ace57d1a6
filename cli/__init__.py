"""The promptstore command line: ``promptstore [--store DIR] COMMAND``.

One module per command; each registers itself on the group in ``main``.
"""

from __future__ import annotations

import importlib

import click

from promptstore.cli._common import Ctx, Group, global_store


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    "store_path",
    envvar="PROMPTSTORE_DIR",
    default=None,
    callback=global_store,
    help="Store directory [env PROMPTSTORE_DIR; default $XDG_CACHE_HOME/promptstore, else ~/.cache/promptstore (~/Library/Caches/promptstore on macOS)].",
)
@click.option(
    "--remote",
    "remote",
    envvar="PROMPTSTORE_REMOTE",
    metavar="URL",
    default=None,
    help="Shared tier: redis://[user:password@]host:port[/db][?ns=NAME] (rediss:// for TLS; a Redis Cluster "
    "is found from any node). Puts are published, local misses fetched from it [env PROMPTSTORE_REMOTE].",
)
@click.option("--no-remote", is_flag=True, help="No shared tier for this command, whatever PROMPTSTORE_REMOTE says.")
@click.version_option(package_name="promptstore")
@click.pass_context
def main(ctx: click.Context, store_path, remote, no_remote):
    """Persistent, bit-exact prompt caches for MLX language models."""
    ctx.obj = Ctx(store_path, remote=False if no_remote or not remote else remote)
    ctx.call_on_close(ctx.obj.close)


# One module per command: (module name, click command attribute). Add a line per new command.
COMMANDS = (
    ("put", "put"),
    ("get", "get"),
    ("ls", "ls"),
    ("rm", "rm"),
    ("stats", "stats"),
    ("verify", "verify"),
    ("export", "export"),
    ("import_", "import_"),
    ("bench", "bench"),
    ("warmup", "warmup"),
    ("serve", "serve"),
    ("gc", "gc"),
    ("compact", "compact"),
    ("salvage", "salvage"),
)

for _module, _attr in COMMANDS:
    main.add_command(getattr(importlib.import_module(f"promptstore.cli.{_module}"), _attr))

__all__ = ["main"]
