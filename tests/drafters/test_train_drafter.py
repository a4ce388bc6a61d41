"""``spec-cache train-drafter`` (spec_cache.training.train_*): a qwen-mtp head trained on a tiny target's own greedy
generations. The loss falls; held-out acceptance at depth 3 through the engine beats the untrained head, with
tokens identical to plain greedy; the training graph's chained passes are the engine's draft steps; a run killed
after a save and resumed ends with the weights of an uninterrupted run; the saved directory loads by its
identity; the CLI answers bad input with one line and exit 2."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from spec_cache.apps.cli import main as cli_main
from spec_cache.decode.generator import Generator
from spec_cache.drafters import detect_method, load_provider
from spec_cache.drafters.projected import ContextKV
from spec_cache.naming.identity import model_identity
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.training.train_data import greedy_sequences, load_corpus
from spec_cache.training.train_eval import compare
from spec_cache.training.train_head import chain_masks, chained_losses, chained_outputs, head_config, new_head
from spec_cache.training.train_loop import STATE_NAME, TrainOptions, train_head, training_dir

#: small enough for a loaded 2-core machine: a narrow MLP, short windows, few steps
#: (held-out acceptance at depth 3 with these: 0.26-0.30 over seeds 0-2 at 80-100 steps; untrained 0)
OPTIONS = TrainOptions(steps=80, batch=4, lr=3e-3, seq_len=32, depth=3, seed=0, gen_tokens=32, save_every=40,
                       intermediate_size=64)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=6)] for _ in range(count)]


class Trained:
    def __init__(self, root):
        self.root = root
        self.target_dir = write_tiny_target(root / "target", tokenizer=False)
        self.out = root / "out"
        self.prompts = _prompts(18, 0)
        self.heldout = _prompts(4, 1)
        self.result = train_head(self.target_dir, self.out, self.prompts, OPTIONS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return Trained(tmp_path_factory.mktemp("train-drafter"))


def test_loss_falls(trained):
    summary = trained.result.summary()
    assert summary["steps"] == OPTIONS.steps and len(trained.result.losses) == OPTIONS.steps
    assert summary["loss_last"] < 0.5 * summary["loss_first"]
    assert summary["loss_depth1_last"] < 0.5 * summary["loss_depth1_first"]


def test_loss_counts_generated_positions_only(trained):
    """Pair j predicts t_{j+2}: with a 6-token prompt, pairs 0..4 predict prompt tokens and are left out of the
    loss (they still feed the head's attention); pair 5 predicts the first generated token's successor."""
    corpus = load_corpus(training_dir(trained.out) / "data.npz")
    assert not corpus.valid[0, :5].any() and corpus.valid[0, 5]


def test_samples_add_sampled_continuations_after_the_greedy_ones(trained):
    generator = Generator.load(trained.target_dir, None, cache=None)
    prompts = trained.prompts[:3]
    sequences = greedy_sequences(generator, prompts, 12, batch=4, samples=3, temperature=1.0, seed=5)
    greedy = [p + r.tokens for p, r in zip(prompts, generator.generate(prompts, max_tokens=12))]
    assert len(sequences) == 9 and sequences[:3] == greedy
    assert [s[:6] for s in sequences] == [p for p in prompts] * 3
    assert any(s != g for s, g in zip(sequences[3:6], greedy)) and sequences[3:6] != sequences[6:9]


def test_trained_head_beats_untrained_and_tokens_equal_plain(trained):
    report = compare(trained.target_dir, {"trained": trained.out, "untrained": training_dir(trained.out) /
                                          "untrained"}, trained.heldout, max_tokens=24, depth=3)
    assert report["trained"]["identical"] and report["untrained"]["identical"]
    assert report["trained"]["drafted"] > 0
    assert report["trained"]["acceptance"] > report["untrained"]["acceptance"] + 0.15


def test_saved_directory_loads_by_its_identity_and_decodes_like_plain(trained, tmp_path):
    assert detect_method(trained.out) == "qwen-mtp"
    provider = load_provider(trained.out)
    assert provider.namespace == "qwen-mtp-v1:" + model_identity(trained.out)
    bare = tmp_path / "bare"  # the training/ state does not count towards the identity
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(trained.out / name, bare / name)
    assert model_identity(bare) == model_identity(trained.out)
    plain = Generator.load(trained.target_dir, None, cache=None).generate(trained.heldout, max_tokens=20)
    drafted = Generator.load(trained.target_dir, trained.out, method="qwen-mtp", cache=None).generate(
        trained.heldout, max_tokens=20)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]


def test_pass_one_loss_is_the_engine_heads_cross_entropy(trained):
    """Pass 1 of the training graph is ``QwenMTPNetwork``'s causal forward (what the rows' prefill runs)."""
    target = TargetModel.load(trained.target_dir)
    corpus = load_corpus(training_dir(trained.out) / "data.npz")
    network = new_head(head_config(target, 64), 3)
    h, t, y, v = (mx.array(a[:2]) for a in (corpus.hiddens, corpus.tokens, corpus.labels, corpus.valid))
    ours = chained_losses(network, target, h, t, y, v, chain_masks(h.shape[1], 1))[0]
    out, _, _ = network(target.embed(t), h, mx.array([0, 0]), ContextKV(None, None, None))
    ce = nn.losses.cross_entropy(target.logits(network.norm(out)), y) * v
    assert abs(float(ours) - float(ce.sum() / v.sum())) < 1e-4


def test_chained_passes_are_the_engines_draft_steps(trained):
    """Pass d at pair j equals draft step d of the engine's loop (``QwenMTPRows.draft``): the head over
    (previous step's output, token) with the true pairs before it and the earlier steps' K/V as context."""
    target = TargetModel.load(trained.target_dir)
    corpus = load_corpus(training_dir(trained.out) / "data.npz")
    network = load_provider(trained.out).network
    h, t = mx.array(corpus.hiddens[:1]), mx.array(corpus.tokens[:1])
    outs = chained_outputs(network, target, h, t, chain_masks(h.shape[1], 3))
    for j in (5, 11):
        P = j  # a row that has processed j + 1 tokens drafts step 1 at position j
        _, keys, values = network(target.embed(t[:, :P]), h[:, :P], mx.array([0]), ContextKV(None, None, None))
        context = ContextKV(keys, values, mx.ones((1, P), dtype=mx.bool_))
        hidden = h[:, P:P + 1]
        for step in range(3):
            out, k, v = network(target.embed(t[:, P + step:P + step + 1]), hidden, mx.array([P + step]), context)
            assert mx.allclose(out[0, 0], outs[step][0, P + step], atol=1e-4), (j, step)
            context = ContextKV(mx.concatenate([context.keys, k], axis=2), mx.concatenate([context.values, v], axis=2),
                                mx.ones((1, context.keys.shape[2] + 1), dtype=mx.bool_))
            hidden = out


def test_killed_run_resumes_to_the_uninterrupted_result(trained, tmp_path):
    options = TrainOptions(**{**OPTIONS.__dict__, "steps": 6, "save_every": 3})
    whole = train_head(trained.target_dir, tmp_path / "whole", trained.prompts[:6], options)

    def kill_after_step_4(phase, done, total, loss):
        if phase == "train" and done == 4:
            raise KeyboardInterrupt  # step 4 ran and was not saved: the last save is step 3
    with pytest.raises(KeyboardInterrupt):
        train_head(trained.target_dir, tmp_path / "killed", trained.prompts[:6], options,
                   progress=kill_after_step_4)
    saved = mx.load(str(training_dir(tmp_path / "killed") / STATE_NAME), return_metadata=True)[1]
    assert saved["step"] == "3"
    with pytest.raises(ValueError, match="not empty"):  # a restart without --resume would start over: refused
        train_head(trained.target_dir, tmp_path / "killed", trained.prompts[:6], options)
    resumed = train_head(trained.target_dir, tmp_path / "killed", [], options, resume=True)
    assert resumed.resumed_from == 3 and resumed.step == 6
    assert resumed.losses == whole.losses
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "killed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other options"):
        train_head(trained.target_dir, tmp_path / "killed", [], TrainOptions(**{**options.__dict__, "lr": 1e-2}),
                   resume=True)


# -- the command -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-cli")
    target = write_tiny_target(root / "target")
    rng = np.random.default_rng(2)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(" ".join(f"w{int(i)}" for i in rng.integers(3, 256, size=5)) for _ in range(10)))
    return root, target, prompts


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["train-drafter", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_trains_reports_and_resumes(with_tokenizer, capsys):
    root, target, prompts = with_tokenizer
    out = root / "cli-out"
    small = ["--steps", 4, "--batch", 2, "--seq-len", 16, "--gen-tokens", 12, "--intermediate-size", 32,
             "--save-every", 2, "--eval-tokens", 8]
    code, stdout, stderr = _cli(capsys, "--model", target, "--out", out, "--prompts", prompts, *small, "--json")
    assert code == 0, stdout
    assert "step 2/4 loss" in stderr and "step 4/4 loss" in stderr  # not a terminal: one line per save
    report = json.loads(stdout)
    assert report["steps"] == 4 and report["heldout"]["prompts"] == 1  # 10 prompts: an eighth (1) held out
    assert report["heldout"]["trained"]["identical"] and report["heldout"]["untrained"]["identical"]
    assert cli_main(["identity", str(out)]) == 0
    assert capsys.readouterr().out.strip() == model_identity(out)
    code, stdout, _ = _cli(capsys, "--model", target, "--out", out, "--resume", "--steps", 6, "--no-eval", "--json")
    assert code == 0 and json.loads(stdout)["resumed_from"] == 4 and json.loads(stdout)["steps"] == 6


@pytest.mark.parametrize("case", ["no-model", "model-is-file", "not-a-target", "out-not-empty", "nothing-to-resume",
                                  "no-prompts-file", "bad-lr"])
def test_cli_errors_are_one_line(with_tokenizer, tmp_path, capsys, case):
    root, target, prompts = with_tokenizer
    model, out, extra = target, tmp_path / "out", ["--prompts", prompts]
    if case == "no-model":
        model = tmp_path / "absent"
    elif case == "model-is-file":
        model = prompts
    elif case == "not-a-target":
        model = tmp_path / "bert"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    elif case == "out-not-empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "nothing-to-resume":
        extra.append("--resume")
    elif case == "no-prompts-file":
        extra = ["--prompts", tmp_path / "absent.txt"]
    elif case == "bad-lr":
        extra.extend(["--lr", "5"])
    code, stdout, stderr = _cli(capsys, "--model", model, "--out", out, *extra)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    if case == "not-a-target":
        assert "no target port" in stderr
    if case == "out-not-empty":
        assert (out / "notes.txt").read_text() == "mine" and not (out / "training").exists()
