"""Tiny random-weight drafter directories for the methods this package adds (``qwen-mtp``, ``dflash2``),
derived from a tiny target directory as ``spec_cache.testing.tiny`` derives the others (``tiny.write_tiny_drafter``
dispatches these methods here).

* ``qwen-mtp``: the MTP head's layer copies the target's first full-attention layer (for a ``qwen3_next``
  target: gated attention, q/k norms, partial RoPE, as Qwen3-Next's MTP layer) and ``fc`` passes the normed
  embedding of the pair's token through (plus ``hidden_mix`` of the target hidden), so on a llama-layout target
  the head behaves like a one-layer truncation of the target shifted by one position: drafts agree with the
  target part of the time.
* ``dflash2``: a tiny DFlash drafter (as ``tiny.write_tiny_drafter(..., "dflash")`` writes it) rewritten as a
  DFlash 2 ``config.json`` with ``draft_bits`` (default 4: projections quantized at load).

The projected writers (``deepspec`` / ``dflash``: :func:`write_projected`, llama-layout and gemma4_text) and the
weight-copy helpers live here too, because dflash2 builds on them; this module imports nothing of ``tiny``
(``tiny`` imports it), so the two never form an import circle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

__all__ = ["write_tiny_drafter_extra", "EXTRA_METHODS"]

#: the methods :func:`write_tiny_drafter_extra` writes
EXTRA_METHODS = ("qwen-mtp", "dflash2")


def write_tiny_drafter_extra(path: str | Path, method: str, target_dir: str | Path, seed: int = 0,
                             **options: Any) -> Path:
    """Write a ``method`` drafter directory derived from the target in ``target_dir``; returns the path.

    Options: ``qwen-mtp``: ``hidden_mix`` (0.1; weight of the target hidden in ``fc``), ``vocab_size`` /
    ``hidden_size`` (override what the config claims, for pairing tests); ``dflash2``: ``draft_bits`` (4),
    ``draft_group_size`` (64) and the ``dflash`` options of ``tiny.write_tiny_drafter`` (``gamma``, ``layers``,
    ``taps``, ``noise``, ``num_target_layers``).
    """
    path = Path(path)
    if method == "qwen-mtp":
        _write_qwen_mtp(path, Path(target_dir), seed, **options)
    elif method == "dflash2":
        _write_dflash2(path, Path(target_dir), seed, **options)
    else:
        raise ValueError(f"unknown drafter method {method!r} for write_tiny_drafter_extra; known: "
                         f"{', '.join(EXTRA_METHODS)}")
    return path


def plain_norm(target_config: dict, weight: mx.array) -> mx.array:
    """A target norm weight for the drafters' plain RMSNorm (gemma norms multiply by ``1 + w``)."""
    return weight + 1.0 if target_config["model_type"] == "gemma3_text" else weight


def copied_weight(target_config: dict, name: str, weight: mx.array) -> mx.array:
    return plain_norm(target_config, weight) if name.endswith("norm.weight") else weight


def no_options_left(method: str, options: dict) -> None:
    if options:
        raise TypeError(f"unknown option(s) for {method}: {', '.join(sorted(options))}")


def _write_qwen_mtp(path: Path, target_dir: Path, seed: int, hidden_mix: float = 0.1,
                    vocab_size: int | None = None, hidden_size: int | None = None) -> None:
    from spec_cache.drafters.qwen_mtp import QwenMTPConfig, QwenMTPNetwork

    target_config = json.loads((target_dir / "config.json").read_text())
    weights = mx.load(str(target_dir / "model.safetensors"))
    # the head copies the target's first full-attention layer (Qwen3-Next: gated, q/k-normed, partial RoPE)
    donor = min(int(name.split(".")[2]) for name in weights if name.endswith(".self_attn.q_proj.weight"))
    prefix = f"model.layers.{donor}."
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads
    qk_norm = prefix + "self_attn.q_norm.weight" in weights
    config = QwenMTPConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=target_config["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=target_config["intermediate_size"],
        vocab_size=target_config["vocab_size"],
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6),
        rope_theta=target_config.get("rope_theta", 10000.0),
        qk_norm=qk_norm,
        attn_output_gate=weights[prefix + "self_attn.q_proj.weight"].shape[0] == 2 * heads * head_dim,
        partial_rotary_factor=target_config.get("partial_rotary_factor", 1.0),
    )
    network = QwenMTPNetwork(config)
    noise = mx.random.normal((hidden, hidden), key=mx.random.key(seed)) * (hidden_mix / hidden**0.5)
    drawn = {
        "pre_fc_norm_embedding.weight": mx.ones((hidden,)),
        "pre_fc_norm_hidden.weight": mx.ones((hidden,)),
        "fc.weight": mx.concatenate([mx.eye(hidden), noise], axis=1),
        "norm.weight": plain_norm(target_config, weights["model.norm.weight"]),
    }
    copied = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    copied += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if qk_norm else []
    for name in copied:
        weight = weights[prefix + name]
        drawn[f"layers.0.{name}"] = copied_weight(target_config, name, weight)
    network.load_weights(list(drawn.items()), strict=True)
    stored = config.to_dict()
    stored.update({key: value for key, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size))
                   if value is not None})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(network.parameters())),
                        metadata={"format": "mlx"})


def _write_dflash2(path: Path, target_dir: Path, seed: int, draft_bits: int = 4, draft_group_size: int = 64,
                   **dflash_options: Any) -> None:
    target_config = json.loads((target_dir / "config.json").read_text())
    weights = mx.load(str(target_dir / "model.safetensors"))
    write_projected(path, "dflash", target_config, weights, seed, dflash_options.pop("layers", 1),
                    dflash_options.pop("taps", None), dflash_options.pop("gamma", 4), dflash_options.pop("noise", 0.05),
                    dflash_options.pop("num_target_layers", None))
    no_options_left("dflash", dflash_options)
    dspark = path / "dspark.json"
    config = json.loads(dspark.read_text())
    config.update(method="dflash2", draft_bits=draft_bits, draft_group_size=draft_group_size)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    dspark.unlink()


def write_projected_gemma4(path: Path, method: str, target_config: dict, weights: dict, seed: int, layers: int,
                           taps: list | None, gamma: int, noise: float, num_target_layers: int | None) -> None:
    """A ``deepspec`` / ``dflash`` drafter for a ``gemma4_text`` target (``write_projected`` dispatches
    here): its one layer copies the target's last *cache-holding* layer ``d`` (the KV-shared layers after it have
    no K/V projections of their own), mapped onto the drafter's pre-norm block (``q_norm``/``k_norm`` kept,
    ``pre_feedforward_layernorm`` as the MLP's input norm, the GeGLU weights under SwiGLU), and taps the output
    of layer ``d - 1`` through ``fc`` ~ identity, so the context approximates layer ``d``'s own K/V. Drafts
    agree with the target only now and then; the tests check exactness, restore and batching."""
    from spec_cache.drafters.projected import ProjectedConfig, ProjectedNetwork

    if layers != 1:
        raise ValueError(f"{method} on gemma4_text: the tiny writer copies one layer, got layers={layers}")
    total = target_config["num_hidden_layers"]
    donor = total - target_config.get("num_kv_shared_layers", 0) - 1
    taps = [max(donor - 1, 0)] if taps is None else [int(t) % (total + 1) for t in taps]
    hidden = target_config["hidden_size"]
    prefix = f"model.layers.{donor}."
    heads = target_config["num_attention_heads"]
    head_dim = int(weights[prefix + "self_attn.q_norm.weight"].shape[0])
    config = ProjectedConfig(
        method=method, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=int(weights[prefix + "self_attn.k_proj.weight"].shape[0]) // head_dim,
        head_dim=head_dim, intermediate_size=int(weights[prefix + "mlp.gate_proj.weight"].shape[0]),
        vocab_size=target_config["vocab_size"], target_layer_ids=tuple(taps),
        num_target_layers=total if num_target_layers is None else num_target_layers, target_hidden_size=hidden,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6), rope_theta=target_config.get("rope_theta", 10000.0),
        qk_norm=True, gamma=gamma if method == "dflash" else 0, mask_token_id=0,
    )
    network = ProjectedNetwork(config)
    passthrough = mx.concatenate([mx.zeros((hidden, hidden * (len(taps) - 1))), mx.eye(hidden)], axis=1)
    drawn = {
        "fc.weight": passthrough + mx.random.normal(passthrough.shape, key=mx.random.key(seed)) * (noise / hidden**0.5),
        "hidden_norm.weight": weights[prefix + "input_layernorm.weight"],
        "norm.weight": weights["model.norm.weight"],
        "layers.0.post_attention_layernorm.weight": weights[prefix + "pre_feedforward_layernorm.weight"],
    }
    for name in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        drawn[f"layers.0.{name}"] = weights[prefix + name]
    network.load_weights(list(drawn.items()), strict=True)
    save_projected(path, method, config, network)


def save_projected(path: Path, method: str, config, network) -> None:
    """A projected drafter directory: its config (``dspark.json`` for dflash, else ``config.json``) and weights."""
    path.mkdir(parents=True, exist_ok=True)
    config_name = "dspark.json" if method == "dflash" else "config.json"
    (path / config_name).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(network.parameters())),
                        metadata={"format": "mlx"})


def set_block_size(path: str | Path, block_size: int, mask_token_id: int = 0) -> Path:
    """Give the DeepSpec drafter in ``path`` the seed's ``block_size`` (and ``mask_token_id``): it then drafts
    one block per round and slices it. Its identity (and so its namespace) changes with its config."""
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(block_size=block_size, mask_token_id=mask_token_id)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(path)


def write_projected(path: Path, method: str, target_config: dict, weights: dict, seed: int, layers: int,
                     taps: list | None, gamma: int, noise: float, num_target_layers: int | None) -> None:
    """A projected-context drafter whose layers copy the target's last ``layers`` layers.

    The context of the first copied layer ``d`` should be that layer's input: the tap is the output of layer
    ``d - 1``, ``fc`` passes it through (plus ``noise``) and ``hidden_norm`` is layer ``d``'s input norm, so the
    drafter's context K/V approximate the target's own K/V of layer ``d``. The drafted tokens enter as plain
    embeddings (skipping layers ``0..d-1``), which is what makes the drafts imperfect.
    """
    from spec_cache.drafters.projected import ProjectedConfig, ProjectedNetwork

    if target_config["model_type"] == "gemma4_text":  # KV-shared layers, Gemma 4 blocks
        return write_projected_gemma4(path, method, target_config, weights, seed, layers, taps, gamma, noise,
                                      num_target_layers)
    total = target_config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ValueError(f"{method} layers must be in 1..{total}, got {layers}")
    first = total - layers
    taps = [max(first - 1, 0)] if taps is None else [int(t) % total for t in taps]
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    config = ProjectedConfig(
        method=method,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=target_config["num_key_value_heads"],
        head_dim=target_config.get("head_dim") or hidden // heads,
        intermediate_size=target_config["intermediate_size"],
        vocab_size=target_config["vocab_size"],
        target_layer_ids=tuple(taps),
        num_target_layers=total if num_target_layers is None else num_target_layers,
        target_hidden_size=hidden,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6),
        rope_theta=target_config.get("rope_theta", 10000.0),
        qk_norm=False,
        gamma=gamma if method == "dflash" else 0,
        mask_token_id=0,
    )
    network = ProjectedNetwork(config)
    key = mx.random.key(seed)
    passthrough = mx.concatenate([mx.zeros((hidden, hidden * (len(taps) - 1))), mx.eye(hidden)], axis=1)
    drawn = {
        "fc.weight": passthrough + mx.random.normal(passthrough.shape, key=key) * (noise / hidden**0.5),
        "hidden_norm.weight": plain_norm(target_config, weights[f"model.layers.{first}.input_layernorm.weight"]),
        "norm.weight": plain_norm(target_config, weights["model.norm.weight"]),
    }
    copied = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    for index in range(layers):
        for name in copied:
            drawn[f"layers.{index}.{name}"] = copied_weight(target_config, name,
                                                      weights[f"model.layers.{first + index}.{name}"])
    network.load_weights(list(drawn.items()), strict=True)
    save_projected(path, method, config, network)
