"""Issue 38 item 4: ``spec-cache import-seed FILE.mlxkv`` / ``seed_codec.import_seed`` store a seed (mlx-bun) file's
target caches as a spec-cache entry, checked whole first (issue 37's shape: nothing stored from a refused file).

The files are built byte for byte from the seed's documented layout (``../shared/reference/seed-design.md`` 3.3:
magic ``MLXBUNKV2\\n``, u32 LE header length, u32 LE data start, u64 LE ``Bun.hash`` of the JSON header; tensors
at 16 KiB-aligned offsets from the data start; header ``{formatVersion, createdAt, modelId, configFingerprint, ns,
tokenizerHash, codecProvider, tokens, caches, attachments?}``, cache entries ``{kind, offset, idx?, maxSize?,
groupSize?, bits?, minimumReusableOffset?, tensors: [{off, bytes, shape, dtype, hash}]}``), with target K/V from
a forward of the tiny model. The round trip: an imported entry restores and the tokens after it equal a cold run
(greedy, float32); hostile files give a one-line ``SeedFormatError`` (CLI: one stderr line, exit code non-zero)
and leave the store empty.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from spec_cache.apps.cli import main as cli_main
from spec_cache.convert.seed_codec import SeedFormatError, import_seed, wyhash
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import KVOptions, drafter_namespace, prefix_namespace
from spec_cache.rows.target import TargetModel
from spec_cache.store import Store, maintenance
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.tiers.cache import SpecCache

ALIGN = 16384
F32, BF16, U32 = 10, 12, 3  # mlx-c mlx_dtype numbers, as mlx-bun's FFI has them
PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 130, 77, 12, 200]
COVERED = PROMPT[:9]  # the seed's boundary snapshot covers a prefix of the prompt


def js(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def forward_caches(model_dir, tokens):
    """The target's caches after one forward over ``tokens`` (what a seed engine would hold)."""
    target = TargetModel.load(model_dir)
    caches = make_prompt_cache(target.model)
    target.model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def layer_of(cache, length) -> dict:
    """A seed ``caches[i]`` entry (kind, offset, params) with its tensors as numpy arrays (``_arrays``)."""
    keys, values = (np.array(a[..., :length, :]) for a in (cache.keys, cache.values))
    entry = {"kind": "kv", "offset": length, "_arrays": [(keys, F32), (values, F32)]}
    if type(cache).__name__ == "RotatingKVCache":
        entry.update(kind="rotating", idx=length, maxSize=cache.max_size)
    return entry


def tokenizer_hash(model_dir) -> str:
    return format(wyhash((model_dir / "tokenizer.json").read_bytes()), "x")  # Bun.hash(...).toString(16)


def mlxkv(tokens, layers, *, tok_hash="0", ns="", fingerprint="0123456789abcdef-bf16-1a2b", version=3,
          attachments=(), codec="mlx-cache-v3", corrupt=False, header_extra=None) -> bytes:
    blobs, cursor, caches = [], 0, []
    for layer in layers:
        slots = []
        for arr, dtype in layer["_arrays"]:
            off = -(-cursor // ALIGN) * ALIGN
            data = np.ascontiguousarray(arr).tobytes()
            blobs.append((off, data))
            cursor = off + len(data)
            slots.append({"off": off, "bytes": len(data), "shape": list(arr.shape), "dtype": dtype,
                          "hash": format(wyhash(data), "016x")})
        caches.append({**{k: v for k, v in layer.items() if k != "_arrays"}, "tensors": slots})
    header = {"formatVersion": version, "createdAt": 1767225600000, "modelId": "tiny", "configFingerprint": fingerprint,
              "ns": ns, "tokenizerHash": tok_hash, "codecProvider": codec, "tokens": list(tokens), "caches": caches}
    if attachments:
        header["attachments"] = list(attachments)
    header.update(header_extra or {})
    head = js(header)
    data_start = -(-(26 + len(head)) // ALIGN) * ALIGN
    out = bytearray(data_start + cursor)
    out[:26] = b"MLXBUNKV2\n" + len(head).to_bytes(4, "little") + data_start.to_bytes(4, "little") + \
        wyhash(head).to_bytes(8, "little")
    out[26:26 + len(head)] = head
    for off, data in blobs:
        out[data_start + off:data_start + off + len(data)] = data
    if corrupt:
        out[data_start + blobs[-1][0] + 3] ^= 1
    return bytes(out)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("seed-import") / "llama", seed=7)
    cold = Generator.load(path).generate([PROMPT], max_tokens=12)[0].tokens
    return path, [layer_of(c, len(COVERED)) for c in forward_caches(path, COVERED)], cold


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("seed-import") / "gemma", arch="gemma3_text", seed=3)
    return path


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "memo"))
    return tmp_path / "store"


def entries(store_dir) -> int:
    """How many entries the store at ``store_dir`` holds (in LMDB: a refused import must leave none)."""
    if not store_dir.exists():
        return 0
    with Store.open(store_dir) as store:
        return len(maintenance.entries(store))


def test_an_imported_seed_entry_restores_and_continues_as_a_cold_run(llama, store_dir, tmp_path):
    path, layers, cold = llama
    file = tmp_path / "entry.mlxkv"
    file.write_bytes(mlxkv(COVERED, layers, tok_hash=tokenizer_hash(path)))
    with SpecCache.open(store_dir) as cache:
        done = import_seed(cache, file, path)
        assert done.tokens == len(COVERED) and done.attachments_skipped == 0
        assert done.prefix_namespace == prefix_namespace(None, "", KVOptions())
    with SpecCache.open(store_dir) as cache:  # reopened: the entry is in LMDB
        gen = Generator.load(path, cache=cache)
        assert gen.ns_key == done.ns_key
        result = gen.generate([PROMPT], max_tokens=12)[0]
        assert result.cached_tokens == len(COVERED)
        assert result.tokens == cold
        ngram = Generator.load(path, "ngram", cache=cache)  # a drafter of this target: through the target-only ns
        other = COVERED + [3, 4, 250]  # diverges from PROMPT (whose run stored more) right after the import
        result = ngram.generate([other], max_tokens=8)[0]
        assert result.cached_tokens == len(COVERED)
        assert result.tokens == Generator.load(path).generate([other], max_tokens=8)[0].tokens


def test_a_drafter_namespace_with_the_same_kv_options_is_accepted(llama, store_dir, tmp_path):
    path, layers, _ = llama
    ns = prefix_namespace(drafter_namespace("dflash-context-v1", "ab" * 32), "", KVOptions())
    file = tmp_path / "entry.mlxkv"
    file.write_bytes(mlxkv(COVERED, layers, tok_hash=tokenizer_hash(path), ns=ns))
    with SpecCache.open(store_dir) as cache:
        assert import_seed(cache, file, path).tokens == len(COVERED)


def test_a_sliding_window_layer_before_its_ring_wraps_is_imported(gemma, store_dir, tmp_path):
    covered = PROMPT[:5]  # window 6: the ring has not wrapped
    layers = [layer_of(c, len(covered)) for c in forward_caches(gemma, covered)]
    assert layers[0]["kind"] == "rotating" and layers[1]["kind"] == "kv"
    file = tmp_path / "entry.mlxkv"
    file.write_bytes(mlxkv(covered, layers, tok_hash=tokenizer_hash(gemma)))
    with SpecCache.open(store_dir) as cache:
        import_seed(cache, file, gemma)
    prompt = PROMPT[:8]
    cold = Generator.load(gemma).generate([prompt], max_tokens=10)[0].tokens
    with SpecCache.open(store_dir) as cache:
        result = Generator.load(gemma, cache=cache).generate([prompt], max_tokens=10)[0]
    assert result.cached_tokens == len(covered) and result.tokens == cold


def _refused(store_dir, file, model, match, **kw):
    with SpecCache.open(store_dir) as cache:
        with pytest.raises(SeedFormatError, match=match) as info:
            import_seed(cache, file, model, **kw)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert entries(store_dir) == 0
    return str(info.value)


def test_a_wrapped_ring_and_kinds_without_an_equivalent_are_refused(gemma, llama, store_dir, tmp_path):
    covered = PROMPT[:10]  # past the window of 6
    layers = [layer_of(c, len(covered)) for c in forward_caches(gemma, covered)]
    layers[0]["idx"] = 4
    file = tmp_path / "wrapped.mlxkv"
    file.write_bytes(mlxkv(covered, layers, tok_hash=tokenizer_hash(gemma)))
    _refused(store_dir, file, gemma, "caches\\[0\\]: rotating layer past its window")
    path, good, _ = llama
    for kind, why in (("ssm", "ArraysCache"), ("turboquant", "TurboQuant"), ("rotating-qkv", "quantized rotating"),
                      ("mla", "MLA"), ("paged", "paged"), ("weird", "unknown")):
        layers = [good[0], {"kind": kind, "offset": len(COVERED), "_arrays": []}]
        file.write_bytes(mlxkv(COVERED, layers, tok_hash=tokenizer_hash(path)))
        message = _refused(store_dir, file, path, f"caches\\[1\\]: seed cache kind '{kind}' is not imported")
        assert why in message


def _variant(llama, **changes):
    """A file of the llama fixture with one thing changed: ``layers`` (a function of the good layers), ``tokens``,
    or any :func:`mlxkv` keyword."""
    path, good, _ = llama
    layers = changes.pop("layers", lambda g: g)([dict(g) for g in good])
    tokens = changes.pop("tokens", COVERED)
    changes.setdefault("tok_hash", tokenizer_hash(path))
    return mlxkv(tokens, layers, **changes)


def _narrow(layers):
    arr, dtype = layers[1]["_arrays"][1]
    layers[1] = dict(layers[1], _arrays=[layers[1]["_arrays"][0], (arr[..., :32], dtype)])
    return layers


def _bf16(layers):
    def word(a):
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [dict(layer, _arrays=[(word(a), BF16) for a, _ in layer["_arrays"]]) for layer in layers]


def _qkv(layers):
    n = len(COVERED)
    parts = [(np.zeros((1, 1, n, 8), np.uint32), U32), (np.zeros((1, 1, n, 1), np.float32), F32),
             (np.zeros((1, 1, n, 1), np.float32), F32)] * 2
    layers[0] = {"kind": "qkv", "offset": n, "groupSize": 64, "bits": 4, "minimumReusableOffset": 1, "_arrays": parts}
    return layers


HOSTILE = [
    ("another tokenizer", dict(tok_hash="deadbeef"), "another tokenizer"),
    ("a tokenizer hash that is no hash", dict(tok_hash="zz"), "not a hex hash"),
    ("another KV scheme", dict(fingerprint="0123456789abcdef-kv4-1a2b"), "KV scheme is 4-bit, group 64, start 5000"),
    ("a drafter namespace of other KV options",
     dict(ns=prefix_namespace("dflash-context-v1:x", "", KVOptions(kv_bits=8))), "other adapters or KV options"),
    ("a generation checkpoint", dict(ns="__generation_checkpoint__:abc"), "generation checkpoint"),
    ("a namespace that is none", dict(ns="hello"), "not a prefix namespace"),
    ("another codec provider", dict(codec="spec-cache-kv-v1"), "codecProvider"),
    ("one layer too few", dict(layers=lambda g: g[:1]), "holds 1 target cache layers"),
    ("values of the wrong head size", dict(layers=_narrow), "layer 1 values have shape"),
    ("bfloat16 K/V for a float32 model", dict(layers=_bf16), "bfloat16; this model's are mlx.core.float32"),
    ("a quantized layer without KV quantization", dict(layers=_qkv), "quantized"),
    ("a quantized layer that does not say where it was converted",
     dict(layers=lambda g: [{k: v for k, v in layer.items() if k != "minimumReusableOffset"} for layer in _qkv(g)]),
     "without minimumReusableOffset"),
    ("an offset past the tokens", dict(layers=lambda g: [dict(g[0], offset=99), g[1]]), "holds 99 tokens"),
    ("token ids past the vocabulary", dict(tokens=COVERED[:-1] + [10**6]), "token ids in 0..255"),
    ("a damaged tensor", dict(corrupt=True), "tensor hash mismatch"),
    ("format 5 (blocks)", dict(version=5), "formatVersion 5"),
    ("no tokens", dict(tokens=[], layers=lambda g: [dict(x, offset=0, _arrays=[(a[..., :0, :], d) for a, d in
                                                                             x["_arrays"]]) for x in g]),
     "covers no tokens"),
    ("a slot past the end", dict(header_extra={"caches": [{"kind": "kv", "offset": 9, "tensors": [
        {"off": 1 << 30, "bytes": 2304, "shape": [1, 1, 9, 64], "dtype": F32, "hash": ""}] * 2}] * 2}),
     "past the end of the file"),
    ("a nested header", dict(header_extra={"tokens": [[[[1]]]]}), "not a list of token ids"),
]


@pytest.mark.parametrize("case,changes,match", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_files_are_refused_in_one_line_and_store_nothing(llama, store_dir, tmp_path, case, changes, match):
    file = tmp_path / "hostile.mlxkv"
    file.write_bytes(_variant(llama, **changes))
    _refused(store_dir, file, llama[0], match)


def test_the_cli_imports_and_refuses(llama, store_dir, tmp_path, capsys):
    path = llama[0]
    good, bad = tmp_path / "good.mlxkv", tmp_path / "bad.mlxkv"
    good.write_bytes(_variant(llama))
    bad.write_bytes(_variant(llama, fingerprint="0123456789abcdef-kv8-g32-1a2b"))
    code = cli_main(["import-seed", str(bad), "--model", str(path), "--cache", str(store_dir)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and err.startswith("spec-cache: error: ")
    assert "8-bit, group 32, start 5000" in err and str(bad) in err
    assert entries(store_dir) == 0
    # the same file under the KV options it names: stored (9 tokens, before the default conversion start of 5000,
    # are full precision under those options too)
    code = cli_main(["import-seed", str(bad), "--model", str(path), "--cache", str(store_dir), "--kv-bits", "8",
                     "--kv-group-size", "32"])
    capsys.readouterr()
    assert code == 0
    code = cli_main(["import-seed", str(good), "--model", str(path), "--cache", str(store_dir), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["tokens"] == len(COVERED) and out["attachments_skipped"] == 0
    assert entries(store_dir) == 2  # two namespaces: kv8 (group 32) and full precision
    code = cli_main(["import-seed", str(tmp_path / "missing.mlxkv"), "--model", str(path), "--cache", str(store_dir)])
    assert code != 0 and "no such file" in capsys.readouterr().err


def test_quantized_qkv_layers_import_with_their_conversion_point(llama, store_dir, tmp_path):
    """``qkv`` layers (K's packed/scales/biases then V's, ``groupSize``/``bits``, ``minimumReusableOffset`` = where
    they were converted) under ``--kv-bits 4 --quantized-kv-start 0``: taken from what a quantized run of this
    runtime holds at the prompt boundary, written as a seed file into a fresh store, imported; a new run restores
    it and continues as the cold quantized run does. Under other KV options the same file is refused."""
    path = llama[0]
    kv = KVOptions(kv_bits=4, quantized_kv_start=0)
    with SpecCache.open(tmp_path / "source") as cache:  # what the runtime holds after 11 tokens, converted at 11
        cold = Generator.load(path, cache=cache, kv=kv).generate([PROMPT], max_tokens=12)[0]
        hit = cache.restore(Generator.load(path, cache=cache, kv=kv).ns_key, PROMPT[:-1])
    n = len(PROMPT) - 1
    assert hit.length == n and {c.converted_at for c in hit.caches} == {n}
    layers = []
    for c in hit.caches:
        parts = [(np.array(a[..., :n, :]), U32 if a.dtype == mx.uint32 else F32) for a in (*c.keys, *c.values)]
        layers.append({"kind": "qkv", "offset": n, "groupSize": c.group_size, "bits": c.bits,
                       "minimumReusableOffset": c.converted_at, "_arrays": parts})
    file = tmp_path / "quantized.mlxkv"
    file.write_bytes(mlxkv(PROMPT[:-1], layers, tok_hash=tokenizer_hash(path),
                           fingerprint="0123456789abcdef-kv4-start0-1a2b"))
    _refused(store_dir, file, path, "KV scheme is 4-bit, group 64, start 0; this import's is 4-bit, group 64, "
                                    "start 5000", kv=KVOptions(kv_bits=4))
    with SpecCache.open(store_dir) as cache:
        import_seed(cache, file, path, kv=kv)
    with SpecCache.open(store_dir) as cache:
        warm = Generator.load(path, cache=cache, kv=kv).generate([PROMPT], max_tokens=12)[0]
    assert warm.cached_tokens == n and warm.tokens == cold.tokens
