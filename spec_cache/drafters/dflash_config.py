"""Which file configures a DFlash drafter directory, and the published ``config.json`` layout mapped onto ours.

A DFlash drafter directory is configured by one of two files:

* ``dspark.json``: this project's own layout (``ProjectedConfig`` keys: ``gamma``, ``mask_token_id``,
  ``target_layer_ids``, ...). It wins when both files are present, so existing directories keep their namespace
  ``dflash-context-v1:<identity over dspark.json + weights>``.
* ``config.json`` as published with DFlash drafters (z-lab's ``*-DFlash`` checkpoints: ``architectures:
  ["DFlashDraftModel"]``, a Qwen3-style ``model_type``, and a ``dflash_config`` object). Its namespace is
  ``dflash-context-v1:<identity over config.json + weights>`` (new namespace bytes for a new config input).

The published fields map onto the same drafter: ``dflash_config.target_layer_ids`` (tap layers: the output of
target layer ``i``, which is HF's ``hidden_states[i + 1]``), ``dflash_config.mask_token_id``, ``block_size``
(top level; ``dflash_config.block_size`` in later revisions; the top level wins) -> ``gamma``, ``rope_theta``
(top level, else ``rope_parameters.rope_theta``), and the usual geometry keys (``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
``vocab_size``, ``rms_norm_eps``, ``num_target_layers``); q/k norms are always on (Qwen3 attention). The drafter
shares the target's embeddings and head, as published (a ``final_logit_softcapping`` in the drafter's config is
not applied twice: the target's head brings the target's own cap). ``layer_types`` / ``sliding_window`` /
``is_causal`` as z-lab's MLX drafter reads them: a sliding layer attends to the last ``sliding_window - 1``
context positions and causally inside the block. Refused (ValueError, never a silent wrong draft):
``attention_bias``, RoPE scaling other than the default, and the options of z-lab's later drafters this network
lacks (``conv_kernel_size``, ``selector_rank``/``selector_top_k``, ``input_embedding_scale``/``output_multiplier``
other than 1).

No MLX import here: ``detect_method`` reads this without loading a runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

from spec_cache.errors import ModelLoadError, UnsupportedCombination

__all__ = ["DSPARK_NAME", "PUBLISHED_NAME", "is_published_dflash", "published_to_projected", "read_dflash_config"]

DSPARK_NAME = "dspark.json"
PUBLISHED_NAME = "config.json"

#: z-lab options of later drafters (DFlash 2 convolutions, a candidate selector, scaled inputs/outputs) this
#: network does not have: refused unless at their neutral value
_UNSUPPORTED = {"conv_kernel_size": 0, "selector_rank": 0, "selector_top_k": 0, "input_embedding_scale": 1.0,
                "output_multiplier": 1.0}
_GEOMETRY = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "num_target_layers")


def is_published_dflash(config: object) -> bool:
    """Whether a parsed ``config.json`` is a published DFlash drafter's (``dflash_config`` or a DFlash
    architecture name, and no project ``"method"``)."""
    if not isinstance(config, dict) or "method" in config:
        return False
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and any(isinstance(a, str) and "DFlash" in a for a in architectures)
    return isinstance(config.get("dflash_config"), dict) or named


def published_to_projected(config: dict) -> dict:
    """The ``ProjectedConfig`` dict (method ``dflash``) of a published DFlash ``config.json``; ValueError for a
    layout this drafter cannot run exactly."""
    inner = config.get("dflash_config") or {}
    if not isinstance(inner, dict):
        raise ModelLoadError(f"published DFlash config: dflash_config must be an object, got {inner!r}")
    missing = [key for key in _GEOMETRY if key not in config]
    taps = inner.get("target_layer_ids", config.get("target_layer_ids"))
    mask = inner.get("mask_token_id", config.get("mask_token_id"))
    gamma = config.get("block_size", inner.get("block_size"))
    missing += [name for name, value in (("dflash_config.target_layer_ids", taps),
                                         ("dflash_config.mask_token_id", mask), ("block_size", gamma)) if value is None]
    if missing:
        raise ModelLoadError(f"published DFlash config is missing {', '.join(missing)}")
    if config.get("attention_bias"):
        raise UnsupportedCombination("published DFlash config: attention_bias is not supported")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) != default:
            raise UnsupportedCombination(f"published DFlash config: {key}={config[key]!r} is not supported "
                                         f"(this drafter runs {key}={default!r})")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for source in (rope, scaling):
        kind = source.get("rope_type", source.get("type", "default")) if isinstance(source, dict) else "?"
        if kind != "default":
            raise UnsupportedCombination(f"published DFlash config: RoPE type {kind!r} is not supported (default only)")
    theta = config.get("rope_theta", rope.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    heads = config["num_attention_heads"]
    out = {key: config[key] for key in _GEOMETRY}
    out.update(
        method="dflash",
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        target_layer_ids=taps,
        mask_token_id=mask,
        gamma=gamma,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        qk_norm=True,
    )
    for key in ("target_hidden_size", "sts", "minConf", "layer_types", "sliding_window", "is_causal"):
        if key in config:
            out[key] = config[key]
    return out


def read_dflash_config(model_dir: str | Path) -> tuple[dict, str]:
    """``(ProjectedConfig dict, the file it came from)`` of a DFlash drafter directory: ``dspark.json`` if
    present, else a published ``config.json``; FileNotFoundError when neither configures a DFlash drafter."""
    path = Path(model_dir)
    if (path / DSPARK_NAME).is_file():
        return json.loads((path / DSPARK_NAME).read_text()), DSPARK_NAME
    published = path / PUBLISHED_NAME
    if published.is_file():
        config = json.loads(published.read_text())
        if is_published_dflash(config):
            return published_to_projected(config), PUBLISHED_NAME
    raise FileNotFoundError(f"DFlash drafter directory {path} has no {DSPARK_NAME} (nor a published DFlash "
                            f"{PUBLISHED_NAME} with dflash_config)")
