"""Where a command's prompts come from: ``--prompt`` text (``-``: stdin), ``--prompt-file`` lines, ``--tokens`` ids or
a token file. Each bad input is one ``CliError`` line naming the option."""

from __future__ import annotations

import argparse
import os
import sys

from spec_cache.apps.cli.common import CliError, token_list

__all__ = ["prompt_file", "stdin_prompt", "tokens_arg"]


def prompt_file(path: str) -> list[str]:
    """``--prompt-file``: one prompt per non-empty line (UTF-8)."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError:
        raise CliError(f"--prompt-file: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--prompt-file: cannot read {path}: {exc}") from None
    if not prompts:
        raise CliError(f"--prompt-file: {path} holds no prompt (one prompt per non-empty line)")
    return prompts


def stdin_prompt() -> str:
    """``--prompt -``: the prompt is stdin, whole (as mlx_lm.generate reads it), without its final newline."""
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise CliError("--prompt -: stdin held no prompt text")
    return text


def tokens_arg(text: str) -> list[int]:
    """``--tokens``: a file of token ids, or the ids themselves separated by commas."""
    if os.path.isfile(text):
        from spec_cache.convert.interop import InteropError, read_tokens  # loads MLX

        try:
            return read_tokens(text)
        except InteropError as exc:
            raise CliError(str(exc)) from None
    try:
        return token_list(text)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--tokens: {exc} (or the path of a token file)") from None
