"""The Python API refuses what it cannot run, up front (issue 14, item 7): ``Generator.generate`` validates every
prompt before any lookup, with one ``ValueError`` naming the prompt index and position; nothing is coerced
(``"5678"`` is not tokens 5, 6, 7, 8; ``2.0`` is not 2; ``True`` is not 1) and no cache warning comes first."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.errors import ModelLoadError
from spec_cache.rows.generation import check_prompts
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import CacheWarning, SpecCache

VOCAB = 256  # write_tiny_target's default


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-models")
    target = write_tiny_target(root / "target", seed=3, vocab_size=VOCAB)
    drafter = write_tiny_drafter(root / "assistant", "assistant", target, seed=3)
    return target, drafter


@pytest.mark.parametrize("prompts, words", [
    (["5678"], ["prompt 0 is a str", "tokenizer"]),
    ([[5, 6], "78"], ["prompt 1 is a str"]),
    ([5, 6, 7, 8], ["prompt 0 is the token id 5, not a list", "[[1, 2, 3]]"]),
    ([[5, 6.0, 7]], ["prompt 0, position 1", "6.0", "float"]),
    ([[5, 6], [7, True]], ["prompt 1, position 1", "True", "bool"]),
    ([[5, "6"]], ["prompt 0, position 1", "'6'", "str"]),
    ([[5, -1]], ["prompt 0, position 1", "token id -1", f"[0, {VOCAB})"]),
    ([[5, 6], [7, VOCAB]], ["prompt 1, position 1", f"token id {VOCAB}"]),
    ([[5], []], ["prompt 1 is empty"]),
    ("5678", ["prompts must be a list of prompts", "str"]),
    ([None], ["prompt 0 is a NoneType"]),
])
def test_check_prompts_names_the_prompt_and_position(prompts, words):
    with pytest.raises(ValueError) as info:
        check_prompts(prompts, VOCAB)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_check_prompts_takes_ints_and_numpy_integers_unchanged():
    rows = check_prompts([[1, 2], np.array([3, 4], np.int64), (np.int32(5), 255)], VOCAB)
    assert rows == [[1, 2], [3, 4], [5, 255]] and all(type(t) is int for row in rows for t in row)


def test_generate_refuses_before_any_lookup_and_without_a_warning(models, tmp_path):
    target, _ = models
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        generator = Generator.load(target, cache=cache)
        ok = generator.generate([[5, 6, 7, 8]], max_tokens=2)
        for bad in (["5678"], [[5, 6, -3]], [[5, 6.0]], [5, 6, 7], [[5, False]]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(ValueError, match="prompt 0"):
                    generator.generate(bad, max_tokens=2)
            assert caught == [], [str(w.message) for w in caught]
        assert generator.generate([[5, 6, 7, 8]], max_tokens=2)[0].tokens == ok[0].tokens


def test_a_one_token_prompt_does_not_warn(models, tmp_path):
    """A 1-token prompt's boundary checkpoint would be an empty prefix: nothing to store, so nothing to warn
    about (it warned 'cannot store an empty KVCache' on every run)."""
    target, drafter = models
    for _ in range(2):
        with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
            generator = Generator.load(target, drafter, method="assistant", cache=cache)
            with warnings.catch_warnings():
                warnings.simplefilter("error", CacheWarning)
                (result,) = generator.generate([[9]], max_tokens=3)
            assert len(result.tokens) == 3


def test_top_p_is_validated_and_sampling_is_reproducible(models):
    target, _ = models
    generator = Generator.load(target)
    with pytest.raises(ValueError, match="top_p"):
        generator.generate([[5, 6, 7]], max_tokens=2, temperature=0.8, top_p=1.5)
    first = generator.generate([[5, 6, 7]], max_tokens=4, temperature=0.8, top_p=0.9, seed=11)
    again = generator.generate([[5, 6, 7]], max_tokens=4, temperature=0.8, top_p=0.9, seed=11)
    assert first[0].tokens == again[0].tokens


def test_a_missing_model_directory_is_the_documented_model_load_error(tmp_path):
    """Issue 36 (first hour, item 9): ``ModelLoadError`` (README "Errors"), never a bare ``FileNotFoundError``, for a
    target directory that is missing, a file, or has no config.json; the CLI prints it as one line (exit 2)."""
    import subprocess
    import sys
    from pathlib import Path

    from spec_cache.errors import SpecCacheError

    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("x")
    for path, says in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory"),
                       (empty, "has no config.json")):
        with pytest.raises(ModelLoadError, match=f"target directory {path} {says}") as info:
            Generator.load(path)
        assert isinstance(info.value, (SpecCacheError, ValueError)) and not isinstance(info.value, OSError)
    out = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "store"), "generate",
                          "--model", str(empty), "--tokens", "1,2"], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.strip().splitlines() == [f"spec-cache: error: target directory {empty} has no config.json"]


def test_a_corrupt_config_and_a_wrong_drafter_kind_are_named(models, tmp_path):
    target, drafter = models
    bad = tmp_path / "bad-target"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad / 'config.json'} is not valid JSON"):
        Generator.load(bad)
    with pytest.raises(ModelLoadError, match="target directory .* does not exist"):
        Generator.load(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="drafter .*missing-drafter.* does not exist"):  # not FileNotFoundError
        Generator.load(target, tmp_path / "missing-drafter", method="assistant")
    with pytest.raises(ValueError, match="is not a 'draft-model' drafter: its config has no 'model_type'"):
        Generator.load(target, drafter, method="draft-model")
