"""Tests for the `schemas` package: envelopes, dtypes, every stored schema, the registry."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spec_cache import schemas
from spec_cache.schemas import (
    CACHE_CODECS_V1,
    DEEPSPEC_CONTEXT_V1,
    DFLASH2_CONTEXT_V1,
    DFLASH_CONTEXT_V1,
    DTYPE_FROM_SAFETENSORS,
    DTYPE_ITEMSIZE,
    DTYPE_NAMES,
    GEMMA_ASSISTANT_V1,
    GLM52_NATIVE_MTP_V1,
    NGRAM_HISTORY_V1,
    QWEN_MTP_V1,
    SAFETENSORS_DTYPE,
    SCHEMAS,
    STANDALONE_DRAFT_V1,
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    UnknownSchemaError,
    decode_cache_headers,
    dtype_name,
    encode_cache_headers,
    get_schema,
    validate_attachment,
    validate_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class T:
    """A tiny tensor stand-in: only .shape and .dtype, like the schemas see."""

    shape: Any
    dtype: Any = "float16"


# ---------------------------------------------------------------------------------------------
# Valid checkpoint builders (one per schema family)


def gemma(n: int = 5, hidden: int = 8, dtype: Any = "bfloat16") -> DraftRowCheckpoint:
    return DraftRowCheckpoint(n, CheckpointAttachment(GEMMA_ASSISTANT_V1, {"processedTokens": n}, [T((1, 1, hidden), dtype)]))


def projected(name: str = DEEPSPEC_CONTEXT_V1, n: int = 4, layers: int = 2, kv_heads: int = 2, head_dim: int = 4,
              dtype: Any = "float16", make: Callable[[tuple, Any], Any] = T) -> DraftRowCheckpoint:
    tensors, headers = [], []
    for layer in range(layers):
        if n == 0:
            headers.append(None)
            continue
        headers.append({"kind": "kv", "offset": n, "tensors": [len(tensors), len(tensors) + 1]})
        tensors += [make((1, kv_heads, n, head_dim), dtype), make((1, kv_heads, n, head_dim), dtype)]
    metadata = {"processedTokens": n, "cacheCodecs": CACHE_CODECS_V1, "cacheHeaders": encode_cache_headers(headers)}
    return DraftRowCheckpoint(n, CheckpointAttachment(name, metadata, tensors))


def qwen(n: int = 4, kv_heads: int = 2, head_dim: int = 4, hidden: int = 8, dtype: Any = "bfloat16") -> DraftRowCheckpoint:
    offset = n - 1
    tensors = [T((1, 1, hidden), dtype)]
    if offset > 0:
        tensors = [T((1, kv_heads, offset, head_dim), dtype), T((1, kv_heads, offset, head_dim), dtype)] + tensors
    return DraftRowCheckpoint(n, CheckpointAttachment(QWEN_MTP_V1, {"draftOffset": offset}, tensors))


def glm(n: int = 5, offset: int = 3, rank: int = 16, rope: int = 4, hidden: int = 8,
        dtype: Any = "bfloat16") -> DraftRowCheckpoint:
    tensors = [T((1, 1, hidden), "float32")]
    if offset > 0:
        tensors = [T((1, 1, offset, rank), dtype), T((1, 1, offset, rope), dtype), T((1, 1, hidden), dtype)]
    metadata = {"processedTokens": n, "draftOffset": offset}
    return DraftRowCheckpoint(n, CheckpointAttachment(GLM52_NATIVE_MTP_V1, metadata, tensors))


def standalone(n: int = 6, pending: int | bool = 17, kv_heads: int = 2, head_dim: int = 4) -> DraftRowCheckpoint:
    """Layer 0 kv (tensors 0,1), layer 1 null, layer 2 qkv, layer 3 rotating, layer 4 arrays."""
    tensors: list = []
    headers: list = []
    if n:
        headers.append({"kind": "kv", "offset": n, "tensors": [0, 1]})
        tensors += [T((1, kv_heads, n, head_dim), "bfloat16"), T((1, kv_heads, n, head_dim), "bfloat16")]
        headers.append(None)
        headers.append({"kind": "qkv", "offset": n, "tensors": list(range(2, 8)), "groupSize": 64, "bits": 4})
        tensors += [T((1, kv_heads, n, 1), "uint32"), T((1, kv_heads, n, 1), "bfloat16"), T((1, kv_heads, n, 1), "bfloat16")] * 2
        headers.append({"kind": "rotating", "offset": n, "tensors": [8, 9], "maxSize": 4, "idx": n % 4, "keep": 0})
        tensors += [T((1, kv_heads, 4, head_dim), "bfloat16")] * 2
        headers.append({"kind": "arrays", "offset": 0, "tensors": [10], "present": "1"})
        tensors += [T((1, 3, 16), "float32")]
    else:
        headers = [None, None]
    metadata = {"processedTokens": n, "pendingLast": pending, "cacheCodecs": CACHE_CODECS_V1,
                "cacheHeaders": encode_cache_headers(headers)}
    return DraftRowCheckpoint(n, CheckpointAttachment(STANDALONE_DRAFT_V1, metadata, tensors))


def ngram(n: int = 7, low: int = 2, high: int = 4, dtype: Any = "int32") -> DraftRowCheckpoint:
    return DraftRowCheckpoint(n, CheckpointAttachment(NGRAM_HISTORY_V1, {"max": high, "min": low}, [T((n,), dtype)]))


BUILDERS: dict[str, Callable[..., DraftRowCheckpoint]] = {
    GEMMA_ASSISTANT_V1: gemma,
    DEEPSPEC_CONTEXT_V1: lambda **kw: projected(DEEPSPEC_CONTEXT_V1, **kw),
    DFLASH_CONTEXT_V1: lambda **kw: projected(DFLASH_CONTEXT_V1, **kw),
    DFLASH2_CONTEXT_V1: lambda **kw: projected(DFLASH2_CONTEXT_V1, **kw),
    QWEN_MTP_V1: qwen,
    GLM52_NATIVE_MTP_V1: glm,
    STANDALONE_DRAFT_V1: standalone,
    NGRAM_HISTORY_V1: ngram,
}

# Metadata keys whose value is tied to processed_tokens.
ALIGNMENT_KEY = {
    GEMMA_ASSISTANT_V1: "processedTokens",
    DEEPSPEC_CONTEXT_V1: "processedTokens",
    DFLASH_CONTEXT_V1: "processedTokens",
    DFLASH2_CONTEXT_V1: "processedTokens",
    QWEN_MTP_V1: "draftOffset",
    GLM52_NATIVE_MTP_V1: "processedTokens",
    STANDALONE_DRAFT_V1: "processedTokens",
    NGRAM_HISTORY_V1: None,
}


def with_metadata(cp: DraftRowCheckpoint, drop: tuple = (), **changes: Any) -> DraftRowCheckpoint:
    metadata = {k: v for k, v in cp.attachment.metadata.items() if k not in drop}
    metadata.update(changes)
    return DraftRowCheckpoint(cp.processed_tokens, CheckpointAttachment(cp.attachment.schema, metadata, cp.attachment.tensors))


def with_tensors(cp: DraftRowCheckpoint, tensors: list) -> DraftRowCheckpoint:
    return DraftRowCheckpoint(cp.processed_tokens, CheckpointAttachment(cp.attachment.schema, cp.attachment.metadata, tensors))


def with_tensor(cp: DraftRowCheckpoint, index: int, tensor: Any) -> DraftRowCheckpoint:
    tensors = list(cp.attachment.tensors)
    tensors[index] = tensor
    return with_tensors(cp, tensors)


def with_headers(cp: DraftRowCheckpoint, headers: Any) -> DraftRowCheckpoint:
    text = headers if isinstance(headers, str) else json.dumps(headers)
    return with_metadata(cp, cacheHeaders=text)


def headers_of(cp: DraftRowCheckpoint) -> list:
    return json.loads(cp.attachment.metadata["cacheHeaders"])


def refused(cp: DraftRowCheckpoint, field: str, *, contains: str = "") -> SchemaError:
    with pytest.raises(SchemaError) as info:
        validate_checkpoint(cp)
    assert info.value.field == field, str(info.value)
    assert info.value.schema == cp.attachment.schema
    assert cp.attachment.schema in str(info.value) and field in str(info.value)
    assert contains in str(info.value)
    return info.value


# ---------------------------------------------------------------------------------------------
# Golden names: stored strings never change


def test_registered_schema_names_are_exactly_the_stored_set():
    assert set(SCHEMAS) == {
        "gemma-assistant-v1", "deepspec-context-v1", "dflash-context-v1", "dflash2-context-v1",
        "qwen-mtp-v1", "glm52-native-mtp-v1", "standalone-draft-v1", "ngram-history-v1",
    }
    assert DFLASH2_CONTEXT_V1 == "dflash2-context-v1"
    assert GLM52_NATIVE_MTP_V1 == "glm52-native-mtp-v1"
    assert GEMMA_ASSISTANT_V1 == "gemma-assistant-v1"
    assert DEEPSPEC_CONTEXT_V1 == "deepspec-context-v1"
    assert DFLASH_CONTEXT_V1 == "dflash-context-v1"
    assert QWEN_MTP_V1 == "qwen-mtp-v1"
    assert STANDALONE_DRAFT_V1 == "standalone-draft-v1"
    assert NGRAM_HISTORY_V1 == "ngram-history-v1"
    assert CACHE_CODECS_V1 == "spec-cache-kv-v1"
    for name, schema in SCHEMAS.items():
        assert schema.name == name and get_schema(name) is schema


def test_schema_docs_name_every_metadata_key_and_the_alignment_rule():
    for name, schema in SCHEMAS.items():
        assert schema.doc.startswith(name)
        for key in schema.metadata_spec:
            assert key in schema.doc
        assert schema.alignment_doc in schema.doc and schema.description and schema.producer
    assert all(name in schemas.describe_schemas() for name in SCHEMAS)


def test_registry_and_metadata_spec_are_read_only():
    with pytest.raises(TypeError):
        SCHEMAS["x"] = SCHEMAS[GEMMA_ASSISTANT_V1]  # type: ignore[index]
    with pytest.raises(TypeError):
        SCHEMAS[GEMMA_ASSISTANT_V1].metadata_spec["x"] = None  # type: ignore[index]


def test_readme_documents_every_schema():
    readme = (REPO / "schemas" / "README.md").read_text()
    for name in SCHEMAS:
        assert f"`{name}`" in readme


def test_importing_schemas_loads_neither_mlx_nor_numpy():
    code = "import sys, spec_cache.schemas; print('mlx' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------------------------
# Errors


def test_schema_error_names_schema_and_field_and_pickles():
    error = SchemaError("qwen-mtp-v1", "tensors[0].shape", "bad")
    assert isinstance(error, ValueError)
    assert (error.schema, error.field, error.reason) == ("qwen-mtp-v1", "tensors[0].shape", "bad")
    assert str(error) == "qwen-mtp-v1: tensors[0].shape: bad"
    again = pickle.loads(pickle.dumps(error))
    assert (again.schema, again.field, str(again)) == (error.schema, error.field, str(error))


def test_unknown_schema_lists_known_names():
    with pytest.raises(UnknownSchemaError) as info:
        get_schema("x")
    error = info.value
    assert isinstance(error, SchemaError) and error.field == "schema" and error.schema == "x"
    assert str(error).startswith("unknown attachment schema 'x'; known: ")
    assert all(name in str(error) for name in SCHEMAS)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_unknown_schema_on_validation_and_non_str_names():
    cp = DraftRowCheckpoint(3, CheckpointAttachment("test-companion-v1", {}, []))
    with pytest.raises(UnknownSchemaError):
        validate_checkpoint(cp)
    with pytest.raises(UnknownSchemaError):
        get_schema(None)  # type: ignore[arg-type]
    with pytest.raises(UnknownSchemaError):
        get_schema(["gemma-assistant-v1"])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("spelling, name", [
    ("float32", "float32"), ("mlx.core.bfloat16", "bfloat16"), ("mlx.core.bool", "bool"), ("bool_", "bool"),
    (np.dtype("int32"), "int32"), (np.dtype("<f2"), "float16"), (np.float64, "float64"), (np.bool_, "bool"),
    (np.zeros(2, np.uint16), "uint16"), (T((1,), "mlx.core.complex64"), "complex64"), (T((1,), np.dtype("u8")), "uint64"),
])
def test_dtype_name_normalizes_every_spelling(spelling, name):
    assert dtype_name(spelling) == name


@pytest.mark.parametrize("bad", ["float", "half", "F32", ">f4", np.dtype(">f4"), np.dtype("U3"), np.array("float32"),
                                 object(), None, 3, int, b"float32", T((1,), T((1,), "float32"))])
def test_dtype_name_refuses_unknown(bad):
    with pytest.raises(SchemaError) as info:
        dtype_name(bad)
    assert info.value.field == "dtype" and info.value.schema is None


def test_dtype_name_reads_a_real_mlx_dtype():
    import mlx.core as mx  # a project dependency; the schemas package itself never imports it
    assert dtype_name(mx.bfloat16) == "bfloat16"
    assert dtype_name(mx.zeros((1, 2), dtype=mx.int8)) == "int8"


def test_dtype_tables_agree():
    assert DTYPE_NAMES == tuple(DTYPE_ITEMSIZE) == tuple(SAFETENSORS_DTYPE)
    assert set(SAFETENSORS_DTYPE.values()) == {"BOOL", "U8", "U16", "U32", "U64", "I8", "I16", "I32", "I64",
                                                "F16", "BF16", "F32", "F64", "C64"}
    for name, code in SAFETENSORS_DTYPE.items():
        assert DTYPE_FROM_SAFETENSORS[code] == name
        if name != "bfloat16":
            assert np.dtype(name).itemsize == DTYPE_ITEMSIZE[name]
    assert DTYPE_ITEMSIZE["bfloat16"] == 2


# ---------------------------------------------------------------------------------------------
# Envelopes: CheckpointAttachment and DraftRowCheckpoint


def test_attachment_freezes_metadata_and_tensors():
    source = {"processedTokens": 3}
    tensors = [T((1, 1, 4))]
    attachment = CheckpointAttachment(GEMMA_ASSISTANT_V1, source, tensors)
    assert isinstance(attachment.tensors, tuple) and attachment.tensors == (tensors[0],)
    source["processedTokens"] = 9
    tensors.append(T((1,)))
    assert attachment.metadata == {"processedTokens": 3} and len(attachment.tensors) == 1
    with pytest.raises(TypeError):
        attachment.metadata["processedTokens"] = 4  # type: ignore[index]
    with pytest.raises(TypeError):
        attachment.metadata.update(x=1)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        attachment.schema = "x"  # type: ignore[misc]


def test_metadata_serializes_like_a_dict():
    attachment = gemma().attachment
    plain = {"processedTokens": 5}
    assert json.loads(json.dumps(attachment.metadata)) == plain
    assert msgpack.unpackb(msgpack.packb(attachment.metadata)) == plain
    again = pickle.loads(pickle.dumps(attachment.metadata))
    assert again == plain and type(again) is type(attachment.metadata)
    assert hash(again) == hash(attachment.metadata)


def test_metadata_values_are_normalized_to_builtins():
    attachment = CheckpointAttachment("x-v1", {"f": np.float64(1.5), "i": True, "s": "a"}, ())
    assert type(attachment.metadata["f"]) is float and attachment.metadata["i"] is True


@pytest.mark.parametrize("metadata, field", [
    ({"cacheHeaders": [1, 2]}, "metadata.cacheHeaders"),
    ({"x": {"nested": 1}}, "metadata.x"),
    ({"x": None}, "metadata.x"),
    ({"x": b"bytes"}, "metadata.x"),
    ({"x": np.int64(3)}, "metadata.x"),
    ({"x": float("nan")}, "metadata.x"),
    ({"x": float("inf")}, "metadata.x"),
    ({"x": 2**64}, "metadata.x"),
    ({3: 1}, "metadata"),
    ([("x", 1)], "metadata"),
])
def test_attachment_refuses_non_scalar_metadata(metadata, field):
    with pytest.raises(SchemaError) as info:
        CheckpointAttachment("x-v1", metadata, ())
    assert info.value.field == field and info.value.schema == "x-v1"


@pytest.mark.parametrize("schema, tensors, field", [
    ("", (), "schema"), (None, (), "schema"), (3, (), "schema"),
    ("x-v1", np.zeros((2, 2)), "tensors"), ("x-v1", T((1,)), "tensors"),
    ("x-v1", [T((1,)), 3], "tensors[1]"), ("x-v1", [object()], "tensors[0]"),
])
def test_attachment_refuses_bad_schema_or_tensors(schema, tensors, field):
    with pytest.raises(SchemaError) as info:
        CheckpointAttachment(schema, {}, tensors)
    assert info.value.field == field


@pytest.mark.parametrize("count", [-1, True, False, 1.0, "3", None, 2**63])
def test_checkpoint_refuses_bad_processed_tokens(count):
    with pytest.raises(SchemaError) as info:
        DraftRowCheckpoint(count, gemma().attachment)  # type: ignore[arg-type]
    assert info.value.field == "processed_tokens"


def test_checkpoint_refuses_non_attachment():
    with pytest.raises(SchemaError) as info:
        DraftRowCheckpoint(1, {"schema": GEMMA_ASSISTANT_V1})  # type: ignore[arg-type]
    assert info.value.field == "attachment"


def test_validate_entry_points_refuse_wrong_types():
    with pytest.raises(SchemaError) as info:
        validate_checkpoint("cp")  # type: ignore[arg-type]
    assert info.value.field == "checkpoint"
    with pytest.raises(SchemaError) as info:
        validate_attachment("a", 1)  # type: ignore[arg-type]
    assert info.value.field == "attachment"
    for bad in (-1, True, 1.5):
        with pytest.raises(SchemaError) as info:
            validate_attachment(gemma().attachment, bad)  # type: ignore[arg-type]
        assert info.value.field == "processed_tokens"
    with pytest.raises(SchemaError) as info:
        SCHEMAS[QWEN_MTP_V1].validate(gemma().attachment, 5)
    assert info.value.field == "schema" and info.value.schema == QWEN_MTP_V1


def test_expect_schema():
    validate_checkpoint(gemma(), expect_schema=GEMMA_ASSISTANT_V1)
    with pytest.raises(SchemaError) as info:
        validate_checkpoint(gemma(), expect_schema=QWEN_MTP_V1)
    assert info.value.field == "schema" and not isinstance(info.value, UnknownSchemaError)
    with pytest.raises(UnknownSchemaError):
        validate_checkpoint(gemma(), expect_schema="gemma-assistant-v2")


# ---------------------------------------------------------------------------------------------
# Valid examples pass


@pytest.mark.parametrize("cp", [
    gemma(), gemma(n=0), gemma(dtype="float32"), gemma(dtype="mlx.core.float16"),
    projected(DEEPSPEC_CONTEXT_V1), projected(DFLASH_CONTEXT_V1, n=1, layers=5, dtype="bfloat16"),
    projected(DEEPSPEC_CONTEXT_V1, n=0), projected(DFLASH_CONTEXT_V1, n=0, layers=3),
    qwen(), qwen(n=1), qwen(n=2, dtype="float32"),
    projected(DFLASH2_CONTEXT_V1), projected(DFLASH2_CONTEXT_V1, n=0, layers=1),
    glm(), glm(offset=0), glm(n=0, offset=0), glm(n=4, offset=4, dtype="float32"),
    standalone(), standalone(n=0), standalone(pending=False), standalone(n=1, pending=0),
    ngram(), ngram(n=0), ngram(low=1, high=1),
], ids=lambda cp: f"{cp.attachment.schema}@{cp.processed_tokens}")
def test_valid_checkpoints_pass(cp):
    assert validate_checkpoint(cp, expect_schema=cp.attachment.schema) is None
    assert validate_attachment(cp.attachment, cp.processed_tokens) is None


def test_valid_checkpoints_with_numpy_tensors():
    hidden = np.zeros((1, 1, 8), np.float32)
    validate_checkpoint(DraftRowCheckpoint(3, CheckpointAttachment(GEMMA_ASSISTANT_V1, {"processedTokens": 3}, [hidden])))
    validate_checkpoint(projected(n=3, make=lambda shape, dtype: np.zeros(shape, dtype), dtype="float16"))
    history = np.arange(6, dtype=np.int32)
    validate_checkpoint(DraftRowCheckpoint(6, CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1}, [history])))
    k = np.zeros((1, 2, 4, 8), np.float16)
    validate_checkpoint(DraftRowCheckpoint(5, CheckpointAttachment(QWEN_MTP_V1, {"draftOffset": 4}, [k, k.copy(), hidden])))
    with pytest.raises(SchemaError) as info:
        validate_checkpoint(DraftRowCheckpoint(6, CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                                                       [history.astype(np.int64)])))
    assert info.value.field == "tensors[0].dtype"


def test_shape_dims_may_be_numpy_ints():
    validate_checkpoint(gemma(hidden=np.int64(8)))  # type: ignore[arg-type]
    validate_checkpoint(with_tensor(gemma(), 0, T([np.int32(1), 1, 8], "float16")))


# ---------------------------------------------------------------------------------------------
# Violations, schema by schema


def test_gemma_violations():
    cp = gemma(n=5)
    refused(with_metadata(cp, processedTokens=4), "metadata.processedTokens", contains="invalid assistant checkpoint alignment")
    refused(DraftRowCheckpoint(6, cp.attachment), "metadata.processedTokens", contains="invalid assistant checkpoint alignment")
    refused(with_metadata(cp, drop=("processedTokens",)), "metadata.processedTokens", contains="missing")
    refused(with_metadata(cp, processedTokens="5"), "metadata.processedTokens", contains="expected int")
    refused(with_metadata(cp, processedTokens=True), "metadata.processedTokens")
    refused(with_metadata(cp, processedTokens=5.0), "metadata.processedTokens")
    refused(with_metadata(cp, extra=1), "metadata.extra", contains="unexpected")
    refused(with_tensors(cp, []), "tensors")
    refused(with_tensors(cp, [T((1, 1, 8)), T((1, 1, 8))]), "tensors")
    refused(with_tensor(cp, 0, T((1, 8))), "tensors[0].shape", contains="rank 3")
    refused(with_tensor(cp, 0, T((2, 1, 8))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 3, 8))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 1, 0))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, -1, 8))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 1.0, 8))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, True, 8))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T(None)), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 1, 8), "int32")), "tensors[0].dtype", contains="float")
    refused(with_tensor(cp, 0, T((1, 1, 8), "float64")), "tensors[0].dtype")
    refused(with_tensor(cp, 0, T((1, 1, 8), "nope")), "tensors[0].dtype", contains="unknown dtype")


@pytest.mark.parametrize("name", [DEEPSPEC_CONTEXT_V1, DFLASH_CONTEXT_V1, DFLASH2_CONTEXT_V1])
def test_projected_violations(name):
    cp = projected(name, n=4, layers=2)
    tensors = list(cp.attachment.tensors)
    headers = headers_of(cp)
    align = "invalid projected context checkpoint alignment"
    refused(with_metadata(cp, processedTokens=3), "metadata.processedTokens", contains=align)
    refused(DraftRowCheckpoint(5, cp.attachment), "metadata.processedTokens", contains=align)
    refused(with_metadata(cp, cacheCodecs="mlx-cache-v3"), "metadata.cacheCodecs", contains="companion cache codec mismatch")
    refused(with_metadata(cp, drop=("cacheCodecs",)), "metadata.cacheCodecs")
    refused(with_metadata(cp, drop=("cacheHeaders",)), "metadata.cacheHeaders")
    refused(with_metadata(cp, cacheHeaders=7), "metadata.cacheHeaders")
    refused(with_headers(cp, "[{"), "metadata.cacheHeaders", contains="JSON")
    refused(with_headers(cp, "[NaN]"), "metadata.cacheHeaders", contains="JSON")
    refused(with_headers(cp, "[" * 100000), "metadata.cacheHeaders", contains="JSON")
    refused(with_headers(cp, {"0": headers[0]}), "metadata.cacheHeaders")
    refused(with_headers(cp, []), "metadata.cacheHeaders", contains="at least one")
    refused(with_headers(cp, [headers[0], None]), "metadata.cacheHeaders[1]", contains=align)
    refused(with_headers(cp, [headers[0], 5]), "metadata.cacheHeaders[1]")
    refused(with_headers(cp, [headers[0], {**headers[1], "kind": "qkv"}]), "metadata.cacheHeaders[1].kind")
    refused(with_headers(cp, [headers[0], {**headers[1], "offset": 3}]), "metadata.cacheHeaders[1].offset", contains=align)
    refused(with_headers(cp, [headers[0], {**headers[1], "offset": "4"}]), "metadata.cacheHeaders[1].offset")
    refused(with_headers(cp, [headers[0], {**headers[1], "offset": True}]), "metadata.cacheHeaders[1].offset")
    refused(with_headers(cp, [headers[0], {**headers[1], "extra": 1}]), "metadata.cacheHeaders[1].extra")
    refused(with_headers(cp, [headers[0], {"kind": "kv", "offset": 4}]), "metadata.cacheHeaders[1].tensors", contains="missing")
    refused(with_headers(cp, [headers[0], {**headers[1], "tensors": [2, 9]}]), "metadata.cacheHeaders[1].tensors", contains="out of range")
    refused(with_headers(cp, [headers[0], {**headers[1], "tensors": [2, -1]}]), "metadata.cacheHeaders[1].tensors")
    refused(with_headers(cp, [headers[0], {**headers[1], "tensors": [2, 1.0]}]), "metadata.cacheHeaders[1].tensors")
    refused(with_headers(cp, [headers[0], {**headers[1], "tensors": [1, 2]}]), "metadata.cacheHeaders[1].tensors", contains="already used")
    refused(with_headers(cp, [headers[0], {**headers[1], "tensors": [2]}]), "metadata.cacheHeaders[1].tensors", contains="2 indices")
    refused(with_headers(cp, [headers[0]]), "tensors[2]", contains="not referenced")
    refused(with_tensors(cp, tensors + [T((1, 2, 4, 4))]), "tensors[4]", contains="not referenced")
    refused(with_tensors(cp, tensors[:3]), "metadata.cacheHeaders[1].tensors", contains="out of range")
    refused(with_tensor(cp, 3, T((1, 2, 3, 4))), "tensors[3].shape", contains=align)
    refused(with_tensor(cp, 2, T((1, 2, 5, 4))), "tensors[2].shape", contains=align)
    refused(with_tensor(cp, 3, T((1, 2, 4, 8))), "tensors[3].shape", contains="differs from K")
    refused(with_tensor(cp, 3, T((1, 3, 4, 4))), "tensors[3].shape", contains="differs from K")
    refused(with_tensor(cp, 0, T((2, 2, 4, 4))), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 0, 4, 4))), "tensors[0].shape")
    refused(with_tensor(cp, 1, T((1, 2, 4))), "tensors[1].shape", contains="rank 4")
    refused(with_tensor(cp, 1, T((1, 2, 4, 4), "bfloat16")), "tensors[1].dtype", contains="differs from K")
    refused(with_tensor(cp, 0, T((1, 2, 4, 4), "int8")), "tensors[0].dtype")
    empty = projected(name, n=0, layers=2)
    refused(with_tensors(empty, [T((1, 2, 0, 4))]), "tensors[0]", contains="not referenced")
    refused(with_headers(empty, [{"kind": "kv", "offset": 0, "tensors": []}, None]), "metadata.cacheHeaders[0]",
            contains="null when processedTokens=0")


def test_qwen_violations():
    cp = qwen(n=4)
    k, v, hidden = cp.attachment.tensors
    align = "invalid paired Qwen MTP checkpoint alignment"
    refused(with_metadata(cp, draftOffset=4), "metadata.draftOffset", contains=align)
    refused(DraftRowCheckpoint(3, cp.attachment), "metadata.draftOffset", contains=align)
    refused(with_metadata(cp, draftOffset=-1), "metadata.draftOffset", contains=align)
    refused(DraftRowCheckpoint(0, CheckpointAttachment(QWEN_MTP_V1, {"draftOffset": -1}, [hidden])),
            "metadata.draftOffset", contains=align)
    refused(with_metadata(cp, drop=("draftOffset",), processedTokens=4), "metadata.draftOffset", contains="missing")
    refused(with_metadata(cp, processedTokens=4), "metadata.processedTokens", contains="unexpected")
    refused(with_tensors(cp, [hidden]), "tensors", contains=align)
    refused(with_tensors(qwen(n=1), [k, v, hidden]), "tensors", contains=align)
    refused(with_tensors(cp, [hidden, k, v]), "tensors[0].shape")
    refused(with_tensor(cp, 0, T((1, 2, 4, 4), "bfloat16")), "tensors[0].shape", contains=align)
    refused(with_tensor(cp, 1, T((1, 2, 3, 8), "bfloat16")), "tensors[1].shape", contains="differs from K")
    refused(with_tensor(cp, 1, T((1, 2, 3, 4), "float16")), "tensors[1].dtype")
    refused(with_tensor(cp, 2, T((1, 2, 8), "bfloat16")), "tensors[2].shape")
    refused(with_tensor(cp, 2, T((1, 8), "bfloat16")), "tensors[2].shape", contains="rank 3")
    refused(with_tensor(cp, 2, T((1, 1, 8), "int32")), "tensors[2].dtype")
    refused(with_tensor(qwen(n=1), 0, T((1, 1, 8), "bool")), "tensors[0].dtype")


def test_glm_violations():
    cp = glm(n=5, offset=3)
    latent, rope, hidden = cp.attachment.tensors
    align = "invalid native GLM MTP checkpoint alignment"
    refused(with_metadata(cp, processedTokens=4), "metadata.processedTokens", contains=align)
    refused(DraftRowCheckpoint(6, cp.attachment), "metadata.processedTokens", contains=align)
    refused(with_metadata(cp, draftOffset=-1), "metadata.draftOffset", contains=align)
    refused(with_metadata(cp, draftOffset=6), "metadata.draftOffset", contains=align)
    refused(with_metadata(cp, drop=("draftOffset",)), "metadata.draftOffset", contains="missing")
    refused(with_tensors(cp, [hidden]), "tensors", contains=align)
    refused(with_tensors(glm(offset=0), [latent, rope, hidden]), "tensors", contains=align)
    refused(with_tensor(cp, 0, T((1, 1, 2, 16), "bfloat16")), "tensors[0].shape", contains=align)
    refused(with_tensor(cp, 1, T((1, 2, 3, 4), "bfloat16")), "tensors[1].shape")
    refused(with_tensor(cp, 1, T((1, 1, 3, 4), "float16")), "tensors[1].dtype", contains="differs from latent")
    refused(with_tensor(cp, 0, T((1, 1, 3, 16), "int32")), "tensors[0].dtype")
    refused(with_tensor(cp, 2, T((1, 2, 8), "bfloat16")), "tensors[2].shape")
    refused(with_tensor(glm(offset=0), 0, T((1, 1, 8), "int8")), "tensors[0].dtype")


def test_standalone_violations():
    cp = standalone(n=6)
    headers = headers_of(cp)
    align = "invalid standalone draft checkpoint alignment"
    refused(with_metadata(cp, processedTokens=5), "metadata.processedTokens", contains=align)
    refused(with_metadata(cp, pendingLast=True), "metadata.pendingLast")
    refused(with_metadata(cp, pendingLast=-3), "metadata.pendingLast")
    refused(with_metadata(cp, pendingLast="17"), "metadata.pendingLast")
    refused(with_metadata(cp, pendingLast=1.5), "metadata.pendingLast")
    refused(with_metadata(cp, drop=("pendingLast",)), "metadata.pendingLast", contains="missing")
    refused(with_metadata(cp, cacheCodecs="mlx-cache-v3"), "metadata.cacheCodecs", contains="codec mismatch")
    refused(with_headers(cp, "{}"), "metadata.cacheHeaders")
    refused(with_headers(cp, [{**headers[0], "kind": "turboquant"}] + headers[1:]), "metadata.cacheHeaders[0].kind")
    refused(with_headers(cp, [{**headers[0], "offset": 7}] + headers[1:]), "metadata.cacheHeaders[0].offset", contains=align)
    refused(with_headers(cp, headers[:3] + [{**headers[3], "offset": 7}] + headers[4:]), "metadata.cacheHeaders[3].offset")
    refused(with_headers(cp, headers[:2] + [{**headers[2], "bits": [4]}] + headers[3:]), "metadata.cacheHeaders[2].bits",
            contains="scalars")
    refused(with_headers(cp, [{**headers[0], "offset": 5}] + headers[1:]), "tensors[0].shape")
    refused(with_headers(cp, [{**headers[0], "tensors": [0]}, {"kind": "arrays", "offset": 0, "tensors": [1]}] + headers[2:]),
            "metadata.cacheHeaders[0].tensors", contains="2 indices")
    refused(with_headers(cp, headers[:4] + [{**headers[4], "tensors": []}, {"kind": "arrays", "offset": 1, "tensors": [10]}]),
            "metadata.cacheHeaders[4].tensors", contains="at least one")
    refused(with_headers(cp, headers[:4] + [None]), "tensors[10]", contains="not referenced")
    refused(with_headers(cp, headers[:4] + [{**headers[4], "tensors": [9]}]), "metadata.cacheHeaders[4].tensors",
            contains="already used by layer 3")
    refused(with_tensor(cp, 0, T((1, 2, 6, 4), "int32")), "tensors[0].dtype")
    refused(with_tensor(cp, 1, T((1, 2, 6, 5), "bfloat16")), "tensors[1].shape")
    empty = standalone(n=0)
    kv0 = {"kind": "kv", "offset": 0, "tensors": [0, 1]}
    refused(with_tensors(with_headers(empty, [kv0]), [T((1, 2, 0, 4)), T((1, 2, 0, 4))]),
            "metadata.cacheHeaders[0].offset", contains="must be null")


def test_ngram_violations():
    cp = ngram(n=7)
    mismatch = "ngram checkpoint does not match its token coverage or lookup policy"
    refused(DraftRowCheckpoint(8, cp.attachment), "tensors[0].shape", contains=mismatch)
    refused(with_tensor(cp, 0, T((6,), "int32")), "tensors[0].shape", contains=mismatch)
    refused(with_tensor(cp, 0, T((1, 7), "int32")), "tensors[0].shape", contains=mismatch)
    refused(with_tensor(cp, 0, T((7,), "int64")), "tensors[0].dtype", contains=mismatch)
    refused(with_tensor(cp, 0, T((7,), "uint32")), "tensors[0].dtype", contains=mismatch)
    refused(with_tensors(cp, []), "tensors", contains=mismatch)
    refused(with_tensors(cp, [T((7,), "int32")] * 2), "tensors", contains=mismatch)
    refused(with_metadata(cp, min=0), "metadata.min", contains=mismatch)
    refused(with_metadata(cp, min=5, max=4), "metadata.max", contains=mismatch)
    refused(with_metadata(cp, max="4"), "metadata.max")
    refused(with_metadata(cp, drop=("min",)), "metadata.min", contains="missing")
    refused(with_metadata(cp, processedTokens=7), "metadata.processedTokens", contains="unexpected")


def test_tensor_attribute_errors_become_schema_errors():
    class Exploding:
        dtype = "float16"

        @property
        def shape(self):
            raise RuntimeError("device lost")

    with pytest.raises(SchemaError) as info:
        CheckpointAttachment(GEMMA_ASSISTANT_V1, {"processedTokens": 1}, [Exploding()])
    assert info.value.field == "tensors[0]"

    class FailsLater:
        """Looks fine when the attachment is built, fails when validation reads it."""

        def __init__(self, attribute):
            self.attribute, self.reads = attribute, 0

        def __getattr__(self, name):
            if name not in ("shape", "dtype"):
                raise AttributeError(name)
            self.reads += 1
            if name == self.attribute and self.reads > 2:
                raise KeyError(name)
            return (1, 1, 8) if name == "shape" else "float16"

    refused(with_tensor(gemma(), 0, FailsLater("shape")), "tensors[0].shape", contains="unreadable")
    refused(with_tensor(gemma(), 0, FailsLater("dtype")), "tensors[0].dtype", contains="unreadable")


# ---------------------------------------------------------------------------------------------
# Cache headers


def test_cache_headers_encode_canonically_and_decode():
    headers = [{"tensors": [0, 1], "offset": 3, "kind": "kv"}, None]
    text = encode_cache_headers(headers)
    assert text == '[{"kind":"kv","offset":3,"tensors":[0,1]},null]'
    decoded = decode_cache_headers(SCHEMAS[DEEPSPEC_CONTEXT_V1], text, 2, kinds=("kv",), allow_extra=False)
    assert decoded[1] is None
    assert (decoded[0].layer, decoded[0].kind, decoded[0].offset, decoded[0].tensors) == (0, "kv", 3, (0, 1))
    with pytest.raises(ValueError):
        encode_cache_headers([{"x": math.nan}])


# ---------------------------------------------------------------------------------------------
# Properties


SCALARS = st.one_of(st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8))
DTYPES = st.one_of(st.sampled_from(DTYPE_NAMES), st.sampled_from(["mlx.core.float16", "float", ">f4", ""]),
                   st.none(), st.integers(), st.just(object()))
DIMS = st.one_of(st.integers(-2, 9), st.just(True), st.just(1.0), st.none(), st.text(max_size=2))
SHAPES = st.one_of(st.lists(st.integers(0, 9), max_size=5).map(tuple), st.lists(DIMS, max_size=5), st.none(), st.integers(),
                   st.text(max_size=3))
TENSORS = st.one_of(st.builds(T, SHAPES, DTYPES), st.builds(T, st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple),
                                                            st.sampled_from(DTYPE_NAMES)))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.floats(allow_nan=False), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.sampled_from(["kind", "offset", "tensors", "bits"]), inner, max_size=4)),
                    max_leaves=12)
HEADER = st.one_of(st.none(), st.fixed_dictionaries({
    "kind": st.sampled_from(["kv", "qkv", "rotating", "arrays", "ssm"]),
    "offset": st.one_of(st.integers(-1, 8), st.just("3")),
    "tensors": st.lists(st.integers(-1, 6), max_size=4),
}, optional={"bits": st.one_of(st.integers(0, 8), st.lists(st.integers(), max_size=1))}))
HEADERS_TEXT = st.one_of(st.lists(HEADER, max_size=4).map(json.dumps), JSON.map(json.dumps), st.text(max_size=10))
METADATA_VALUES = {
    "processedTokens": st.integers(-1, 8), "draftOffset": st.integers(-1, 8), "pendingLast": st.one_of(st.booleans(), st.integers(-2, 9)),
    "cacheCodecs": st.sampled_from([CACHE_CODECS_V1, "mlx-cache-v3"]), "cacheHeaders": HEADERS_TEXT,
    "max": st.integers(-1, 6), "min": st.integers(-1, 6),
}


@st.composite
def random_metadata(draw):
    metadata = {}
    for key, values in METADATA_VALUES.items():
        if draw(st.booleans()):
            metadata[key] = draw(st.one_of(values, SCALARS))
    extra = draw(st.dictionaries(st.text(max_size=4), st.one_of(SCALARS, st.lists(st.integers(), max_size=2), st.none()), max_size=2))
    metadata.update(extra)
    return metadata


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.one_of(st.sampled_from(sorted(SCHEMAS)), st.text(max_size=6), st.none()),
    metadata=random_metadata(),
    tensors=st.lists(TENSORS, max_size=5),
    processed=st.one_of(st.integers(-2, 9), st.booleans(), st.none()),
    expect=st.one_of(st.none(), st.sampled_from(sorted(SCHEMAS)), st.text(max_size=3)),
)
def test_random_checkpoints_only_ever_raise_schema_error(name, metadata, tensors, processed, expect):
    try:
        cp = DraftRowCheckpoint(processed, CheckpointAttachment(name, metadata, tensors))
        validate_checkpoint(cp, expect_schema=expect)
    except SchemaError as error:
        assert error.field and str(error)
    else:  # accepted: then it must be internally consistent
        assert cp.attachment.schema in SCHEMAS


MUTATIONS = ["processed", "drop_key", "extra_key", "retype_key", "bump_alignment", "drop_tensor", "extra_tensor",
             "rank_tensor0", "dtype_tensor0"]


@st.composite
def valid_checkpoints(draw):
    name = draw(st.sampled_from(sorted(SCHEMAS)))
    n = draw(st.integers(0, 12))
    if name == GEMMA_ASSISTANT_V1:
        return gemma(n=n, hidden=draw(st.integers(1, 16)), dtype=draw(st.sampled_from(sorted(schemas.FLOAT_DTYPES))))
    if name in (DEEPSPEC_CONTEXT_V1, DFLASH_CONTEXT_V1):
        return projected(name, n=n, layers=draw(st.integers(1, 4)), kv_heads=draw(st.integers(1, 4)),
                         head_dim=draw(st.integers(1, 8)), dtype=draw(st.sampled_from(sorted(schemas.FLOAT_DTYPES))))
    if name == QWEN_MTP_V1:
        return qwen(n=max(n, 1), kv_heads=draw(st.integers(1, 4)), hidden=draw(st.integers(1, 16)))
    if name == STANDALONE_DRAFT_V1:
        return standalone(n=n, pending=draw(st.one_of(st.just(False), st.integers(0, 100))))
    low = draw(st.integers(1, 4))
    return ngram(n=n, low=low, high=draw(st.integers(low, 8)))


def mutate(cp: DraftRowCheckpoint, mutation: str, delta: int) -> DraftRowCheckpoint:
    attachment = cp.attachment
    keys = sorted(attachment.metadata)
    key = keys[delta % len(keys)]
    tensors = list(attachment.tensors)
    if mutation == "processed":
        moved = cp.processed_tokens + delta
        return DraftRowCheckpoint(moved if moved >= 0 else cp.processed_tokens - delta, attachment)
    if mutation == "drop_key":
        return with_metadata(cp, drop=(key,))
    if mutation == "extra_key":
        return with_metadata(cp, **{f"x{delta}": delta})
    if mutation == "retype_key":
        value = attachment.metadata[key]
        return with_metadata(cp, **{key: 1.5 if isinstance(value, str) else str(value)})
    if mutation == "bump_alignment":
        key = ALIGNMENT_KEY[attachment.schema] or "min"
        bumped = attachment.metadata[key] + delta
        if key == "min":  # min must stay a lookup-policy violation
            bumped = 0 if delta < 0 else attachment.metadata["max"] + delta
        return with_metadata(cp, **{key: bumped})
    if mutation == "drop_tensor":
        assume(tensors)
        del tensors[delta % len(tensors)]
        return with_tensors(cp, tensors)
    if mutation == "extra_tensor":
        return with_tensors(cp, tensors + [tensors[0] if tensors else T((1, 1, 1))])
    assume(tensors)
    shape, dtype = tensors[0].shape, tensors[0].dtype
    if mutation == "rank_tensor0":
        tensors[0] = T(tuple(shape) + (1,) if delta > 0 else tuple(shape)[:-1], dtype)
    else:
        tensors[0] = T(shape, "float32" if dtype == "int32" else "int32")
    return with_tensors(cp, tensors)


@settings(max_examples=300, deadline=None)
@given(cp=valid_checkpoints(), mutation=st.sampled_from(MUTATIONS),
       delta=st.integers(-5, 5).filter(bool))
def test_valid_checkpoint_mutated_in_one_field_is_refused(cp, mutation, delta):
    validate_checkpoint(cp)
    mutated = mutate(cp, mutation, delta)
    with pytest.raises(SchemaError):
        validate_checkpoint(mutated)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp=valid_checkpoints(), data=st.data())
def test_perturbed_valid_checkpoints_only_ever_raise_schema_error(cp, data):
    """Start from a valid checkpoint so random damage reaches the deep tensor and header checks."""
    metadata = dict(cp.attachment.metadata)
    for key in sorted(metadata):
        if data.draw(st.integers(0, 3)) == 0:
            metadata[key] = data.draw(st.one_of(METADATA_VALUES.get(key, SCALARS), SCALARS))
    tensors = list(cp.attachment.tensors)
    for index in range(len(tensors)):
        if data.draw(st.integers(0, 3)) == 0:
            tensors[index] = data.draw(TENSORS)
    processed = cp.processed_tokens + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    try:
        validate_checkpoint(DraftRowCheckpoint(processed, CheckpointAttachment(cp.attachment.schema, metadata, tensors)))
    except SchemaError as error:
        assert error.field and error.schema in (cp.attachment.schema, None)
