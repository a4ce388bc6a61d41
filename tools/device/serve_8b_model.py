"""Write issue 27's bench model: a Llama-3-8B-shaped llama with random bf16 weights carrying SmolLM2-135M-Instruct's
tokenizer and chat template (so the servers template and tokenize a real chat; its vocabulary, 49152, sets the
embedding's size).

    python tools/device/serve_8b_model.py --tok .gpu/serve/tok --out /tmp/serve-8b/model

Why here and not from a hub: the lent GPU reaches nothing outside, a call carries at most 64 MiB, and 15 GB of
random weights are faster to make on the device than to move. The weights come straight from ``mx.random`` (seed 0,
the same model on every machine), one safetensors shard per ``--layers-per-shard`` layers, so the host never holds
more than a shard; RMSNorm weights are ones, projections N(0, 1/fan_in) (output projections halved) so activations
stay finite through 32 layers. Idempotent: a directory whose ``shape.json`` matches is left as it is.

The shape comes from the environment (defaults: the 8B shape): LAYERS 32, HIDDEN 4096, HEADS 32, KV_HEADS 8,
HEAD_DIM 128, INTER 14336, VOCAB 49152, DTYPE bfloat16. For a CPU check: LAYERS=2 HIDDEN=64 HEADS=4 KV_HEADS=2
HEAD_DIM=16 INTER=128.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

#: the files of ``spec-cache convert-gguf``'s SmolLM2 output that make the tokenizer and chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


def shape_from_env(env=os.environ) -> dict:
    def num(name: str, default: int) -> int:
        return int(env.get(name, default))

    return {"layers": num("LAYERS", 32), "hidden": num("HIDDEN", 4096), "heads": num("HEADS", 32),
            "kv_heads": num("KV_HEADS", 8), "head_dim": num("HEAD_DIM", 128), "inter": num("INTER", 14336),
            "vocab": num("VOCAB", 49152), "dtype": env.get("DTYPE", "bfloat16")}


def config(shape: dict) -> dict:
    """An mlx-lm ``llama`` config for ``shape`` (Llama-3's rope and norm settings; SmolLM2's special token ids)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": shape["hidden"],
            "num_hidden_layers": shape["layers"], "intermediate_size": shape["inter"],
            "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
            "head_dim": shape["head_dim"], "rms_norm_eps": 1e-5, "vocab_size": shape["vocab"],
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "torch_dtype": shape["dtype"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def tensors(shape: dict) -> list[tuple[int, str, tuple[int, ...]]]:
    """(layer or -1, name, shape) of every weight, in mlx-lm's llama naming (layer -1: embeddings, final norm, head)."""
    h, hd, inter = shape["hidden"], shape["head_dim"], shape["inter"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    out = [(-1, "model.embed_tokens.weight", (shape["vocab"], h))]
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        out += [(i, p + "self_attn.q_proj.weight", (q, h)), (i, p + "self_attn.k_proj.weight", (kv, h)),
                (i, p + "self_attn.v_proj.weight", (kv, h)), (i, p + "self_attn.o_proj.weight", (h, q)),
                (i, p + "mlp.gate_proj.weight", (inter, h)), (i, p + "mlp.up_proj.weight", (inter, h)),
                (i, p + "mlp.down_proj.weight", (h, inter)),
                (i, p + "input_layernorm.weight", (h,)), (i, p + "post_attention_layernorm.weight", (h,))]
    out += [(-1, "model.norm.weight", (h,)), (-1, "lm_head.weight", (shape["vocab"], h))]
    return out


def write(out: Path, tok: Path, shape: dict, layers_per_shard: int = 4) -> bool:
    """Write the model to ``out``; False when an identical one is already there."""
    import mlx.core as mx

    marker = out / "shape.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return False
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (tok / f).exists()]
    if missing:
        raise SystemExit(f"{tok}: no {', '.join(missing)} (SmolLM2's tokenizer files; see .gpu/serve/tok)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dtype = getattr(mx, shape["dtype"])
    mx.random.seed(0)
    groups: dict[int, list] = {}
    for layer, name, dims in tensors(shape):
        groups.setdefault(-1 if layer < 0 else layer // layers_per_shard, []).append((name, dims))
    order = sorted(groups, key=lambda g: (g < 0, g))  # layers first, then embeddings and head
    for n, g in enumerate(order, 1):
        params = {}
        for name, dims in groups[g]:
            if name.endswith("norm.weight"):
                params[name] = mx.ones(dims, dtype=dtype)
            elif name.endswith("embed_tokens.weight"):
                params[name] = mx.random.normal(dims, dtype=dtype)
            else:
                scale = (0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0) / dims[-1] ** 0.5
                params[name] = mx.random.normal(dims, dtype=dtype, scale=scale)
        mx.eval(params)
        mx.save_safetensors(str(out / f"model-{n:05d}-of-{len(order):05d}.safetensors"), params,
                            metadata={"format": "mlx"})
        del params
    (out / "config.json").write_text(json.dumps(config(shape), indent=1))
    for f in TOKENIZER_FILES:
        if (tok / f).exists():
            shutil.copy(tok / f, out / f)
    marker.write_text(json.dumps(shape))  # last: a half-written directory is rewritten next time
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tok", default=".gpu/serve/tok", help="SmolLM2's tokenizer files")
    p.add_argument("--out", default="/tmp/serve-8b/model")
    p.add_argument("--layers-per-shard", type=int, default=4)
    args = p.parse_args(argv)
    shape = shape_from_env()
    started = time.perf_counter()
    wrote = write(Path(args.out), Path(args.tok), shape, args.layers_per_shard)
    size = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    print(f"model {'written' if wrote else 'already there'}: {args.out} ({size / 2**30:.2f} GiB, "
          f"{time.perf_counter() - started:.1f} s) shape {shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
