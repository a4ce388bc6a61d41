"""Train a ``qwen-mtp`` head for a target (``train_head``), resumably, into a drafter directory.

The out directory is the drafter (``config.json`` + ``model.safetensors``, what ``load_provider`` reads and
``model_identity`` hashes) plus ``training/``, which the identity ignores (subdirectories do not count):

- ``run.json``: the target's identity, the head's config and the run's options (a resume must match them);
- ``data.npz``: the corpus (the target's greedy generations as windows), made once, so a resume needs no target
  decoding and trains on the same data;
- ``state.safetensors``: head weights (``w.*``) and AdamW state (``o.*``) with the step and loss history in its
  metadata, written every ``save_every`` steps and at the end;
- ``untrained/``: the head as initialised (a drafter directory too: the acceptance baseline).

Every file is written to a temporary name, fsynced and renamed, so a run killed at any point leaves the last
complete save (it loses at most ``save_every`` steps). Batches are drawn from ``(seed, step)`` alone, so a
resumed run takes the same batches as an uninterrupted one and ends with the same weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from spec_cache.drafters.qwen_mtp import QwenMTPConfig, QwenMTPNetwork
from spec_cache.errors import InvalidRequest, ModelLoadError, UnsupportedCombination
from spec_cache.training.train_data import (
    Corpus,
    build_corpus,
    fsync_replace,
    greedy_sequences,
    load_corpus,
    save_corpus,
)
from spec_cache.training.train_head import chain_masks, chained_losses, head_config, new_head, subset_projection

__all__ = ["TrainOptions", "TrainResult", "check_target", "train_head", "training_dir", "STATE_NAME"]

STATE_NAME = "state.safetensors"
#: (phase, done, total, last loss or None): what a progress display is told
Progress = Callable[[str, int, int, float | None], None]


@dataclass(frozen=True)
class TrainOptions:
    """What a run does; all but ``steps`` and ``save_every`` must match on resume (``run.json``)."""

    steps: int = 300
    batch: int = 8
    lr: float = 1e-3
    seq_len: int = 64
    depth: int = 3          # chained passes in the loss (drafting depth the head is trained for)
    seed: int = 0
    gen_tokens: int = 128   # greedy tokens generated per training prompt
    gen_batch: int = 16
    save_every: int = 50
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    loss_vocab: str = "full"  # "corpus": softmax over the corpus's tokens only (train_head.subset_projection)
    prompt_loss: bool = False  # True: the loss counts prompt positions too (train_data's module doc says why not)
    samples: int = 1  # continuations per prompt: the greedy one, then sampled ones (train_data.greedy_sequences)
    sample_temperature: float = 0.8

    def check(self) -> None:
        for name in ("steps", "batch", "seq_len", "depth", "gen_tokens", "gen_batch", "save_every", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise InvalidRequest(f"lr must be a number in (0, 1), got {self.lr!r}")
        if self.loss_vocab not in ("full", "corpus"):
            raise InvalidRequest(f"loss_vocab must be 'full' or 'corpus', got {self.loss_vocab!r}")
        if not (isinstance(self.sample_temperature, (int, float)) and 0 < self.sample_temperature <= 4):
            raise InvalidRequest(f"sample_temperature must be in (0, 4], got {self.sample_temperature!r}")
        if self.depth > 8:
            raise InvalidRequest(f"depth must be <= 8, got {self.depth}")


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    resumed_from: int
    windows: int
    pairs: int
    #: per step: the total (all passes) and the depth-1 loss
    losses: list[tuple[float, float]] = field(default_factory=list)

    def summary(self, window: int = 10) -> dict:
        """First and last losses, each the mean over ``window`` steps."""
        first = self.losses[:window]
        last = self.losses[-window:]

        def mean(rows, i):
            return round(float(np.mean([r[i] for r in rows])), 4) if rows else None

        return {"steps": self.step, "resumed_from": self.resumed_from, "windows": self.windows,
                "pairs": self.pairs, "loss_first": mean(first, 0), "loss_last": mean(last, 0),
                "loss_depth1_first": mean(first, 1), "loss_depth1_last": mean(last, 1)}


def training_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "training"


# --- files ----------------------------------------------------------------------------------------------------
def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    fsync_replace(tmp, path)


def _write_safetensors(path: Path, arrays: dict, metadata: dict) -> None:
    tmp = path.with_name("tmp-" + path.name)  # still ends in .safetensors: MLX would append the suffix
    mx.save_safetensors(str(tmp), arrays, metadata=metadata)
    fsync_replace(tmp, path)


def save_drafter(directory: Path, config: QwenMTPConfig, network: QwenMTPNetwork) -> None:
    """``config.json`` + ``model.safetensors`` of a ``qwen-mtp`` drafter (weights first: a reader that sees the
    new config sees the new weights too; a changed config alone cannot pair with old weights of another shape)."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_safetensors(directory / "model.safetensors", dict(tree_flatten(network.parameters())),
                       {"format": "mlx"})
    _write_text(directory / "config.json", json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")


def _save_state(path: Path, network: QwenMTPNetwork, optimizer: optim.Optimizer, step: int,
                losses: list) -> None:
    arrays = {f"w.{k}": v for k, v in tree_flatten(network.parameters())}
    arrays.update({f"o.{k}": v for k, v in tree_flatten(optimizer.state)})
    _write_safetensors(path, arrays, {"step": str(step), "losses": json.dumps(losses)})


def _load_state(path: Path, network: QwenMTPNetwork, optimizer: optim.Optimizer) -> tuple[int, list]:
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        weights = [(k[2:], v) for k, v in arrays.items() if k.startswith("w.")]
        network.load_weights(weights, strict=True)
        optimizer.state = tree_unflatten([(k[2:], v) for k, v in arrays.items() if k.startswith("o.")])
        optimizer.init(network.trainable_parameters())
        return int(metadata["step"]), [tuple(x) for x in json.loads(metadata["losses"])]
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot resume from {path}: {exc}") from None


# --- setup ----------------------------------------------------------------------------------------------------
def check_target(model_dir: str | Path) -> None:
    """Refuse, before any work, a directory that is not a target a head can be trained for (it does not exist,
    has no readable ``config.json``, or its architecture has no target port)."""
    from spec_cache.rows.ports import SUPPORTED_ARCHITECTURES

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model directory {model_dir} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCombination(f"cannot train a drafter for {model_dir}: model_type {model_type!r} has no "
                                     f"target port (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _load_target(model_dir: Path):
    from spec_cache.rows.target import TargetModel

    check_target(model_dir)
    try:
        return TargetModel.load(model_dir)
    except NotImplementedError as exc:
        raise UnsupportedCombination(f"cannot train a drafter for {model_dir}: {exc}") from None
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the target {model_dir}: {type(exc).__name__}: {exc}") from None


def _optimizer(options: TrainOptions) -> optim.Optimizer:
    warmup = max(1, min(50, options.steps // 10))
    decay = optim.cosine_decay(options.lr, max(options.steps - warmup, 1), options.lr * 0.1)
    schedule = optim.join_schedules([optim.linear_schedule(options.lr * 0.01, options.lr, warmup), decay],
                                    [warmup])
    return optim.AdamW(learning_rate=schedule, weight_decay=0.0)


def _run_record(identity: str, config: QwenMTPConfig, options: TrainOptions) -> dict:
    fixed = {k: v for k, v in asdict(options).items() if k not in ("steps", "save_every")}
    return {"target_identity": identity, "head": config.to_dict(), "options": fixed, "steps": options.steps}


def _check_resume(record: dict, expected: dict, train_dir: Path) -> None:
    if record.get("target_identity") != expected["target_identity"]:
        raise InvalidRequest(f"{train_dir} was trained for another target (its identity differs); train into a "
                             f"new --out")
    differ = [f"{k}={record['options'].get(k)!r} (now {v!r})" for k, v in expected["options"].items()
              if record.get("options", {}).get(k) != v]
    if differ:
        raise InvalidRequest(f"cannot resume {train_dir} with other options: {', '.join(differ)}")


def _prepare(target, model_dir: Path, out_dir: Path, prompts, options: TrainOptions, resume: bool,
             progress: Progress | None) -> tuple[QwenMTPConfig, Corpus, dict]:
    """The head's config, the corpus and the run record, from ``training/`` on resume, else made and saved."""
    from spec_cache.naming.identity import model_identity

    train_dir = training_dir(out_dir)
    identity = model_identity(model_dir)
    config = head_config(target, options.intermediate_size)
    expected = _run_record(identity, config, options)
    if resume:
        if not (train_dir / "run.json").is_file() or not (train_dir / "data.npz").is_file():
            raise InvalidRequest(f"nothing to resume in {out_dir} (no training/run.json and data.npz); run without "
                                 f"--resume to start")
        record = json.loads((train_dir / "run.json").read_text())
        _check_resume(record, expected, train_dir)
        return QwenMTPConfig.from_dict(record["head"]), load_corpus(train_dir / "data.npz"), record
    if train_dir.exists() or (out_dir.exists() and any(out_dir.iterdir())):
        raise InvalidRequest(f"{out_dir} is not empty; pass --resume to continue a run there, or choose a new --out")
    if not prompts:
        raise InvalidRequest("no training prompts")
    from spec_cache.decode.generator import Generator

    generator = Generator.load(model_dir, None, cache=None)
    report = None if progress is None else (lambda done, total: progress("generate", done, total, None))
    sequences = greedy_sequences(generator, prompts, options.gen_tokens, options.gen_batch, report,
                                 options.samples, options.sample_temperature, options.seed)
    report = None if progress is None else (lambda done, total: progress("hiddens", done, total, None))
    lengths = None if options.prompt_loss else [len(p) for p in prompts] * options.samples
    corpus = build_corpus(target, sequences, options.seq_len, report, lengths)
    train_dir.mkdir(parents=True, exist_ok=True)
    save_corpus(corpus, train_dir / "data.npz")
    save_drafter(train_dir / "untrained", config, new_head(config, options.seed))
    _write_text(train_dir / "run.json", json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return config, corpus, expected


# --- the loop -------------------------------------------------------------------------------------------------
def train_head(model_dir: str | Path, out_dir: str | Path, prompts: Sequence[Sequence[int]],
               options: TrainOptions = TrainOptions(), *, resume: bool = False,
               progress: Progress | None = None) -> TrainResult:
    """Train a ``qwen-mtp`` head for the target in ``model_dir`` on its greedy continuations of ``prompts``
    (token lists) and save it as the drafter directory ``out_dir``; ``resume``: continue the run saved there.

    Raises ModelLoadError (no such target, unreadable state), UnsupportedCombination (no head fits the target),
    InvalidRequest (options, a non-empty ``out_dir`` without ``resume``, a resume with other options)."""
    options.check()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    target = _load_target(model_dir)
    config, corpus, _ = _prepare(target, model_dir, out_dir, prompts, options, resume, progress)
    network = new_head(config, options.seed)
    optimizer = _optimizer(options)
    state_path = training_dir(out_dir) / STATE_NAME
    step, losses = 0, []
    if resume and state_path.is_file():
        step, losses = _load_state(state_path, network, optimizer)
    resumed_from = step
    masks = chain_masks(options.seq_len, options.depth)
    labels, project = corpus.labels, None
    if options.loss_vocab == "corpus":
        ids = np.unique(np.concatenate([corpus.labels[corpus.valid], corpus.tokens[corpus.valid]]))
        project = subset_projection(target, ids)
        if project is None:
            raise UnsupportedCombination("loss_vocab 'corpus' needs a linear LM head; this target soft-caps its "
                                         "logits: use the full vocabulary")
        labels = np.searchsorted(ids, corpus.labels).astype(np.int32) * corpus.valid

    def loss_fn(hiddens, tokens, labels, valid):
        passes = chained_losses(network, target, hiddens, tokens, labels, valid, masks, project)
        return sum(passes) / len(passes), passes[0]

    value_and_grad = nn.value_and_grad(network, loss_fn)
    while step < options.steps:
        rng = np.random.default_rng([options.seed, step])
        pick = rng.integers(0, corpus.windows, size=options.batch)
        batch = (mx.array(corpus.hiddens[pick]), mx.array(corpus.tokens[pick]), mx.array(labels[pick]),
                 mx.array(corpus.valid[pick]))
        (loss, first), grads = value_and_grad(*batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(network, grads)
        mx.eval(network.parameters(), optimizer.state, loss, first)
        step += 1
        losses.append((round(float(loss), 5), round(float(first), 5)))
        if step % options.save_every == 0 or step == options.steps:
            _save_state(state_path, network, optimizer, step, losses)
            save_drafter(out_dir, config, network)
        if progress is not None:
            progress("train", step, options.steps, losses[-1][0])
    if not (out_dir / "config.json").is_file():  # resumed a finished run: the drafter is there already
        save_drafter(out_dir, config, network)
    return TrainResult(out_dir, step, resumed_from, corpus.windows, corpus.pairs, losses)
