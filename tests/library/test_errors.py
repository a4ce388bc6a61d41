"""The runtime's typed errors (``spec_cache.errors``, issue 23): each raised by a call a user can make, caught by
name and still as ``ValueError``; the scheduler prefills cold on ``RestoreRefused`` by name (and on nothing
else); the CLI's exit codes and the server's HTTP statuses, each from its one mapping; one real server request
answered 400 through that mapping."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import pytest

from spec_cache.apps.cli import main
from spec_cache.apps.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, CliError, error_line, exit_code
from spec_cache.apps.server.errors import api_error
from spec_cache.apps.server.protocol import APIError
from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.convert.gguf import UnsupportedGGUF
from spec_cache.decode.engine import RowRequest
from spec_cache.decode.generator import Generator
from spec_cache.errors import InvalidRequest, ModelLoadError, RestoreRefused, SpecCacheError, UnsupportedCombination
from spec_cache.naming.identity import ModelDirError
from spec_cache.rows.sampling import RowSampling
from spec_cache.store import InvalidInput, StoreError, StoreFullError
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.cache_controls import BadPrefixFile, NotStored, PinQuotaExceeded
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

VOCAB = 256  # write_tiny_target's default


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target, an assistant drafter for it, and a target of another hidden size (64, not 128)."""
    root = tmp_path_factory.mktemp("errors-models")
    target = write_tiny_target(root / "target", seed=3, vocab_size=VOCAB)
    drafter = write_tiny_drafter(root / "assistant", "assistant", target, seed=3)
    narrow = write_tiny_target(root / "narrow", seed=3, hidden_size=64, head_dim=32, vocab_size=VOCAB)
    return target, drafter, narrow


def test_every_class_is_a_spec_cache_error_and_a_value_error():
    for cls in (InvalidRequest, RestoreRefused, UnsupportedCombination, ModelLoadError):
        assert issubclass(cls, SpecCacheError) and issubclass(cls, ValueError), cls
    # one notion of bad input across the store and the runtime; the older named errors sit in the family
    assert issubclass(InvalidRequest, InvalidInput) and issubclass(InvalidRequest, StoreError)
    for cls in (NotStored, PinQuotaExceeded, BadPrefixFile):
        assert issubclass(cls, InvalidRequest), cls
    assert issubclass(ModelDirError, ModelLoadError) and issubclass(UnsupportedGGUF, ModelLoadError)
    for cls in (RestoreRefused, UnsupportedCombination, ModelLoadError):  # not bad input, not a store error
        assert not issubclass(cls, InvalidInput) and not issubclass(cls, StoreError), cls


def test_bad_input_to_generator_and_cache_is_invalid_request(models, tmp_path):
    target, _, _ = models
    with pytest.raises(InvalidRequest, match="durability"):
        SpecCache.open(tmp_path / "s", durability="sometimes")
    generator = Generator.load(target)
    for bad, words in (([[5, VOCAB]], f"token id {VOCAB}"), ([[5, 6.0]], "position 1"), ([[]], "prompt 0 is empty")):
        with pytest.raises(InvalidRequest, match=words):
            generator.generate(bad, max_tokens=2)
        with pytest.raises(ValueError, match=words):  # what callers caught before, still caught
            generator.generate(bad, max_tokens=2)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        generator.generate([[5, 6]], max_tokens=0)
    assert generator.generate([[5, 6]], max_tokens=2)[0].tokens  # the same generator still runs


def test_a_drafter_for_another_target_is_an_unsupported_combination(models):
    _, drafter, narrow = models
    with pytest.raises(UnsupportedCombination, match="hidden size 128; target has 64") as info:
        Generator.load(narrow, drafter)
    assert isinstance(info.value, ValueError)


def test_an_unreadable_drafter_config_is_a_model_load_error(models, tmp_path):
    target, _, _ = models
    bad = tmp_path / "drafter"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Generator.load(target, bad)
    (bad / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a JSON object"):
        Generator.load(target, bad)


def test_a_restore_that_does_not_fit_is_refused_by_name(models, tmp_path):
    """A prefix stored by one engine, restored into a request that claims one token fewer: the engine refuses
    the restored caches (``RestoreRefused``, before any model work) and takes the same prompt cold."""
    target, _, _ = models
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        generator = Generator.load(target, cache=cache)
        prompt = [5 + (i * 7) % 200 for i in range(24)]
        generator.generate([prompt], max_tokens=3)
        cache.drain()
        prepared = generator.prepare(prompt + [9], 3)
        assert prepared.cached_tokens > 1
        request = prepared.request
        request.restored_tokens -= 1  # the caches hold one token more than the request says
        request.draft_checkpoint = None
        session = generator.engine.session()
        try:
            with pytest.raises(RestoreRefused, match="holds") as info:
                session.submit(request)
            assert isinstance(info.value, ValueError) and not isinstance(info.value, InvalidRequest)
            assert session.submit(RowRequest(prompt=prompt, max_tokens=3)) >= 0  # cold, the same session: taken
        finally:
            session.close()


class _Events:
    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.done = threading.Event()

    def __call__(self, event: tuple) -> None:
        self.items.append(event)
        if event[0] in ("done", "error"):
            self.done.set()


def _run(scheduler: Scheduler, prompt: list[int], max_tokens: int) -> _Events:
    events = _Events()
    scheduler.submit(Job(prompt=list(prompt), max_tokens=max_tokens, sampling=RowSampling(), deliver=events))
    assert events.done.wait(60)
    return events


def test_the_scheduler_prefills_cold_on_restore_refused_and_on_nothing_else(tiny, tmp_path):
    """The scheduler's fallback is chosen by name: a restored prefix the engine refuses (``RestoreRefused``)
    is prefilled cold with the right tokens; any other error of the restored request fails it (400), where a
    bare ``ValueError`` used to be taken for a refused restore."""
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        generator = Generator.load(tiny.root / "target", cache=cache)
        scheduler = Scheduler(generator)
        scheduler.start()
        try:
            prompt = [4 + (i * 11) % 240 for i in range(40)]
            want = plain_greedy(tiny.target, prompt + [7], 4)
            _run(scheduler, prompt, 2)
            cache.drain()
            prepare = generator.prepare

            def shifted(sequence, budget, **options):  # the restored request claims one token fewer
                prepared = prepare(sequence, budget, **options)
                if prepared.cached_tokens:
                    prepared.request.restored_tokens -= 1
                    prepared.request.draft_checkpoint = None
                return prepared

            generator.prepare = shifted
            events = _run(scheduler, prompt + [7], 4)
            assert events.items[-1][0] == "done", events.items
            assert events.items[0] == ("start", 0), events.items  # nothing was restored: none reported cached
            assert [t for e in events.items if e[0] == "tokens" for t in e[1]] == want

            def broken(sequence, budget, **options):  # a restored request with a plain bug: not a refusal
                prepared = prepare(sequence, budget, **options)
                if prepared.cached_tokens:
                    prepared.request.sampling = "greedy"  # not a RowSampling: InvalidRequest, not RestoreRefused
                return prepared

            generator.prepare = broken
            events = _run(scheduler, prompt + [7, 8], 4)
            kind, error = events.items[-1]
            assert kind == "error" and isinstance(error, APIError) and error.status == 400, events.items
            assert "the engine refused the request" in error.message and "RowSampling" in error.message
        finally:
            generator.prepare = prepare
            scheduler.stop(5)


def test_exit_codes_and_one_line_messages_come_from_one_mapping():
    assert exit_code(CliError("x")) == EXIT_USAGE
    for exc in (InvalidRequest("bad"), UnsupportedCombination("no"), ModelLoadError("no"), StoreFullError("full"),
                FileNotFoundError("gone")):
        assert exit_code(exc) == EXIT_USAGE, exc
        assert error_line(exc) == str(exc)  # a typed error: its message, no type name
    assert exit_code(KeyboardInterrupt()) == EXIT_INTERRUPTED
    assert error_line(RuntimeError("a\n  bug")) == "RuntimeError: a bug"  # a bug: one line, led by its type
    assert error_line(ModelLoadError("first\nsecond"), first_line=True) == "first"


def test_the_cli_reports_a_library_error_on_one_line(models, tmp_path, capsys):
    """``spec-cache generate`` with a drafter of another target: the library's UnsupportedCombination, one line on
    stderr, exit 2, no traceback."""
    _, drafter, narrow = models
    code = main(["generate", "--no-cache", "--model", str(narrow), "--drafter", str(drafter),
                 "--method", "assistant", "--tokens", "5,6,7", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert err.startswith("spec-cache: error: ") and "hidden size 128; target has 64" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_http_statuses_come_from_one_mapping():
    cases = [
        (InvalidRequest("bad tokens"), 400, None, "bad tokens"),
        (InvalidInput("store input"), 400, None, "store input"),
        (BadPrefixFile("not a file"), 400, "invalid_prefix_file", "not a file"),
        (UnsupportedCombination("no such pairing"), 400, "unsupported_combination", "no such pairing"),
        (NotStored("nothing"), 404, "not_found", "nothing"),
        (PinQuotaExceeded("over"), 409, "pin_quota_exceeded", "over"),
        (ModelLoadError("broken config"), 500, "model_error", "broken config"),
        (RestoreRefused("does not fit"), 500, "restore_refused", "does not fit"),
        (StoreFullError("disk full"), 503, "cache_unavailable", "the cache failed: disk full"),
        (RuntimeError("bug"), 500, None, "bug"),
    ]
    for exc, status, code, message in cases:
        error = api_error(exc)
        assert (error.status, error.code, error.message) == (status, code, message), exc
    assert api_error(BadPrefixFile("x")).param == "file"
    refused = api_error(ValueError("odd"), context="the engine refused the request", fallback=400)
    assert (refused.status, refused.message) == (400, "the engine refused the request: odd")
    passed = APIError(429, "busy")
    assert api_error(passed) is passed


def test_a_real_server_answers_400_through_the_mapping(tmp_path):
    """``/v1/cache/import`` with bytes that are no prompt-cache file: the library's ``BadPrefixFile`` (an
    ``InvalidRequest``), answered 400 with its code by the mapping, OpenAI's error JSON, no traceback."""
    from tests.apps.test_server import Server, stopped

    target = write_tiny_target(tmp_path / "tiny", seed=7)
    server = Server(target, tmp_path / "store", tmp_path)
    try:
        r = httpx.post(server.url + "/v1/cache/import", headers=server.headers(), timeout=60,
                       json={"tokens": [5, 6, 7], "file": base64.b64encode(b"not a file").decode(),
                             "cache_salt": "mine"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_prefix_file" and error["param"] == "file", error
        assert error["type"] == "invalid_request_error" and "Traceback" not in r.text
    finally:
        stopped(server)
