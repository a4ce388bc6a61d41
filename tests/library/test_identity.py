"""Tests for spec_cache.naming.identity: the framing contract, order and byte sensitivity, the memo, and
model directories. The digests appear in stored namespaces, so golden vectors pin them."""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import time
from pathlib import Path

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.naming import identity
from spec_cache.naming.identity import (
    MODEL_IDENTITY_SEED,
    FileChangedError,
    FileMemo,
    ModelDirError,
    artifact_identity,
    default_memo,
    model_identity,
    model_identity_files,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "identity.json"
HEX64 = set("0123456789abcdef")
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- an independent re-implementation of the documented framing ----------------------------


def reference_identity(seed: bytes, files: dict[str, bytes]) -> str:
    """The module docstring's framing, written out as one concatenation for plain blake3."""

    def u64(n: int) -> bytes:
        return struct.pack("<Q", n)

    out = [b"spec-cache/artifact-identity/v1\x00", u64(len(seed)), seed, u64(len(files))]
    for name in sorted(files, key=lambda n: n.encode("utf-8")):
        raw = name.encode("utf-8")
        out += [u64(len(raw)), raw, u64(len(files[name])), files[name]]
    return blake3.blake3(b"".join(out)).hexdigest()


def write_files(root: Path, files: dict[str, bytes]) -> list[tuple[str, Path]]:
    """Write each content to its own path (the name is not the path) and return (name, path)."""
    pairs = []
    for i, (name, content) in enumerate(files.items()):
        path = root / f"f{i}.bin"
        path.write_bytes(content)
        pairs.append((name, path))
    return pairs


def ident(seed, files: dict[str, bytes], **kw) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return artifact_identity(seed, write_files(Path(tmp), files), memo=False, **kw)


def bump_ctime(path: Path) -> None:
    """chmod until the ctime really moves (timestamps are coarse: a same-tick chmod keeps it)."""
    before = path.stat().st_ctime_ns
    mode = stat.S_IMODE(path.stat().st_mode)
    for _ in range(200):
        time.sleep(0.005)
        mode ^= stat.S_IXUSR
        os.chmod(path, mode)
        if path.stat().st_ctime_ns != before:
            return
    raise AssertionError("ctime did not change")


class DictMemo:
    def __init__(self):
        self.data: dict[str, str] = {}
        self.gets = 0
        self.puts = 0

    def get(self, key):
        self.gets += 1
        return self.data.get(key)

    def put(self, key, digest):
        self.puts += 1
        self.data[key] = digest


names = st.text(alphabet="ab/é\U0001F600", min_size=0, max_size=4)
contents = st.binary(max_size=12)
file_sets = st.dictionaries(names, contents, max_size=4)
seeds = st.one_of(st.binary(max_size=6), st.text(alphabet="ab\x00é", max_size=4))


def seed_bytes(seed) -> bytes:
    return seed.encode("utf-8") if isinstance(seed, str) else seed


# --- the framing -----------------------------------------------------------------------------


@PROPS
@given(seeds, file_sets)
def test_matches_independent_reference_framing(seed, files):
    digest = ident(seed, files)
    assert len(digest) == 64 and set(digest) <= HEX64
    assert digest == reference_identity(seed_bytes(seed), files)


@PROPS
@given(seeds, file_sets, st.randoms(use_true_random=False))
def test_order_of_files_does_not_matter(seed, files, rnd):
    with tempfile.TemporaryDirectory() as tmp:
        pairs = write_files(Path(tmp), files)
        shuffled = list(pairs)
        rnd.shuffle(shuffled)
        first = artifact_identity(seed, pairs, memo=False)
        assert artifact_identity(seed, iter(shuffled), memo=False) == first


@PROPS
@given(seeds, file_sets.filter(lambda f: any(f.values())), st.data())
def test_every_content_byte_counts(seed, files, data):
    name = data.draw(st.sampled_from(sorted(n for n, c in files.items() if c)))
    pos = data.draw(st.integers(0, len(files[name]) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(files[name])
    flipped[pos] ^= 1 << bit
    assert ident(seed, files) != ident(seed, {**files, name: bytes(flipped)})


@PROPS
@given(seeds, file_sets.filter(bool), names, st.data())
def test_file_name_counts(seed, files, new_name, data):
    old = data.draw(st.sampled_from(sorted(files)))
    if new_name in files:
        return
    renamed = {(new_name if n == old else n): c for n, c in files.items()}
    assert ident(seed, files) != ident(seed, renamed)


@PROPS
@given(seeds, seeds, file_sets)
def test_seed_counts(seed_a, seed_b, files):
    if seed_bytes(seed_a) == seed_bytes(seed_b):
        assert ident(seed_a, files) == ident(seed_b, files)
    else:
        assert ident(seed_a, files) != ident(seed_b, files)


@PROPS
@given(seeds, file_sets, seeds, file_sets)
def test_different_inputs_never_collide(seed_a, files_a, seed_b, files_b):
    """With a tiny alphabet, plain concatenation collides often; the framing must not."""
    same = seed_bytes(seed_a) == seed_bytes(seed_b) and files_a == files_b
    assert (ident(seed_a, files_a) == ident(seed_b, files_b)) == same


@pytest.mark.parametrize(
    "a, b",
    [
        # (seed, {name: content}) pairs that concatenate to the same bytes without framing
        ((b"s", {"ab": b"c"}), (b"s", {"a": b"bc"})),  # name/content boundary
        ((b"s", {"a": b"", "bc": b"x"}), (b"s", {"ab": b"", "c": b"x"})),  # name split
        ((b"s", {"a": b"xbq"}), (b"s", {"a": b"x", "b": b"q"})),  # content swallows a file
        ((b"sa", {"b": b"c"}), (b"s", {"ab": b"c"})),  # seed / first name
        ((b"", {"a": b""}), (b"a", {})),  # an empty file vs no file
        ((b"s", {"a": b"b"}), (b"s", {"a": b"", "b": b""})),  # file count
    ],
)
def test_ambiguous_splits_give_different_digests(a, b):
    (seed_a, files_a), (seed_b, files_b) = a, b
    naive_a = seed_a + b"".join(n.encode() + files_a[n] for n in sorted(files_a))
    naive_b = seed_b + b"".join(n.encode() + files_b[n] for n in sorted(files_b))
    assert naive_a == naive_b  # the pair really is ambiguous without framing
    assert ident(seed_a, files_a) != ident(seed_b, files_b)


def test_names_sort_by_utf8_bytes_not_utf16():
    # U+FF61 sorts before U+1F600 by code point (UTF-8), after it by UTF-16 code unit.
    files = {"\U0001F600": b"1", "\uff61": b"2", "B": b"3", "a": b"4"}
    assert ident(b"x", files) == reference_identity(b"x", files)


def test_str_seed_is_its_utf8_bytes():
    assert ident("né", {"a": b"1"}) == ident("né".encode(), {"a": b"1"})


def test_empty_files_and_no_files(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert artifact_identity(b"s", [("e", empty)], memo=False) == reference_identity(b"s", {"e": b""})
    assert artifact_identity(b"s", [], memo=False) == reference_identity(b"s", {})


def test_large_file_hashed_in_pieces_matches_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "_PIECE", 4096)
    content = os.urandom(3 * 4096 + 17)
    path = tmp_path / "w"
    path.write_bytes(content)
    calls = []
    got = artifact_identity(b"s", [("w", path), ("z", tmp_path / "w")], memo=False,
                            progress=lambda d, t: calls.append((d, t)))
    assert got == reference_identity(b"s", {"w": content, "z": content})
    total = 2 * len(content)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert len(calls) >= 8  # four pieces per file
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    assert all(t == total for _, t in calls)


# --- bad input -------------------------------------------------------------------------------


def test_duplicate_names_raise(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"2")
    with pytest.raises(ValueError, match="duplicate file name 'x'"):
        artifact_identity(b"s", [("x", tmp_path / "a"), ("x", tmp_path / "b")], memo=False)


def test_missing_file_raises_naming_it(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        artifact_identity(b"s", [("a", tmp_path / "a"), ("weights", missing)], memo=False)
    assert "weights" in str(info.value) and str(missing) in str(info.value)


@pytest.mark.parametrize(
    "seed, files, exc",
    [
        (1, [], TypeError),
        (b"s", "abc", TypeError),
        (b"s", [("a",)], TypeError),
        (b"s", [(b"a", "x")], TypeError),
        (b"s", [("\udc80", "x")], ValueError),
    ],
)
def test_bad_arguments_raise_typed_errors(seed, files, exc):
    with pytest.raises(exc):
        artifact_identity(seed, files, memo=False)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        artifact_identity(b"s", [("d", tmp_path)], memo=False)


def test_bad_memo_argument(tmp_path):
    with pytest.raises(TypeError):
        artifact_identity(b"s", [], memo=True)
    with pytest.raises(TypeError):
        artifact_identity(b"s", [], memo=object())


# --- files that change while hashed ----------------------------------------------------------


def test_file_edited_during_hashing_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "_PIECE", 1024)
    path = tmp_path / "w"
    path.write_bytes(os.urandom(4096))
    memo = DictMemo()

    def grow(done, total):
        if 0 < done < total:
            with open(path, "ab") as fh:
                fh.write(b"more")

    with pytest.raises(FileChangedError, match="changed while hashing.*'w'"):
        artifact_identity(b"s", [("w", path)], memo=memo, progress=grow)
    assert memo.puts == 0


def test_file_replaced_after_its_turn_raises(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first")
    b.write_bytes(b"second")
    memo = DictMemo()
    state = {"done": False}

    def replace_a(done, total):
        if done and not state["done"]:  # a (sorted first) is hashed; swap in a new inode
            state["done"] = True
            (tmp_path / "new").write_bytes(b"FIRST")
            os.replace(tmp_path / "new", a)

    with pytest.raises(FileChangedError, match="'a'"):
        artifact_identity(b"s", [("a", a), ("b", b)], memo=memo, progress=replace_a)
    assert memo.puts == 0


def test_file_removed_during_hashing_raises(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first")
    b.write_bytes(b"second")

    def remove_a(done, total):
        if done == len(b"first"):
            a.unlink()

    with pytest.raises(FileChangedError, match="'a'"):
        artifact_identity(b"s", [("a", a), ("b", b)], memo=False, progress=remove_a)


# --- the memo --------------------------------------------------------------------------------


@pytest.fixture
def weights(tmp_path):
    files = {"config.json": b'{"x": 1}', "model.safetensors": os.urandom(5000)}
    pairs = [(n, tmp_path / n) for n in files]
    for n, c in files.items():
        (tmp_path / n).write_bytes(c)
    return pairs, reference_identity(b"seed", files)


def forbid_hashing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("content was hashed on what should be a memo hit")

    monkeypatch.setattr(identity, "_digest_files", boom)


def test_memo_hit_does_not_read_content(weights, tmp_path, monkeypatch):
    pairs, expected = weights
    memo = FileMemo(tmp_path / "memo")
    assert artifact_identity(b"seed", pairs, memo=memo) == expected
    forbid_hashing(monkeypatch)
    calls = []
    assert artifact_identity(b"seed", pairs, memo=memo, progress=lambda *a: calls.append(a)) == expected
    total = sum(p.stat().st_size for _, p in pairs)
    assert calls == [(0, total), (total, total)]


def test_memo_key_depends_on_seed_and_names(weights, monkeypatch):
    pairs, _ = weights
    memo = DictMemo()
    artifact_identity(b"seed", pairs, memo=memo)
    artifact_identity(b"other", pairs, memo=memo)
    artifact_identity(b"seed", [("renamed", p) if n == "config.json" else (n, p) for n, p in pairs], memo=memo)
    assert memo.puts == 3 and len(memo.data) == 3


def test_memo_miss_after_mtime_change(weights, monkeypatch):
    pairs, expected = weights
    memo = DictMemo()
    artifact_identity(b"seed", pairs, memo=memo)
    path = pairs[1][1]
    st_ = path.stat()
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns - 10**9))
    forbid_hashing(monkeypatch)
    with pytest.raises(AssertionError, match="memo hit"):
        artifact_identity(b"seed", pairs, memo=memo)


def test_memo_miss_after_ctime_change(weights, monkeypatch):
    pairs, _ = weights
    memo = DictMemo()
    artifact_identity(b"seed", pairs, memo=memo)
    bump_ctime(pairs[0][1])
    forbid_hashing(monkeypatch)
    with pytest.raises(AssertionError, match="memo hit"):
        artifact_identity(b"seed", pairs, memo=memo)


def test_memo_miss_after_content_edit_gives_new_digest(weights):
    pairs, expected = weights
    memo = DictMemo()
    assert artifact_identity(b"seed", pairs, memo=memo) == expected
    path = pairs[0][1]
    path.write_bytes(b'{"x": 2}')  # same size; mtime/ctime move (force it if the tick did not)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    new = artifact_identity(b"seed", pairs, memo=memo)
    assert new != expected
    assert new == reference_identity(b"seed", {n: p.read_bytes() for n, p in pairs})


@pytest.mark.parametrize("value", [b"", b"zz" * 32, b"A" * 64, b"0" * 63, b"\xff" * 64, b"0" * 65])
def test_corrupt_memo_value_is_a_miss(weights, tmp_path, value):
    pairs, expected = weights
    memo = FileMemo(tmp_path / "memo")
    artifact_identity(b"seed", pairs, memo=memo)
    (entry,) = [p for p in (tmp_path / "memo").iterdir()]
    entry.write_bytes(value)
    assert artifact_identity(b"seed", pairs, memo=memo) == expected
    assert entry.read_text() == expected  # repaired


def test_unreadable_memo_entry_is_a_miss(weights, tmp_path):
    pairs, expected = weights
    memo = FileMemo(tmp_path / "memo")
    artifact_identity(b"seed", pairs, memo=memo)
    (entry,) = list((tmp_path / "memo").iterdir())
    entry.unlink()
    entry.mkdir()  # reading it fails with IsADirectoryError; so does replacing it
    assert artifact_identity(b"seed", pairs, memo=memo) == expected
    assert sorted(p.name for p in (tmp_path / "memo").iterdir()) == [entry.name]  # no tmp left


class BrokenMemo:
    def __init__(self, value=None, fail=False):
        self.value, self.fail = value, fail

    def get(self, key):
        if self.fail:
            raise RuntimeError("backend down")
        return self.value

    def put(self, key, digest):
        if self.fail:
            raise RuntimeError("backend down")


@pytest.mark.parametrize("memo", [BrokenMemo(fail=True), BrokenMemo(value=123), BrokenMemo(value="0" * 64 + "\n")])
def test_failing_or_garbage_memo_is_a_miss(weights, memo):
    pairs, expected = weights
    assert artifact_identity(b"seed", pairs, memo=memo) == expected


def test_memo_false_never_touches_memo(weights, tmp_path, monkeypatch):
    pairs, expected = weights
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "default"))
    assert artifact_identity(b"seed", pairs, memo=False) == expected
    assert not (tmp_path / "default").exists()


def test_memo_none_uses_default_memo(weights, tmp_path, monkeypatch):
    pairs, expected = weights
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "default"))
    assert artifact_identity(b"seed", pairs) == expected
    (entry,) = list((tmp_path / "default").iterdir())
    assert entry.read_text() == expected
    forbid_hashing(monkeypatch)
    assert artifact_identity(b"seed", pairs) == expected


def test_memoized_call_is_fast(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text("{}")
    for i in range(4):
        (model / f"model-{i:05d}.safetensors").write_bytes(os.urandom(1 << 20))
    memo = FileMemo(tmp_path / "memo")
    first = model_identity(model, memo=memo)
    times = []
    for _ in range(21):
        t = time.perf_counter()
        assert model_identity(model, memo=memo) == first
        times.append(time.perf_counter() - t)
    assert sorted(times)[len(times) // 2] < 0.005


# --- FileMemo and default_memo ---------------------------------------------------------------


def test_file_memo_roundtrip_and_permissions(tmp_path):
    memo = FileMemo(tmp_path / "a" / "memo")
    key, digest = "1" * 64, "f" * 64
    assert memo.get(key) is None
    assert not (tmp_path / "a").exists()  # created lazily
    memo.put(key, digest)
    assert memo.get(key) == digest
    assert stat.S_IMODE((tmp_path / "a" / "memo").stat().st_mode) == 0o700
    assert os.listdir(tmp_path / "a" / "memo") == [key]


def test_file_memo_ignores_bad_keys_and_values(tmp_path):
    memo = FileMemo(tmp_path / "memo")
    memo.put("../escape" + "0" * 55, "f" * 64)
    memo.put("1" * 64, "not a digest")
    assert not (tmp_path / "memo").exists() or os.listdir(tmp_path / "memo") == []
    assert memo.get("../" + "0" * 61) is None


def test_file_memo_swallows_write_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    memo = FileMemo(blocker / "memo")  # parent is a file: makedirs fails
    memo.put("1" * 64, "f" * 64)
    assert memo.get("1" * 64) is None


def test_default_memo_location(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_memo().directory == tmp_path / "explicit"
    monkeypatch.delenv("SPEC_CACHE_IDENTITY_DIR")
    assert default_memo().directory == tmp_path / "xdg" / "spec-cache" / "identity"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_memo().directory == tmp_path / "home" / ".cache" / "spec-cache" / "identity"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_memo().directory == tmp_path / "home" / ".cache" / "spec-cache" / "identity"


# --- model directories -----------------------------------------------------------------------


def make_model(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return root


MODEL = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "model-00001-of-00002.safetensors": b"\x00" * 100,
    "model-00002-of-00002.safetensors": b"\x01" * 50,
}


def test_model_identity_is_artifact_identity_of_the_documented_files(tmp_path):
    d = make_model(tmp_path / "m", MODEL)
    assert model_identity(d, memo=False) == reference_identity(MODEL_IDENTITY_SEED, MODEL)
    assert MODEL_IDENTITY_SEED == b"spec-cache/model-identity/v1"
    assert [n for n, _ in model_identity_files(d)] == sorted(MODEL)


def test_model_identity_ignores_dir_name_and_unrelated_files(tmp_path):
    a = make_model(tmp_path / "model-a", MODEL)
    extra = {
        "README.md": b"# hi",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        ".hidden.safetensors": b"junk",
        "sub/nested.safetensors": b"nested",
        "weights.safetensors.bak": b"old",
    }
    b = make_model(tmp_path / "elsewhere" / "model-b", {**MODEL, **extra})
    assert model_identity(a, memo=False) == model_identity(b, memo=False)
    assert model_identity(str(a), memo=False) == model_identity(os.fsencode(a), memo=False)


@pytest.mark.parametrize("name", sorted(MODEL))
def test_model_identity_follows_each_counted_file(tmp_path, name):
    a = make_model(tmp_path / "a", MODEL)
    b = make_model(tmp_path / "b", {**MODEL, name: MODEL[name] + b" "})
    assert model_identity(a, memo=False) != model_identity(b, memo=False)


def test_model_identity_extra_shard_counts(tmp_path):
    a = make_model(tmp_path / "a", MODEL)
    b = make_model(tmp_path / "b", {**MODEL, "adapter.safetensors": b""})
    assert model_identity(a, memo=False) != model_identity(b, memo=False)


def test_model_identity_through_symlinks(tmp_path):
    blobs = make_model(tmp_path / "blobs", {"b1": MODEL["config.json"], "b2": b"w"})
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").symlink_to(blobs / "b1")
    (snap / "model.safetensors").symlink_to(blobs / "b2")
    expected = reference_identity(MODEL_IDENTITY_SEED, {"config.json": MODEL["config.json"], "model.safetensors": b"w"})
    memo = DictMemo()
    assert model_identity(snap, memo=memo) == expected
    (snap / "model.safetensors").unlink()
    (blobs / "b3").write_bytes(b"W")
    (snap / "model.safetensors").symlink_to(blobs / "b3")  # a new revision: the link target moves
    assert model_identity(snap, memo=memo) != expected
    assert memo.puts == 2


def test_dangling_weight_link_is_not_skipped(tmp_path):
    d = make_model(tmp_path / "m", {"config.json": b"{}", "a.safetensors": b"1"})
    (d / "b.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="b.safetensors"):
        model_identity(d, memo=False)


def test_dspark_family(tmp_path):
    files = {"dspark.json": b'{"block_size": 16}', "model.safetensors": b"w"}
    d = make_model(tmp_path / "dspark", files)
    assert model_identity(d, memo=False) == reference_identity(MODEL_IDENTITY_SEED, files)
    assert model_identity(d, config_name="dspark.json", memo=False) == model_identity(d, memo=False)
    # with both present, config.json wins by default; config_name picks dspark.json
    both = make_model(tmp_path / "both", {**files, "config.json": b"{}"})
    assert model_identity(both, memo=False) == reference_identity(
        MODEL_IDENTITY_SEED, {"config.json": b"{}", "model.safetensors": b"w"}
    )
    assert model_identity(both, config_name="dspark.json", memo=False) == model_identity(d, memo=False)
    # the config's name is framed: the same bytes as config.json give another digest
    renamed = make_model(tmp_path / "renamed", {"config.json": files["dspark.json"], "model.safetensors": b"w"})
    assert model_identity(renamed, memo=False) != model_identity(d, memo=False)


def test_missing_config_raises_model_dir_error(tmp_path):
    d = make_model(tmp_path / "noconf", {"model.safetensors": b"w"})
    with pytest.raises(ModelDirError, match=r"noconf has no config\.json"):
        model_identity(d, memo=False)
    with pytest.raises(ModelDirError, match=r"noconf has no dspark\.json"):
        model_identity(d, config_name="dspark.json", memo=False)
    assert issubclass(ModelDirError, ValueError)


def test_missing_weights_raises_model_dir_error(tmp_path):
    d = make_model(tmp_path / "noweights", {"config.json": b"{}", "README.md": b"", "sub/x.safetensors": b""})
    with pytest.raises(ModelDirError, match=r"noweights has no \*\.safetensors weights"):
        model_identity(d, memo=False)


def test_not_a_directory_raises_model_dir_error(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ModelDirError, match="is not a directory"):
        model_identity(f, memo=False)
    with pytest.raises(ModelDirError, match="does not exist"):
        model_identity(tmp_path / "absent", memo=False)


@pytest.mark.parametrize("bad", ["", "sub/config.json", "..", "."])
def test_config_name_must_be_a_plain_name(tmp_path, bad):
    d = make_model(tmp_path / "m", MODEL)
    with pytest.raises(ValueError):
        model_identity(d, config_name=bad, memo=False)


def test_model_memo_hit(tmp_path, monkeypatch):
    d = make_model(tmp_path / "m", MODEL)
    memo = FileMemo(tmp_path / "memo")
    first = model_identity(d, memo=memo)
    forbid_hashing(monkeypatch)
    assert model_identity(d, memo=memo) == first
    (d / "README.md").write_text("unrelated files do not invalidate the memo")
    assert model_identity(d, memo=memo) == first


# --- golden vectors: these digests are stored in namespaces and must never change -----------


def golden():
    return json.loads(GOLDEN.read_text())


def vector_seed(v) -> bytes:
    return bytes.fromhex(v["seed_hex"]) if "seed_hex" in v else v["seed"].encode("utf-8")


@pytest.mark.parametrize("v", golden()["artifact_identity"], ids=lambda v: v["label"])
def test_golden_artifact_identity(tmp_path, v):
    files = {f["name"]: bytes.fromhex(f["content_hex"]) for f in v["files"]}
    pairs = write_files(tmp_path, files)  # in the vector's (not sorted) order
    seed = v["seed"] if "seed" in v else vector_seed(v)
    assert artifact_identity(seed, pairs, memo=False) == v["digest"]
    assert reference_identity(vector_seed(v), files) == v["digest"]


@pytest.mark.parametrize("v", golden()["model_identity"], ids=lambda v: v["label"])
def test_golden_model_identity(tmp_path, v):
    files = {f["name"]: bytes.fromhex(f["content_hex"]) for f in v["files"]}
    d = make_model(tmp_path / "some-model", files)
    assert model_identity(d, config_name=v["config_name"], memo=False) == v["digest"]
    hashed = {n: files[n] for n in v["hashed"]}
    assert reference_identity(MODEL_IDENTITY_SEED, hashed) == v["digest"]
    assert [n for n, _ in model_identity_files(d, config_name=v["config_name"])] == sorted(v["hashed"])


def test_golden_file_covers_both_functions():
    g = golden()
    assert len(g["artifact_identity"]) >= 4 and len(g["model_identity"]) >= 3
    digests = [v["digest"] for v in g["artifact_identity"] + g["model_identity"]]
    assert len(set(digests)) == len(digests)
