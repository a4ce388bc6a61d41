"""``spec-cache train-drafter``: train a ``qwen-mtp`` drafter head for a target from its own greedy answers to a
prompt set (``spec_cache.training.train_loop``), then measure its drafting acceptance on held-out prompts
through the engine against the untrained head (``spec_cache.training.train_eval``).

Options are MLX-free (the ``spec-cache`` parser is built without loading MLX); ``main`` loads it.
``python -m spec_cache.apps.train_drafter --model DIR --out DIR`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

from spec_cache.apps.cli.common import CliError, error_line, model_dir_problem, positive_int, progress_bar

__all__ = ["add_arguments", "main", "bundled_prompts"]

DEFAULTS = {"steps": 300, "batch": 8, "lr": 1e-3, "seq_len": 64, "depth": 3, "seed": 0, "gen_tokens": 128,
            "save_every": 50, "loss_vocab": "full", "prompt_loss": None, "samples": 1, "sample_temperature": 0.8}


def _lr(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1): {text!r}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 4:
        raise argparse.ArgumentTypeError(f"must be in (0, 4]: {text!r}")
    return value


def register(sub) -> None:
    """The ``train-drafter`` subcommand on the CLI's subparsers (``spec_cache.apps.cli.runtime``)."""
    s = sub.add_parser("train-drafter", help="train a qwen-mtp drafter head for a model from its own generations",
                       description="Train a qwen-mtp drafter head for a target model on its own greedy answers to "
                                   "a prompt set, resumably; then measure held-out acceptance against the "
                                   "untrained head.")
    add_arguments(s)
    s.set_defaults(fn=main)  # loads MLX when it runs


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``train-drafter``; the training options default to None so a ``--resume`` takes the run's."""
    parser.add_argument("--model", required=True, help="target model directory (mlx-lm: config.json + safetensors)")
    parser.add_argument("--out", required=True,
                        help="drafter directory to write (config.json + model.safetensors; the run's state and data "
                             "in OUT/training/)")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help=f"optimizer steps (default {DEFAULTS['steps']})")
    parser.add_argument("--batch", type=positive_int, metavar="B",
                        help=f"windows per step (default {DEFAULTS['batch']})")
    parser.add_argument("--lr", type=_lr, metavar="LR", help=f"peak AdamW learning rate (default {DEFAULTS['lr']}; "
                        "warm-up, then cosine decay to a tenth)")
    parser.add_argument("--seq-len", type=positive_int, metavar="L",
                        help=f"pairs per training window (default {DEFAULTS['seq_len']})")
    parser.add_argument("--depth", type=positive_int, metavar="D",
                        help=f"chained draft steps in the loss, and the depth acceptance is measured at "
                             f"(default {DEFAULTS['depth']})")
    parser.add_argument("--seed", type=int, metavar="N", help="initialisation and batch-order seed (default 0)")
    parser.add_argument("--gen-tokens", type=positive_int, metavar="N",
                        help=f"most tokens the target writes per continuation (default {DEFAULTS['gen_tokens']})")
    parser.add_argument("--samples", type=positive_int, metavar="N",
                        help="continuations per training prompt: the greedy one, then N-1 sampled at "
                             "--sample-temperature (default 1; more data from a small prompt set; labels stay the "
                             "target's greedy tokens)")
    parser.add_argument("--sample-temperature", type=_temperature, metavar="T",
                        help=f"temperature of the sampled continuations (default {DEFAULTS['sample_temperature']})")
    parser.add_argument("--save-every", type=positive_int, metavar="N",
                        help=f"save weights + optimizer state every N steps (default {DEFAULTS['save_every']}); a "
                             "killed run loses at most N steps")
    parser.add_argument("--loss-vocab", choices=["full", "corpus"],
                        help="softmax over the whole vocabulary (default) or only the tokens of the training "
                             "corpus (several times faster on a CPU for 50k vocabularies; a sampled softmax)")
    parser.add_argument("--prompt-loss", action="store_true", default=None,
                        help="count prompt positions in the loss too (default: generated positions only, where the "
                             "head drafts; prompt pairs still feed its attention)")
    parser.add_argument("--intermediate-size", type=positive_int, metavar="N",
                        help="the head's MLP width (default: the target's)")
    parser.add_argument("--prompts", metavar="FILE",
                        help="UTF-8 file, one prompt per non-empty line (default: the bundled chat prompt set)")
    parser.add_argument("--holdout", type=int, metavar="N",
                        help="prompts of --prompts FILE kept out of training for the acceptance measure (default: "
                             "an eighth, at least 1; the bundled set has its own 8)")
    parser.add_argument("--raw", action="store_true",
                        help="encode prompts as they are (default: one user message through the chat template)")
    parser.add_argument("--eval-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens per held-out prompt in the acceptance measure (default 64)")
    parser.add_argument("--no-eval", action="store_true", help="skip the acceptance measure")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run saved in --out (its options; --steps may extend it)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress (default: a bar on a terminal, else one stderr line per save)")
    return parser


def bundled_prompts() -> tuple[list[str], list[str]]:
    """The bundled (train, held-out) chat prompts (``apps/bench/data/train_prompts.json``)."""
    doc = json.loads(resources.files("spec_cache.apps.bench").joinpath("data/train_prompts.json").read_text())
    return list(doc["train"]), list(doc["heldout"])


def _prompt_texts(args) -> tuple[list[str], list[str]]:
    if args.prompts is None:
        return bundled_prompts()
    try:
        with open(args.prompts, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        raise CliError(f"--prompts: no such file: {args.prompts}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--prompts: cannot read {args.prompts}: {exc}") from None
    holdout = max(1, len(texts) // 8) if args.holdout is None else args.holdout
    if holdout < 0 or len(texts) - holdout < 1:
        raise CliError(f"--prompts: {args.prompts} holds {len(texts)} prompts; need at least one to train on "
                       f"after {holdout} held out")
    return texts[:len(texts) - holdout], texts[len(texts) - holdout:]


def _encode(model: str, texts: list[str], raw: bool) -> list[list[int]]:
    from spec_cache.apps.cli.loaders import load_tokenizer  # loads MLX
    from spec_cache.decode.generator import encode_prompt

    tokenizer = load_tokenizer(model)
    prompts = [encode_prompt(tokenizer, text, chat=not raw) for text in texts]
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise CliError(f"prompt {empty[0]} encodes to no tokens")
    return prompts


def _options(args, stored: dict | None):
    from spec_cache.training.train_loop import TrainOptions

    values = dict(DEFAULTS, prompt_loss=False)
    values.update(stored or {})
    for name in DEFAULTS:
        given = getattr(args, name)
        if given is not None:
            values[name] = given
    if args.intermediate_size is not None:
        values["intermediate_size"] = args.intermediate_size
    return TrainOptions(**{k: v for k, v in values.items() if k in TrainOptions.__dataclass_fields__})


def _stored_options(out: Path) -> dict | None:
    path = out / "training" / "run.json"
    try:
        record = json.loads(path.read_text())
        return dict(record["options"], steps=record.get("steps"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"cannot resume: {path} is unreadable ({exc})") from None


def _progress(bar: bool, lines: bool, save_every: int):
    """A tqdm bar per phase on a terminal (``bar``); else (``lines``) one stderr line per save, for logs."""
    bars = {}

    def report(phase: str, done: int, total: int, loss: float | None) -> None:
        if lines and phase == "train" and (done % save_every == 0 or done == total):
            print(f"train-drafter: step {done}/{total} loss {loss:.4f} (saved)", file=sys.stderr, flush=True)
        if phase not in bars:
            for _, close in bars.values():
                close()
            bars[phase] = progress_bar(bar, {"generate": "generating", "hiddens": "hidden states",
                                             "train": "training"}.get(phase, phase),
                                       unit="step" if phase == "train" else "prompt")
        update = bars[phase][0]
        if update is not None:
            update(done, total)

    def close_all() -> None:
        for _, close in bars.values():
            close()
    return report, close_all


def run(args) -> dict:
    problem = model_dir_problem(args.model, "model")
    if problem is not None:
        raise CliError(problem)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; it names the drafter directory to write")
    stored = _stored_options(out) if args.resume else None
    if args.resume and stored is None:
        raise CliError(f"nothing to resume in {out} (no training/run.json); run without --resume to start")
    options = _options(args, stored)
    train_texts, heldout_texts = _prompt_texts(args)
    from spec_cache.training.train_eval import compare  # loads MLX
    from spec_cache.training.train_loop import check_target, train_head, training_dir

    check_target(args.model)  # before the tokenizer: a directory no head fits is named as such

    train_prompts = [] if args.resume else _encode(args.model, train_texts, args.raw)
    terminal = sys.stderr.isatty()
    report, close = _progress(terminal and not args.quiet, not terminal and not args.quiet, options.save_every)
    try:
        result = train_head(args.model, out, train_prompts, options, resume=args.resume, progress=report)
    finally:
        close()
    summary = dict(result.summary(), out=str(out), options={k: getattr(options, k) for k in DEFAULTS})
    if not args.no_eval and heldout_texts:
        heldout = _encode(args.model, heldout_texts, args.raw)
        summary["heldout"] = compare(args.model, {"trained": out, "untrained": training_dir(out) / "untrained"},
                                     heldout, args.eval_tokens, options.depth)
    return summary


def _human(summary: dict) -> str:
    lines = [f"wrote {summary['out']}: qwen-mtp head, {summary['steps']} steps "
             f"(resumed at {summary['resumed_from']})" if summary["resumed_from"] else
             f"wrote {summary['out']}: qwen-mtp head, {summary['steps']} steps",
             f"corpus: {summary['pairs']} pairs in {summary['windows']} windows",
             f"loss (all depths): {summary['loss_first']} -> {summary['loss_last']}; "
             f"depth 1: {summary['loss_depth1_first']} -> {summary['loss_depth1_last']}"]
    held = summary.get("heldout")
    if held:
        for name in ("trained", "untrained"):
            r = held[name]
            lines.append(f"held-out acceptance at depth {held['depth']} ({name}): {r['acceptance']:.1%} "
                         f"({r['accepted']}/{r['drafted']}), {r['tokens_per_round']} tokens/round, tokens "
                         f"{'identical to' if r['identical'] else 'DIFFERENT from'} plain greedy")
    lines.append(f"use it: spec-cache generate --model MODEL --drafter {summary['out']} --method qwen-mtp")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``train-drafter``; 0 on success, 2 with one line on stderr for bad input, 1 when the drafted tokens
    differ from plain greedy (never expected: a bug)."""
    from spec_cache.errors import SpecCacheError

    try:
        summary = run(args)
    except (CliError, SpecCacheError, OSError) as exc:
        print(f"train-drafter: {error_line(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(summary, sort_keys=True) if args.json else _human(summary))
    held = summary.get("heldout") or {}
    return 1 if any(not held[k]["identical"] for k in ("trained", "untrained") if k in held) else 0


if __name__ == "__main__":
    raise SystemExit(main(add_arguments(
        argparse.ArgumentParser(prog="python -m spec_cache.apps.train_drafter")).parse_args()))
