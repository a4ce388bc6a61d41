"""Tiny real model directories for tests and demos (no download): random weights, real files.

Why one file: every writer draws weights by the same rules from the one architecture table (``_ARCHITECTURES``); the
drafter methods' extra writers live in ``tiny_writers.py``.

``write_tiny_target`` writes ``config.json`` + ``model.safetensors`` that ``mlx_lm.utils.load_model`` loads, plus
a small WordLevel tokenizer (so ``mlx_lm.utils.load`` works offline). ``write_tiny_drafter`` writes a drafter
directory derived from a target directory, so drafts agree with the target often enough to exercise
acceptance:

* ``draft-model``: the target's embeddings, first ``layers`` layers, final norm and head (a real mlx-lm model);
* ``assistant``: one donor-attention block per donor layer (default: every target layer), copied from that
  target layer, with a small random projection of the carried hidden;
* ``ngram``: a ``config.json`` only.

Weights are drawn from ``seed`` with an explicit PRNG key (the global MLX random state is not used): embeddings
``N(0, embed_scale^2)``, matrices ``N(0, (init_scale / sqrt(fan_in))^2)``, the residual-writing projections
further scaled by ``residual_scale``, an untied head. Plain fan-in scaling makes a random model repeat one token;
with these defaults greedy outputs vary (20-40 distinct tokens in 48), derived drafters reach 30-70% acceptance,
and the top-two logit gap along greedy paths stays above 1e-4, far above float32 noise. Adding an architecture means adding
an entry to ``_ARCHITECTURES``. ``gemma3_text`` targets interleave sliding-window layers (window
``sliding_window``, every ``sliding_window_pattern``-th layer global); keep the window smaller than the test
prompts so the rotating caches wrap. ``gemma4_text`` targets add per-layer inputs (``per_layer_input_size``) and
``kv_shared_layers`` trailing layers that reuse earlier layers' K/V. ``qwen3_next`` targets are hybrids: a
full-attention layer every ``full_attention_interval`` layers, gated-delta recurrent layers between.
``write_tiny_adapter`` writes an mlx-lm LoRA adapter for a target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from spec_cache.testing import tiny_writers  # the module, so a test can replace its write_tiny_drafter_extra
from spec_cache.testing.tiny_writers import copied_weight, no_options_left, plain_norm, write_projected

__all__ = ["ARCHITECTURES", "write_tiny_target", "write_tiny_drafter", "write_tiny_adapter", "write_tiny_tokenizer"]

#: model_type -> (HF architecture name, whether the config carries head_dim)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "gemma3_text": ("Gemma3ForCausalLM", True),
    "gemma4_text": ("Gemma4ForCausalLM", True),
    "qwen3_next": ("Qwen3NextForCausalLM", True),
}
ARCHITECTURES = tuple(_ARCHITECTURES)

_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")
_RESIDUAL_SUFFIXES = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
_ONE_SUFFIXES = ("layer_scalar",)  # gemma4's per-layer output scale: random values would shrink the residual


def _model_classes(config: dict) -> tuple[Any, Any]:
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def _random_parameters(
    model: Any, seed: int, init_scale: float, residual_scale: float = 1.0, embed_scale: float = 1.0,
    norm_value: float = 1.0,
) -> None:
    """Re-draw every parameter of ``model`` from ``seed``: matrices scaled by fan-in, biases small, norms one.

    ``residual_scale`` further scales the projections that write into the residual stream (attention output,
    MLP down), i.e. how much each layer changes the token-to-token map of embeddings and head.
    """
    key = mx.random.key(seed)
    drawn = []
    for name, value in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if name.endswith(_NORM_SUFFIXES):
            new = mx.full(value.shape, norm_value, dtype=value.dtype)
        elif name.endswith(_ONE_SUFFIXES):
            new = mx.ones(value.shape, dtype=value.dtype)
        elif name.endswith("conv1d.weight"):  # depthwise [channels, kernel, 1]: the fan-in is the kernel
            new = mx.random.normal(value.shape, key=sub) * (init_scale / value.shape[1] ** 0.5)
        elif name.endswith("embed_tokens.weight"):
            new = mx.random.normal(value.shape, key=sub) * embed_scale
        elif value.ndim >= 2:
            scale = init_scale * (residual_scale if name.endswith(_RESIDUAL_SUFFIXES) else 1.0)
            new = mx.random.normal(value.shape, key=sub) * (scale / value.shape[-1] ** 0.5)
        else:
            new = mx.random.normal(value.shape, key=sub) * 0.02
        drawn.append((name, new.astype(value.dtype)))
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())


def _save(path: Path, config: dict, parameters: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), parameters, metadata={"format": "mlx"})


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over tokens ``<unk> <s> </s> w3 w4 ...`` (ids 0, 1, 2 are unk, bos, eos).

    transformers 5 loads a directory whose config says ``model_type: qwen2`` with its own byte-level Qwen2
    tokenizer class, which splits ``w5`` into pieces; loading works, text encoding does not round-trip there.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(str(path))
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")


#: The tiny tokenizer's chat template (in its ``tokenizer_config.json``): every message is ``<s> ROLE CONTENT
#: </s>`` with the role spelled in vocabulary words (system ``w3``, user ``w4``, assistant ``w5``), and a
#: generation prompt ``<s> w5``; so a templated conversation tokenizes without ``<unk>`` when its contents are
#: ``w<N>`` words, and an assistant turn re-tokenizes to the tokens that were generated.
TINY_CHAT_TEMPLATE = (
    "{% set roles = {'system': 'w3', 'user': 'w4', 'assistant': 'w5'} %}"
    "{% for message in messages %}<s> {{ roles[message['role']] }} {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> w5{% endif %}"
)


def write_tiny_target(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    vocab_size: int = 256,
    tie_word_embeddings: bool = False,
    init_scale: float = 1.0,
    residual_scale: float = 0.5,
    embed_scale: float | None = None,
    tokenizer: bool = True,
    sliding_window: int = 6,
    sliding_window_pattern: int = 2,
    kv_shared_layers: int = 0,
    per_layer_input_size: int = 16,
    full_attention_interval: int = 2,
) -> Path:
    """Write a tiny float32 model of ``arch`` (llama, mistral, qwen2, gemma3_text, gemma4_text, qwen3_next) to
    ``path``; returns the path.

    The default geometry (hidden 128, 2 query heads and 1 KV head of 64) keeps head_dim a multiple of the KV
    quantization group size 64. gemma4_text: ``kv_shared_layers`` trailing layers share K/V (the layers before
    them must include one of each kind), ``per_layer_input_size`` (0: none). qwen3_next: every
    ``full_attention_interval``-th layer is full attention (at least one must be). Raises ValueError for an
    unknown arch or an inconsistent geometry.
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    hf_name, has_head_dim = _ARCHITECTURES[arch]
    if not has_head_dim and hidden_size != num_heads * head_dim:
        raise ValueError(f"{arch} derives head_dim from hidden_size / num_heads; need hidden_size == {num_heads * head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if vocab_size < 4:
        raise ValueError("vocab_size must be at least 4 (unk, bos, eos and one word)")
    config = {
        "model_type": arch,
        "architectures": [hf_name],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if has_head_dim:
        config["head_dim"] = head_dim
    if arch == "gemma3_text":
        config.update(sliding_window=sliding_window, sliding_window_pattern=sliding_window_pattern,
                      query_pre_attn_scalar=head_dim, rope_local_base_freq=10000.0, rms_norm_eps=1e-6)
    if arch == "gemma4_text":
        _gemma4_config(config, num_layers, kv_shared_layers, sliding_window, sliding_window_pattern,
                       per_layer_input_size, head_dim)
    if arch == "qwen3_next":
        _qwen3_next_config(config, num_layers, full_attention_interval, num_heads, head_dim)
    model_class, args_class = _model_classes(config)
    model = model_class(args_class.from_dict(config))
    # gemma scales its embeddings by sqrt(hidden_size) (and gemma3 its norms by (1 + w)): unit-size inputs and
    # zero norm weights make it behave like the other tiny targets (varied greedy output)
    if embed_scale is None:
        embed_scale = hidden_size**-0.5 if arch.startswith("gemma") else 1.0
    _random_parameters(model, seed, init_scale, residual_scale, embed_scale, 0.0 if arch == "gemma3_text" else 1.0)
    path = Path(path)
    _save(path, config, dict(tree_flatten(model.parameters())))
    if tokenizer:
        write_tiny_tokenizer(path, vocab_size)
    return path


def _gemma4_config(config: dict, layers: int, shared: int, window: int, pattern: int, per_layer: int,
                   head_dim: int) -> None:
    kinds = (["sliding_attention"] * (pattern - 1) + ["full_attention"]) * layers
    owners = set(kinds[: layers - shared])
    if not 0 <= shared < layers or owners != set(kinds[:layers]):
        raise ValueError(f"gemma4_text: kv_shared_layers={shared} of {layers} leaves no earlier layer of every kind "
                         "to share K/V from")
    config.update(
        sliding_window=window, sliding_window_pattern=pattern, num_kv_shared_layers=shared, global_head_dim=head_dim,
        hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=config["vocab_size"], rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, tie_word_embeddings=config["tie_word_embeddings"],
    )


def _qwen3_next_config(config: dict, layers: int, interval: int, heads: int, head_dim: int) -> None:
    if not 1 <= interval <= layers:
        raise ValueError(f"qwen3_next: full_attention_interval must be in 1..{layers} (one full-attention layer)")
    config.update(
        full_attention_interval=interval, linear_num_value_heads=2 * heads, linear_num_key_heads=heads,
        linear_key_head_dim=head_dim // 2, linear_value_head_dim=head_dim // 2, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
        mlp_only_layers=[], moe_intermediate_size=0, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
    )


def write_tiny_drafter(path: str | Path, method: str, target_dir: str | Path, seed: int = 0, **options: Any) -> Path:
    """Write a drafter directory for ``method`` derived from the target in ``target_dir``; returns the path.

    Options: ``draft-model``: ``layers`` (how many leading target layers to keep, default 1);
    ``assistant``: ``donor_layers`` (target cache layers to borrow and copy; default all, and on gemma4_text one Gemma 4 block per decoder
    layer over the cache layer it reads), ``hidden_mix`` (scale of
    the random carried-hidden projection, default 0.1); ``ngram``: ``max`` (3), ``min`` (1);
    ``deepspec`` / ``dflash``: ``layers`` (drafter layers, copies of the target's last ones, default 1), ``taps``
    (tap layers, default the input of the first copied layer), ``noise`` (random part of the tap projection,
    default 0.05), ``num_target_layers`` (the depth it claims to be trained for, default the target's);
    ``dflash``: ``gamma`` (block width, default 4; written to ``dspark.json``); ``qwen-mtp`` / ``dflash2``:
    written by ``spec_cache.testing.tiny_writers``.
    """
    path = Path(path)
    if method in ("qwen-mtp", "dflash2"):
        return tiny_writers.write_tiny_drafter_extra(path, method, target_dir, seed, **options)
    if method == "ngram":
        path.mkdir(parents=True, exist_ok=True)
        config = {"method": "ngram", "max": options.pop("max", 3), "min": options.pop("min", 1)}
        no_options_left(method, options)
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return path
    target_dir = Path(target_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    weights = mx.load(str(target_dir / "model.safetensors"))
    if method == "draft-model":
        _write_draft_model(path, target_config, weights, options.pop("layers", 1))
    elif method == "assistant":
        _write_assistant(path, target_config, weights, seed, options.pop("donor_layers", None), options.pop("hidden_mix", 0.1))
    elif method in ("deepspec", "dflash"):
        write_projected(path, method, target_config, weights, seed, options.pop("layers", 1),
                         options.pop("taps", None), options.pop("gamma", 4), options.pop("noise", 0.05),
                         options.pop("num_target_layers", None))
    else:
        raise ValueError(f"unknown drafter method {method!r}; known: assistant, draft-model, ngram, deepspec, dflash, "
                         "qwen-mtp, dflash2")
    no_options_left(method, options)
    return path


def _write_draft_model(path: Path, target_config: dict, weights: dict, layers: int) -> None:
    """The target's first ``layers`` layers as a standalone model. gemma4_text: without KV sharing, its per-layer
    input tables cut to those layers (the draft computes exactly the target's first layers). qwen3_next: the
    target's first ``layers`` *full-attention* layers, all full attention (the draft-model drafter keeps plain
    K/V), so it approximates the target."""
    arch = target_config["model_type"]
    if arch == "qwen3_next":
        _write_attention_draft(path, target_config, weights, layers)
        return
    total = target_config["num_hidden_layers"] - target_config.get("num_kv_shared_layers", 0)
    if not 1 <= layers <= total:
        raise ValueError(f"draft-model layers must be in 1..{total}, got {layers}")
    config = dict(target_config, num_hidden_layers=layers)
    kept = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= layers:
                continue
        kept[name] = value
    if arch == "gemma4_text":
        config["num_kv_shared_layers"] = 0
        width = layers * target_config["hidden_size_per_layer_input"]
        if width:  # layer i reads columns [i * P, (i + 1) * P) of both per-layer tables
            kept["model.embed_tokens_per_layer.weight"] = kept["model.embed_tokens_per_layer.weight"][:, :width]
            kept["model.per_layer_model_projection.weight"] = kept["model.per_layer_model_projection.weight"][:width]
    _save(path, config, kept)


def _write_attention_draft(path: Path, target_config: dict, weights: dict, layers: int) -> None:
    interval = target_config["full_attention_interval"]
    sources = [i for i in range(target_config["num_hidden_layers"]) if (i + 1) % interval == 0]
    if not 1 <= layers <= len(sources):
        raise ValueError(f"draft-model layers must be in 1..{len(sources)} (the target's full-attention layers), "
                         f"got {layers}")
    config = dict(target_config, num_hidden_layers=layers, full_attention_interval=1)
    renumber = {source: index for index, source in enumerate(sources[:layers])}
    kept = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            parts = name.split(".")
            if int(parts[2]) not in renumber:
                continue
            name = ".".join(parts[:2] + [str(renumber[int(parts[2])])] + parts[3:])
        kept[name] = value
    _save(path, config, kept)


def _write_assistant(
    path: Path, target_config: dict, weights: dict, seed: int, donor_layers: list | None, hidden_mix: float
) -> None:
    """One drafter block per donor, each a copy of a target layer. gemma4_text: Gemma 4 blocks (``block_style``
    ``gemma4``); by default one block per *decoder* layer, each reading the cache layer that decoder layer reads
    (a KV-shared layer borrows an earlier layer's K/V), so the drafter mirrors the whole target stack."""
    from spec_cache.drafters.assistant import AssistantConfig, AssistantNetwork

    gemma4 = target_config["model_type"] == "gemma4_text"
    # donors index the target's cache layers (gemma4_text's trailing KV-shared layers hold none)
    total = target_config["num_hidden_layers"] - target_config.get("num_kv_shared_layers", 0)
    if donor_layers is not None:
        donors = [int(layer) % total for layer in donor_layers]
        copies = list(donors)
    elif gemma4:
        donors = _gemma4_kv_sources(target_config)
        copies = list(range(len(donors)))
    else:
        donors = copies = list(range(total))
    heads = target_config["num_attention_heads"]
    head_dim = target_config.get("head_dim") or target_config["hidden_size"] // heads
    attention_bias = any(name.endswith("self_attn.q_proj.bias") for name in weights)
    intermediate = target_config["intermediate_size"]
    widths = [int(weights[f"model.layers.{layer}.mlp.gate_proj.weight"].shape[0]) for layer in copies]
    config = AssistantConfig(
        hidden_size=target_config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=target_config["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=intermediate,
        donor_layers=tuple(donors),
        vocab_size=target_config["vocab_size"],
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-5),
        attention_bias=attention_bias,
        block_style="gemma4" if gemma4 else "llama",
        intermediate_sizes=None if set(widths) <= {intermediate} else tuple(widths),
    )
    network = AssistantNetwork(config)
    hidden = config.hidden_size
    key = mx.random.key(seed)
    drawn = {
        "hidden_norm.weight": mx.ones((hidden,)),
        "input_proj.weight": mx.random.normal((hidden, hidden), key=key) * (hidden_mix / hidden**0.5),
        "norm.weight": plain_norm(target_config, weights["model.norm.weight"]),
    }
    copied = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight",
              "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    if attention_bias:
        copied += ("self_attn.q_proj.bias",)
    if gemma4:
        copied += ("self_attn.q_norm.weight", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
    for index, layer in enumerate(copies):
        for name in copied:
            drawn[f"layers.{index}.{name}"] = copied_weight(target_config, name, weights[f"model.layers.{layer}.{name}"])
    network.load_weights(list(drawn.items()), strict=True)
    _save(path, config.to_dict(), dict(tree_flatten(network.parameters())))


def _gemma4_kv_sources(target_config: dict) -> list[int]:
    """For each gemma4_text decoder layer, the cache layer whose K/V it attends to (mlx-lm's ``previous_kvs``)."""
    model_class, args_class = _model_classes(target_config)
    return list(model_class(args_class.from_dict(target_config)).model.previous_kvs)


def write_tiny_adapter(
    path: str | Path,
    target_dir: str | Path,
    seed: int = 0,
    *,
    rank: int = 4,
    scale: float = 2.0,
    num_layers: int | None = None,
    keys: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
) -> Path:
    """Write an mlx-lm LoRA adapter directory (``adapter_config.json`` + ``adapters.safetensors``) for the target
    in ``target_dir``: ``rank``-``rank`` updates of ``keys`` in the last ``num_layers`` layers (default: all),
    both LoRA factors drawn from ``seed`` (mlx-lm initializes ``lora_b`` to zero; a trained adapter is not), so
    the adapter changes the target's output. Loads with ``mlx_lm.utils.load(target, adapter_path=path)``."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, config = load_model(Path(target_dir))
    layers = config["num_hidden_layers"] if num_layers is None else num_layers
    lora = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, layers, lora)
    key = mx.random.key(seed)
    drawn = {}
    for name, value in tree_flatten(model.parameters()):
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            key, sub = mx.random.split(key)
            drawn[name] = (mx.random.normal(value.shape, key=sub) * (value.shape[0] ** -0.5)).astype(value.dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter_config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": lora}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "adapters.safetensors"), drawn)
    return path
