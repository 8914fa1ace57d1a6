"""Prompt options shared by put / get / import: text, file, stdin or messages."""

from __future__ import annotations

import functools
import json
import sys
from typing import Callable, List, Optional

import click

from promptstore import InvalidInput
from promptstore.jobs.prefill import encode_prompt


def prompt_options(fn: Callable) -> Callable:
    @click.option("--prompt", "prompt", default=None, help="Prompt text; '-' reads standard input.")
    @click.option("--prompt-file", type=click.Path(dir_okay=False, exists=True), default=None, help="Read the prompt from a file.")
    @click.option("--messages", "messages_file", type=click.Path(dir_okay=False, exists=True), default=None, help="A JSON list of chat messages.")
    @click.option("--no-chat-template", is_flag=True, help="Tokenize the raw text, without the chat template.")
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def read_prompt(prompt: Optional[str], prompt_file: Optional[str], messages_file: Optional[str]):
    """``(text, messages)``: exactly one is set."""
    given = [x is not None for x in (prompt, prompt_file, messages_file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-file, --messages")
    if prompt_file is not None:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read(), None
    if messages_file is not None:
        try:
            with open(messages_file, encoding="utf-8") as f:
                messages = json.load(f)
        except ValueError as err:
            raise InvalidInput(f"{messages_file}: not JSON ({err})") from err
        if isinstance(messages, dict) and "messages" in messages:
            messages = messages["messages"]
        return None, messages
    if prompt == "-":
        return sys.stdin.read(), None
    return prompt, None


def prompt_tokens(tokenizer, prompt, prompt_file, messages_file, no_chat_template) -> List[int]:
    text, messages = read_prompt(prompt, prompt_file, messages_file)
    return encode_prompt(tokenizer, text, messages, chat_template=not no_chat_template)
