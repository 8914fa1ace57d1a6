"""Prompt options shared by put / get / import: text, file, stdin or
messages, templated as mlx-lm does (``--system-prompt``,
``--ignore-chat-template``)."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import click

from promptstore import InvalidInput
from promptstore.jobs.prefill import check_messages, check_text, encode_prompt


@dataclass(frozen=True)
class PromptArgs:
    """What the prompt options asked for (``pargs`` of a command)."""

    prompt: Optional[str]
    prompt_file: Optional[str]
    messages_file: Optional[str]
    system_prompt: Optional[str]
    no_chat_template: bool

    @property
    def given(self) -> bool:
        return any(x is not None for x in (self.prompt, self.prompt_file, self.messages_file))


def templating_options(fn: Callable) -> Callable:
    """--system-prompt and --ignore-chat-template (alias --no-chat-template),
    as mlx-lm names them; the command receives ``system_prompt`` and
    ``no_chat_template`` (warmup), or them within ``pargs``."""
    fn = click.option(
        "--ignore-chat-template",
        "--no-chat-template",
        "no_chat_template",
        is_flag=True,
        help="Tokenize the raw text, without the chat template (as mlx_lm.generate --ignore-chat-template).",
    )(fn)
    return click.option("--system-prompt", default=None, help="A system message before the prompt (as mlx_lm.generate --system-prompt).")(fn)


def prompt_options(fn: Callable) -> Callable:
    """The prompt options; the command receives them as one ``pargs`` (PromptArgs)."""

    @click.option("--prompt", "prompt", default=None, help="Prompt text; '-' reads standard input.")
    @click.option("--prompt-file", type=click.Path(dir_okay=False, exists=True), default=None, help="Read the prompt from a file (UTF-8).")
    @click.option("--messages", "messages_file", type=click.Path(dir_okay=False, exists=True), default=None, help="A JSON list of chat messages (or {\"messages\": [...]}).")
    @templating_options
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["pargs"] = PromptArgs(
            kwargs.pop("prompt"),
            kwargs.pop("prompt_file"),
            kwargs.pop("messages_file"),
            kwargs.pop("system_prompt"),
            kwargs.pop("no_chat_template"),
        )
        return fn(*args, **kwargs)

    return wrapper


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte-order mark some editors write is no part of the prompt
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{where} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); convert it first, e.g. with iconv") from err


def _read_stdin() -> str:
    if sys.stdin is None:  # started with standard input closed
        raise InvalidInput("--prompt - reads standard input, which is closed; pipe the prompt in or use --prompt-file")
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text-only stream: already decoded
        return sys.stdin.read()
    return _decode(buffer.read(), "standard input")


def read_prompt(pargs: PromptArgs) -> Tuple[Optional[str], Optional[List[Any]]]:
    """``(text, messages)``: exactly one is set, and it is not empty.

    Raises:
        click.UsageError: not exactly one prompt option.
        InvalidInput: unreadable, not UTF-8, not JSON, malformed messages, or empty.
    """
    given = [x is not None for x in (pargs.prompt, pargs.prompt_file, pargs.messages_file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-file, --messages")
    if pargs.messages_file is not None:
        with open(pargs.messages_file, "rb") as f:
            raw = _decode(f.read(), pargs.messages_file)
        try:
            messages = json.loads(raw)
        except ValueError as err:
            raise InvalidInput(f"{pargs.messages_file}: not JSON ({err})") from err
        except RecursionError as err:  # nested deeper than the parser recurses
            raise InvalidInput(f"{pargs.messages_file}: JSON nested too deeply to be chat messages") from err
        if isinstance(messages, dict) and "messages" in messages:  # a chat request's body
            other = sorted(k for k in messages if k != "messages")
            if other:  # e.g. tools, which mlx-lm's server renders into the prompt: the cache would not be the server's
                raise InvalidInput(f"{pargs.messages_file}: keys other than \"messages\" are not used ({', '.join(map(str, other))}); "
                                   "give the messages alone (a list, or {\"messages\": [...]})")
            messages = messages["messages"]
        try:
            check_messages(messages)
        except InvalidInput as err:
            raise InvalidInput(f"{pargs.messages_file}: {err}") from err
        return None, messages
    if pargs.prompt_file is not None:
        with open(pargs.prompt_file, "rb") as f:
            text, where = _decode(f.read(), pargs.prompt_file), pargs.prompt_file
    elif pargs.prompt == "-":
        text, where = _read_stdin(), "standard input"
    else:
        text, where = str(pargs.prompt), "--prompt"
    check_text(text, where)
    check_text(pargs.system_prompt, "--system-prompt")
    if not text.strip():
        raise InvalidInput(f"the prompt ({where}) is empty; a cache of no prompt serves nothing")
    return text, None


def prompt_tokens(tokenizer: Any, pargs: PromptArgs) -> List[int]:
    """The prompt's token ids, templated as ``mlx_lm.cache_prompt`` does."""
    text, messages = read_prompt(pargs)
    return encode(tokenizer, text, messages, pargs)


def encode(tokenizer: Any, text: Optional[str], messages: Optional[List[Any]], pargs: PromptArgs) -> List[int]:
    tokens = encode_prompt(tokenizer, text, messages, chat_template=not pargs.no_chat_template, system_prompt=pargs.system_prompt)
    if not tokens:
        raise InvalidInput("the prompt encodes to no tokens")
    return tokens
