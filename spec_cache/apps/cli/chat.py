"""``spec-cache chat``: an interactive multi-turn chat (as ``mlx_lm.chat``), each turn resumed from the cache.

Each turn's prompt is the model's chat template over the whole conversation plus the new message; the previous
turn's finish checkpoint covers most of it, so a turn prefills only what is new (a line on stderr says how many
prompt tokens came from the cache). The reply streams to stdout. Commands: ``/reset`` (a new conversation),
``/save FILE`` (the conversation as JSON messages), ``/quit`` (or end of input). Ctrl-C during a reply stops that
reply and keeps what was printed; Ctrl-C at the prompt ends the session (exit 130).
"""

from __future__ import annotations

import json
import sys

from spec_cache.apps.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    CliError,
    context_tokens,
    error_line,
    model_args_problem,
    refuse_max_kv_size,
)

HELP = "commands: /reset (new conversation), /save FILE (conversation as JSON), /quit (or Ctrl-D)"


def _turn_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run_chat(args, generator, tokenizer, *, stdin=None, out=None, err=None) -> int:
    """The read-reply loop over ``stdin`` (default sys.stdin); returns the exit code."""
    from spec_cache.apps.cli.stream import stream_one

    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    context = context_tokens(args.model)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"[chat with {args.model}; {HELP}]", file=err, flush=True)
    turn = 0
    while True:
        if stdin.isatty():
            print(">> ", end="", file=err, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            print("", file=err)
            return EXIT_INTERRUPTED
        if not line:
            return EXIT_OK
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return EXIT_OK
        if text == "/reset":
            messages, turn = list(system), 0
            print("[new conversation]", file=err, flush=True)
            continue
        if text.startswith("/save"):
            path = text[len("/save"):].strip()
            if not path:
                print("[/save needs a file name]", file=err, flush=True)
                continue
            try:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(messages, f, indent=1, ensure_ascii=False)
            except OSError as exc:
                print(f"[cannot write {path}: {exc}]", file=err, flush=True)
                continue
            print(f"[saved {len(messages)} messages to {path}]", file=err, flush=True)
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]}; {HELP}]", file=err, flush=True)
            continue
        attempt = messages + [{"role": "user", "content": text}]
        prompt = _turn_prompt(tokenizer, attempt)
        if len(prompt) + args.max_tokens > context:
            print(f"[the conversation ({len(prompt)} tokens) + --max-tokens {args.max_tokens} exceeds the model's "
                  f"context of {context} tokens: /reset to start again]", file=err, flush=True)
            continue
        turn += 1
        r = stream_one(generator, prompt, tokenizer, max_tokens=args.max_tokens, temperature=args.temperature,
                       seed=args.seed, top_p=args.top_p, stops=[], out=out, top_k=args.top_k, min_p=args.min_p)
        messages = attempt + [{"role": "assistant", "content": r.text}]
        print(f"[turn {turn}: {len(prompt)} prompt tokens, {r.cached_tokens} from the cache; TTFT "
              f"{r.ttft_s * 1e3:.1f} ms; {len(r.tokens)} tokens{'; interrupted' if r.interrupted else ''}]",
              file=err, flush=True)


def cmd_chat(args) -> int:
    from spec_cache.apps.cli import shared
    from spec_cache.apps.cli.loaders import kv_options, load_tokenizer, open_cache

    kv = kv_options(args)
    refuse_max_kv_size(args)
    problem = model_args_problem(args.model, args.drafter, args.method)
    if problem is not None:
        raise CliError(problem)
    tokenizer = load_tokenizer(args.model)
    from spec_cache.decode.generator import Generator, has_chat_template  # loads MLX

    if not has_chat_template(tokenizer):
        raise CliError(f"{args.model} has no chat template; use 'spec-cache generate --raw' for plain text")
    cache = None if args.no_cache else open_cache(args, shared=shared.shared_url(args), max_bytes=args.max_bytes,
                                                   shared_options=shared.shared_options(args))
    try:
        try:
            generator = Generator.load(args.model, args.drafter, method=args.method, cache=cache, kv=kv,
                                       draft_depth=args.draft_depth, adapters=args.adapter or "")
        except (NotImplementedError, ValueError, TypeError, FileNotFoundError) as exc:
            raise CliError(error_line(exc, first_line=True)) from None
        return run_chat(args, generator, tokenizer)
    finally:
        if cache is not None:
            cache.close()


def register(sub, common, add_kv_options, add_memory_option, temperature, seed) -> None:
    """Add ``chat`` (options shared with ``generate`` come from runtime's helpers)."""
    from spec_cache.apps.cli.common import closed_fraction, fraction, non_negative_int, parse_size, positive_int
    from spec_cache.drafters import METHODS

    s = sub.add_parser("chat", parents=[common], help="an interactive multi-turn chat, each turn resumed from the "
                       "cache (as mlx_lm.chat)",
                       description="An interactive chat through the model's chat template: the reply streams to "
                                   "stdout, each turn resumes from the previous one's checkpoint (cached tokens "
                                   f"per turn on stderr); {HELP}.")
    s.add_argument("--model", required=True, help="target model directory (config.json + safetensors + tokenizer)")
    s.add_argument("--drafter", help="drafter directory")
    s.add_argument("--method", choices=METHODS, help="drafter method ('ngram' needs no directory)")
    s.add_argument("--adapter", "--adapter-path", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory")
    s.add_argument("--system", "--system-prompt", metavar="TEXT",
                   help="a system message at the start of every conversation")
    s.add_argument("-m", "--max-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens per reply (default 256)")
    s.add_argument("--temperature", "--temp", type=temperature, default=0.0, metavar="T", help="sampling temperature "
                   "(default 0: greedy)")
    s.add_argument("--top-p", type=fraction, default=1.0, metavar="P", help="nucleus sampling (default 1)")
    s.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="keep the K most likely tokens when sampling (default 0: off)")
    s.add_argument("--min-p", type=closed_fraction, default=0.0, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one (default 0: off)")
    s.add_argument("--seed", type=seed, default=0, metavar="N", help="sampling seed (default 0)")
    s.add_argument("--draft-depth", type=non_negative_int, default=4, metavar="D",
                   help="most tokens the drafter proposes per round (default 4)")
    s.add_argument("--max-kv-size", type=positive_int, metavar="N",
                   help="mlx-lm's rotating KV window: refused (a stored prefix is an exact token history)")
    add_kv_options(s)
    s.add_argument("--no-cache", action="store_true", help="run without the store")
    s.add_argument("--max-bytes", type=parse_size, metavar="SIZE", help="byte budget of the store")
    add_memory_option(s)
    s.set_defaults(fn=cmd_chat)
