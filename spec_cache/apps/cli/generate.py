"""``spec-cache generate``: decode prompts with a local model through the cache, in mlx_lm.generate's dialect.

Text prompts go through the model's chat template (after ``--system-prompt``), token-id prompts as they are; one
prompt streams its text, several decode in one batch (``stream.decode_rows``: a row leaves at its first stop
string). mlx_lm.generate's option names work where they overlap (``-p``, ``-m``, ``--temp``, ``--draft-model``,
``--num-draft-tokens``, ``--ignore-chat-template``, ``--verbose``); ``--max-kv-size`` is refused in one line.
Building the parser stays MLX-free: MLX loads when the command runs.
"""

from __future__ import annotations

import argparse
import sys
import time

from spec_cache.apps.cli import shared
from spec_cache.apps.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    CliError,
    closed_fraction,
    context_tokens,
    emit,
    error_line,
    fraction,
    model_args_problem,
    non_negative_int,
    parse_size,
    positive_int,
    refuse_max_kv_size,
)
from spec_cache.apps.cli.loaders import kv_options, load_tokenizer, open_cache
from spec_cache.apps.cli.prompts import prompt_file, stdin_prompt, tokens_arg
from spec_cache.drafters import METHODS as DRAFTER_METHODS

__all__ = ["register", "cmd_generate"]


def _one_line(exc: BaseException) -> str:
    return error_line(exc, first_line=True)


def _check_generate_args(args) -> None:
    problem = model_args_problem(args.model, args.drafter, args.method, args.adapter)
    if problem is not None:
        raise CliError(problem)
    if not (args.prompt or args.prompt_file or args.tokens):
        raise CliError("generate needs a prompt: --prompt TEXT, --prompt-file FILE or --tokens IDS|FILE")


def _check_context(model: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Every prompt + ``--max-tokens`` must fit the model's context: refused before any model work, as serve does."""
    context = context_tokens(model)
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_tokens > context:
            room = context - len(prompt)
            fix = f"use --max-tokens {room} or less" if room >= 1 else "shorten the prompt"
            raise CliError(f"prompt {i + 1} ({len(prompt)} tokens) + --max-tokens {max_tokens} exceeds the model's "
                           f"context of {context} tokens; {fix}")


def _row_line(i: int, r: dict) -> str:
    return (f"[prompt {i + 1}: {r['prompt_tokens']} tokens, {r['cached_tokens']} from the cache"
            f"{' (with the drafter row)' if r['restored_drafter'] else ''}; TTFT {r['ttft_s'] * 1e3:.1f} ms; "
            f"drafted {r['drafted']}, accepted {r['accepted']}{'; cut at a stop string' if r['stopped'] else ''}]")


def _generate_tokenizer(args, needed: bool):
    """The model's tokenizer: required for text prompts and stop strings (a CliError without it); for token-id
    prompts only to print text, so a model without one prints the ids instead."""
    try:
        return load_tokenizer(args.model)
    except CliError:
        if needed:
            raise
        return None


def _apply_mlx_lm_aliases(args) -> None:
    """mlx_lm.generate's names for options spec-cache spells its own way: ``--draft-model DIR`` is a draft-model
    drafter; ``--max-kv-size`` is refused (a rotating window would make a stored prefix depend on where the window
    stood; ``common.refuse_max_kv_size``)."""
    if getattr(args, "draft_model", None):
        if args.drafter and args.drafter != args.draft_model:
            raise CliError("give the drafter once: --draft-model DIR or --drafter DIR")
        if args.method not in (None, "draft-model"):
            raise CliError(f"--draft-model is a draft-model drafter; it cannot be --method {args.method}")
        args.drafter, args.method = args.draft_model, "draft-model"
    refuse_max_kv_size(args)


def cmd_generate(args) -> int:
    kv = kv_options(args)
    _apply_mlx_lm_aliases(args)
    _check_generate_args(args)
    texts = [stdin_prompt() if t == "-" else t for t in args.prompt or []]
    texts += [p for path in args.prompt_file or [] for p in prompt_file(path)]
    token_prompts = [tokens_arg(t) for t in args.tokens or []]
    if args.system_prompt is not None and not texts:
        raise CliError("--system-prompt applies to --prompt text; token-id prompts already hold their template")
    tokenizer = _generate_tokenizer(args, needed=bool(texts or args.stop))
    if texts:
        from spec_cache.decode.generator import encode_prompt, has_chat_template

        chat = not args.raw and has_chat_template(tokenizer)
        if args.system_prompt is not None and not chat:
            raise CliError("--system-prompt needs the model's chat template (it is off with --raw, or the model "
                           "has none)")
        try:
            prompts = [encode_prompt(tokenizer, t, chat=chat, system=args.system_prompt) for t in texts]
            prompts += token_prompts
        except Exception as exc:
            raise CliError(f"the chat template refused the prompt ({_one_line(exc)}); try --raw") from None
    else:
        chat, prompts = False, token_prompts
    _check_context(args.model, prompts, args.max_tokens)
    from spec_cache.decode.generator import Generator  # loads MLX

    stream = len(prompts) == 1 and tokenizer is not None and not args.json
    cache = None if args.no_cache else open_cache(args, shared=shared.shared_url(args), max_bytes=args.max_bytes,
                                                   shared_options=shared.shared_options(args))
    try:
        try:
            generator = Generator.load(args.model, args.drafter, method=args.method, cache=cache, kv=kv,
                                       draft_depth=args.draft_depth, adapters=args.adapter or "",
                                       prefill_step_size=args.prefill_step_size, adaptive=not args.fixed_depth)
            started = time.perf_counter()
            if tokenizer is not None:  # text per row; a row leaves the batch at its first stop string
                from spec_cache.apps.cli.stream import decode_rows

                decoded = decode_rows(generator, prompts, tokenizer, max_tokens=args.max_tokens,
                                      temperature=args.temperature, seed=args.seed, top_p=args.top_p,
                                      stops=args.stop or [], top_k=args.top_k, min_p=args.min_p,
                                      processors=_processors(args),
                                      out=sys.stdout if stream else None)
            else:  # token ids in, token ids out
                decoded = generator.generate(prompts, max_tokens=args.max_tokens, temperature=args.temperature,
                                             seed=args.seed, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                             **_processors(args))
            seconds = time.perf_counter() - started
        except (NotImplementedError, ValueError, TypeError, FileNotFoundError) as exc:
            raise CliError(_one_line(exc)) from None
    finally:
        if cache is not None:
            cache.close()
    rows = []
    for prompt, result in zip(prompts, decoded):
        rows.append({"tokens": result.tokens, "text": getattr(result, "text", None),
                     "stopped": getattr(result, "stopped", False), "prompt_tokens": len(prompt),
                     "cached_tokens": result.cached_tokens, "drafted": result.drafted, "accepted": result.accepted,
                     "ttft_s": result.ttft_s, "restored_drafter": result.restored_drafter,
                     "chat_template": chat and len(rows) < len(texts)})  # text prompts come first
    generated = sum(len(r["tokens"]) for r in rows)
    run = {"seconds": round(seconds, 6), "generated_tokens": generated,
           "tokens_per_s": round(generated / seconds, 3) if seconds > 0 else None,
           "prefix_namespace": generator.prefix_namespace, "cache": None if cache is None else args.cache}
    if args.json:  # the first prompt's fields at the top level (one prompt: all of it), every prompt in results
        emit(args, {**rows[0], **run, "results": rows}, "")
        return EXIT_OK
    for i, r in enumerate(rows):
        if not stream:
            if len(rows) > 1:
                print(f"--- prompt {i + 1} ---")
            print(r["text"] if r["text"] is not None else ",".join(map(str, r["tokens"])))
        if args.verbose:
            print(_row_line(i, r), file=sys.stderr)
    rate = f"{run['tokens_per_s']:.1f} tok/s" if run["tokens_per_s"] is not None else "-"
    if args.verbose:
        print(f"[{generated} tokens in {seconds:.2f} s: {rate}, prefill and lookups included; "
              f"{len(rows)} prompt{'s' if len(rows) > 1 else ''} in one batch"
              f"{'; chat template applied (--raw: off)' if chat else ''}]", file=sys.stderr)
    if any(getattr(r, "interrupted", False) for r in decoded):
        print(f"spec-cache: interrupted after {generated} tokens (the text so far is above)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _penalty(text: str) -> float:
    """``--repetition-penalty``: a finite number > 0 (1: off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0: {text!r}")
    return value


def _processors(args) -> dict:
    """The logits processors the options set (``RowSampling``'s names; empty when off)."""
    if args.repetition_penalty == 1.0:
        return {}
    return {"repetition_penalty": args.repetition_penalty, "repetition_context_size": args.repetition_context_size}


def _bool(text: str) -> bool:
    """mlx-lm's spelling of a boolean option value: True/T/true/1 or False/F/false/0."""
    value = text.strip().lower()
    if value in ("true", "t", "1", "yes"):
        return True
    if value in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"not True or False: {text!r}")


def register(sub, common, add_kv_options, add_memory_option, temperature, seed) -> None:
    """Add ``generate`` (options shared with ``chat`` come from runtime's helpers)."""
    s = sub.add_parser("generate", parents=[common], help="decode prompts with a local model through the cache",
                       description="Decode one or more prompts (one batch) with a local model through the cache: "
                                   "the text (or token ids) on stdout, what the cache did and tokens/s on stderr.")
    s.add_argument("--model", required=True, help="target model directory (config.json + safetensors)")
    s.add_argument("--drafter", help="drafter directory")
    s.add_argument("--method", choices=DRAFTER_METHODS,
                   help="drafter method (default: read from the drafter's config; 'ngram' needs no directory)")
    s.add_argument("--draft-model", metavar="DIR",
                   help="a draft model directory (mlx_lm.generate's name: --drafter DIR --method draft-model)")
    s.add_argument("--adapter", "--adapter-path", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory (repeat to stack, applied in order)")
    s.add_argument("-p", "--prompt", action="append", metavar="TEXT",
                   help="prompt text (needs the model's tokenizer files; '-': read it from stdin); repeat for "
                        "several prompts")
    s.add_argument("--prompt-file", action="append", metavar="FILE",
                   help="a UTF-8 file with one prompt per non-empty line (repeatable)")
    s.add_argument("--tokens", action="append", metavar="IDS|FILE",
                   help="prompt token ids, e.g. 1,2,3, or a token file (JSON list or integers); repeatable")
    s.add_argument("--raw", "--no-chat", "--ignore-chat-template", dest="raw", action="store_true",
                   help="encode --prompt text as it is (default: as one user message through the model's chat "
                        "template when it has one, as mlx_lm.generate does)")
    s.add_argument("--system-prompt", metavar="TEXT",
                   help="a system message before each --prompt (through the chat template)")
    s.add_argument("-m", "--max-tokens", type=positive_int, default=32, metavar="N",
                   help="tokens to generate per prompt (default 32; prompt + N must fit the model's context)")
    s.add_argument("--temperature", "--temp", type=temperature, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy, exactly the model's argmax tokens)")
    s.add_argument("--top-p", type=fraction, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P (default 1)")
    s.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="keep the K most likely tokens when sampling (default 0: off; mlx_lm.generate's --top-k)")
    s.add_argument("--min-p", type=closed_fraction, default=0.0, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one (default 0: off)")
    s.add_argument("--repetition-penalty", type=_penalty, default=1.0, metavar="R",
                   help="mlx-lm's repetition penalty over the last --repetition-context-size tokens, prompt "
                        "included (default 1: off; greedy decoding too)")
    s.add_argument("--repetition-context-size", type=non_negative_int, default=20, metavar="N",
                   help="tokens the repetition penalty looks back over (default 20, as mlx-lm; 0: all)")
    s.add_argument("--seed", type=seed, default=0, metavar="N",
                   help="sampling seed (default 0); a prompt's tokens depend only on it, its prompt and options")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop a prompt's decoding where its text reaches this string, which is not shown "
                        "(repeatable; needs the tokenizer)")
    s.add_argument("--draft-depth", "--num-draft-tokens", type=non_negative_int, default=4, metavar="D",
                   help="most tokens the drafter proposes per round (default 4; 0: no drafting)")
    s.add_argument("--fixed-depth", action="store_true",
                   help="always draft --draft-depth tokens (default: only as deep as measured acceptance and "
                        "verify cost pay, down to plain decoding)")
    s.add_argument("--prefill-step-size", type=positive_int, default=512, metavar="N",
                   help="prefill chunk in tokens (default 512, as mlx-lm's)")
    s.add_argument("--verbose", type=_bool, default=True, metavar="BOOL",
                   help="False: print only the text, not what the cache did (mlx_lm.generate's; default True)")
    s.add_argument("--max-kv-size", type=positive_int, metavar="N",
                   help="mlx-lm's rotating KV window: refused (a stored prefix is an exact token history)")
    add_kv_options(s)
    s.add_argument("--no-cache", action="store_true", help="run without the store")
    s.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                   help="byte budget of the store (LRU eviction beyond it; recorded with the store), e.g. 8GiB")
    add_memory_option(s)
    s.set_defaults(fn=cmd_generate)
