"""A newcomer's first hour (issue 25), each step as a user meets it: the CLI in subprocesses, the README's Python
example run as written, the server's start-up and logs.

Tiny local models (random weights, a WordLevel tokenizer over ``w3 w4 ...`` with a chat template): nothing is
downloaded.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from spec_cache.apps.server.protocol import UNSUPPORTED

ROOT = Path(__file__).resolve().parents[2]

#: the README's library example ("The library"), as the README holds it between the markers below;
#: smollm2 is the tiny target here (a symlink in the test's working directory; tests/apps/test_readme_blocks.py
#: runs it on the real SmolLM2)
README_EXAMPLE = '''\
from spec_cache import SpecCache, Generator, KVOptions

cache = SpecCache.open("spec-cache-store", max_bytes=8 << 30)
gen = Generator.load("smollm2", "ngram", cache=cache, kv=KVOptions(), draft_depth=4)
prompts = [gen.encode("What is the capital of France?"), gen.encode("Name a prime number.")]  # chat template
results = gen.generate(prompts, max_tokens=32, temperature=0.0, seed=0, top_p=1.0)
for r in results:  # r.tokens end with the EOS id when the row stopped there; decode() leaves it out
    print(gen.decode(r.tokens), r.cached_tokens, r.drafted, r.accepted, r.ttft_s)
print(gen.generate_text(["What is the capital of France?"], max_tokens=32))  # text in, text out
cache.close()
'''
BEGIN, END = "<!-- example: runtime -->", "<!-- /example: runtime -->"


def env(tmp: Path) -> dict:
    e = dict(os.environ, SPEC_CACHE_IDENTITY_DIR=str(tmp / "identity-memo"), PYTHONUNBUFFERED="1")
    for name in ("SPEC_CACHE_API_KEY", "SPEC_CACHE_OPERATOR_KEY", "SPEC_CACHE_DIR", "LD_PRELOAD"):
        e.pop(name, None)
    return e


def spec_cache(tmp: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spec_cache", *argv], cwd=ROOT, env=env(tmp), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("first-hour") / "tiny", seed=7)


def words(text: str) -> list[str]:
    return text.split()


# -- generate ----------------------------------------------------------------------------------------------------
def test_generate_applies_the_chat_template_unless_raw(target, tmp_path):
    argv = ["--cache", str(tmp_path / "store"), "--json", "generate", "--model", str(target), "--prompt", "w5 w6 w7",
            "--max-tokens", "2"]
    chat = json.loads(spec_cache(tmp_path, *argv).stdout)
    raw = json.loads(spec_cache(tmp_path, *argv, "--raw").stdout)
    # "<s> w4 w5 w6 w7 </s> <s> w5": the tiny template's user turn and generation prompt, as mlx_lm.generate does
    assert chat["prompt_tokens"] == 8 and chat["chat_template"] is True
    assert raw["prompt_tokens"] == 3 and raw["chat_template"] is False
    assert json.loads(spec_cache(tmp_path, *argv, "--no-chat").stdout)["prompt_tokens"] == 3


def test_generate_never_prints_the_end_of_sequence_text(target, tmp_path):
    """A model whose EOS id is a plain word (``wN``): the row stops there and the word is never printed, streamed
    (one prompt) or batched (two), while ``tokens`` keep the EOS id as the library documents."""
    base = ["generate", "--no-cache", "--prompt", "w5 w6 w7", "--max-tokens", "12"]
    tokens = json.loads(spec_cache(tmp_path, "--json", *base, "--model", str(target)).stdout)["tokens"]
    i = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # a token first seen at i
    eos = tokens[i]
    model = tmp_path / "eos-model"
    shutil.copytree(target, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, eos_token_id=eos)))
    run = json.loads(spec_cache(tmp_path, "--json", *base, "--model", str(model)).stdout)
    assert run["tokens"] == tokens[:i + 1]  # stopped at the EOS id, which the result keeps
    assert words(run["text"]) == [f"w{t}" for t in tokens[:i]]
    streamed = spec_cache(tmp_path, *base, "--model", str(model))
    assert streamed.returncode == 0, streamed.stderr
    assert words(streamed.stdout) == [f"w{t}" for t in tokens[:i]]
    batched = spec_cache(tmp_path, *base, "--prompt", "w9", "--model", str(model))
    first = batched.stdout.split("--- prompt 2 ---")[0]
    assert f"w{eos}" not in words(first) and words(first)[-len(tokens[:i]):] == [f"w{t}" for t in tokens[:i]]


def test_generate_checks_the_context_before_any_work(target, tmp_path):
    out = spec_cache(tmp_path, "--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--prompt",
                     "w5 w6 w7", "--max-tokens", "100000")
    assert out.returncode == 2 and out.stdout == ""
    assert "exceeds the model's context of 4096 tokens; use --max-tokens 4088 or less" in out.stderr
    assert not (tmp_path / "store").exists()  # refused before the store was opened


def test_a_gguf_file_given_to_generate_points_at_convert_gguf_and_serve_converts_it(tmp_path):
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # not a real GGUF: generate names the converter, serve tries it
    out = spec_cache(tmp_path, "--cache", str(tmp_path / "store"), "generate", "--model", str(gguf), "--prompt", "hi")
    assert out.returncode == 2, out.stderr
    assert "is a GGUF file" in out.stderr and f"spec-cache convert-gguf {gguf} DIR" in out.stderr
    assert "does not exist" not in out.stderr
    out = spec_cache(tmp_path, "--cache", str(tmp_path / "store"), "serve", "--model", str(gguf), "--port", "0")
    assert out.returncode == 2, out.stderr
    assert f"cannot convert {gguf}" in out.stderr and f"spec-cache convert-gguf {gguf} DIR" in out.stderr
    assert "does not exist" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "store").exists()  # converted (here: tried) before the store opens


@pytest.mark.server  # spec-cache serve in a subprocess of its own
def test_serve_converts_a_real_gguf_file_once_and_answers(tmp_path):
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf
    from tests.apps.test_server import free_port

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    port, log = free_port(), tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "store"), "serve",
                             "--model", str(gguf), "--port", str(port)], cwd=ROOT,
                            env=dict(env(tmp_path), XDG_CACHE_HOME=str(tmp_path / "xdg")), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        deadline, url = time.monotonic() + 120, f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline and "ready: model" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        name = gguf.name[: -len(".gguf")]
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == name
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert f"converting {gguf.name}" in text and "converted into" in text
    assert any((tmp_path / "xdg" / "spec-cache" / "models").iterdir())


def _read_some(proc: subprocess.Popen, deadline: float) -> bytes:
    """Bytes of ``proc``'s stdout as soon as some arrive (b"" if it ended first or the deadline passed)."""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            return os.read(fd, 65536)
        if proc.poll() is not None:
            return b""
    return b""


def _sigint_default() -> None:
    """Ctrl-C as a terminal delivers it: a suite started in the background (``cmd &`` in a script, ``nohup``)
    passes SIGINT ignored to its children, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_generate_streams_its_text_and_ctrl_c_keeps_it(target, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "spec_cache", "--cache",
                             str(tmp_path / "store"), "generate", "--no-cache", "--model", str(target), "--prompt",
                             "w5 w6 w7", "--max-tokens", "4000"], cwd=ROOT, env=env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    try:
        first = _read_some(proc, time.monotonic() + 60)
        assert first and proc.poll() is None, "no text arrived while decoding (not streamed)"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (first + rest).decode()
    assert proc.returncode == 130, err.decode()
    assert text.endswith("\n") and len(words(text)) >= 1 and all(re.fullmatch(r"w\d+", w) for w in words(text))
    assert len(words(text)) < 4000  # interrupted before the end
    assert "interrupted after" in err.decode() and "Traceback" not in err.decode()


# -- the README's Python example -----------------------------------------------------------------------------------
def test_the_readme_example_runs_as_written(target, tmp_path):
    readme = (ROOT / "README.md").read_text()
    if BEGIN in readme:  # once pasted, the README holds exactly this example
        block = readme.split(BEGIN, 1)[1].split(END, 1)[0]
        assert block.strip().removeprefix("```python").removesuffix("```").strip() == README_EXAMPLE.strip()
    (tmp_path / "smollm2").symlink_to(target, target_is_directory=True)
    (tmp_path / "example.py").write_text(README_EXAMPLE)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    first_text = lines[0].rsplit(" ", 4)[0]
    assert first_text and all(re.fullmatch(r"w\d+", w) for w in first_text.split())
    assert lines[2] == repr([first_text])  # generate_text: the same text for the same prompt


def test_generator_text_helpers(target):
    from spec_cache import Generator

    gen = Generator.load(target, "ngram")
    assert gen.engine.provider is not None and type(gen.engine.provider).__name__.lower().startswith("ngram")
    assert gen.encode("w5 w6", chat=False) == [5, 6]
    assert gen.encode("w5 w6") == [1, 4, 5, 6, 2, 1, 5]  # the tiny chat template around one user message
    assert gen.decode([5, 6, 2]) == gen.decode([5, 6]) == "w5 w6"  # the EOS id (2) is not text
    with pytest.raises(ValueError, match="list of prompts"):
        gen.generate_text("w5")
    with pytest.raises(ValueError, match="takes no directory"):
        Generator.load(target, "ngram", method="draft-model")


# -- demo --real ---------------------------------------------------------------------------------------------------
def test_demo_real_names_the_openblas_fix(tmp_path):
    from spec_cache.apps import demo_real

    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    note = demo_real.blas_note("linux", "", paths=(str(lib),))
    assert f"LD_PRELOAD={lib}" in note and "11.6 s vs 64-87 s" in note
    assert "apt-get install libopenblas0-pthread" in demo_real.blas_note("linux", "", paths=(str(tmp_path / "x"),))
    assert demo_real.blas_note("linux", f"{lib}") is None  # preloaded already
    assert demo_real.blas_note("darwin", "") is None


def test_demo_real_shows_restored_ttft_only_where_a_prefix_was_restored(capsys):
    from spec_cache.apps import demo_real

    def row(request, cached, ttft):
        return {"request": request, "user": "u", "reply": "r", "prompt_tokens": 30, "cached_tokens": cached,
                "tokens": [1], "ttft_s": ttft, "drafted": 0, "accepted": 0}
    cold = [row("conv 0 turn 1", 0, 0.111), row("conv 0 turn 2", 0, 0.222)]
    warm = [row("conv 0 turn 1", 0, 0.333), row("conv 0 turn 2", 25, 0.044)]
    summary = {"weights": "4bit", "drafter": "ngram", "draft_depth": 4, "max_tokens": 8, "identical": True,
               "cached_tokens": 25, "prompt_tokens": 60, "drafted": 0, "accepted": 0, "seconds": 1.0,
               "restored_requests": 1, "restored_cold_ttft_s": 0.222, "restored_warm_ttft_s": 0.044}
    demo_real._print_report(cold, warm, summary)
    out = capsys.readouterr().out
    turn1 = next(line for line in out.splitlines() if line.startswith("conv 0 turn 1"))
    turn2 = next(line for line in out.splitlines() if line.startswith("conv 0 turn 2"))
    assert "111" in turn1 and "333" not in turn1  # a first visit has no restored TTFT
    assert "222" in turn2 and "44" in turn2
    assert "TTFT RESTORED MS" in out and "cold 222 ms, restored 44 ms" in out


# -- ls ------------------------------------------------------------------------------------------------------------
def test_ls_tells_shared_key_and_salt_tenants_apart(tmp_path):
    from spec_cache.store import Store
    from spec_cache.store.keys import tenant_id
    from tests.apps.test_cli import layers  # the inspection tests' tiny KV layers

    label = tenant_id("key:0123abcd")
    with Store.open(tmp_path / "cache", chunk_tokens=4, durable=False) as store:
        for i, (tenant, tid) in enumerate(((False, None), (True, label), (True, None))):
            ns = bytes([i + 1]) * 32
            store.register_namespace(ns, target="t" * 64, prefix_namespace=f'{{"method":"m{i}"}}', tenant=tenant,
                                     tenant_id=tid)
            store.put(ns, [1, 2, 3, 4, 5], layers([1, 2, 3, 4, 5]))
    out = spec_cache(tmp_path, "--cache", str(tmp_path / "cache"), "ls")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0][:2]: line.split()[1] for line in out.stdout.splitlines() if re.match(r"0[123]", line)}
    assert rows == {"01": "-", "02": "t:" + label.hex()[:8], "03": "t:default"}
    assert "LMDB HITS" in out.stdout and "memory tier" in out.stdout
    stats = spec_cache(tmp_path, "--cache", str(tmp_path / "cache"), "stats").stdout
    assert re.search(r"^hits +0  \(LMDB lookups answered; memory-tier hits .* not counted here\)$", stats, re.M)


# -- serve ---------------------------------------------------------------------------------------------------------
def test_serve_finds_its_port_taken_before_loading_anything(target, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = spec_cache(tmp_path, "--cache", str(tmp_path / "store"), "serve", "--model", str(target), "--port",
                         str(port))
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "nothing was loaded" in out.stderr
    assert not (tmp_path / "store").exists()  # the store was never opened
    assert "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    from tests.apps.test_server import Server

    tmp = tmp_path_factory.mktemp("first-hour-serve")
    srv = Server(target, tmp / "store", tmp, keys=("k-first-hour",), operator=None)
    yield srv
    srv.stop()


def test_serve_logs_a_ready_line_and_one_line_per_request(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    bad = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                     json={"model": "nope", "messages": [{"role": "user", "content": "w5"}]})
    assert bad.status_code == 404
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "POST /v1/chat/completions 404" not in server.log.read_text():
        time.sleep(0.1)
    log = server.log.read_text()
    assert f"ready: model tiny on {server.url}/v1; store {server.store.resolve()}" in log
    use = r.json()["usage"]
    line = next(x for x in log.splitlines() if f"POST /v1/chat/completions 200 id={r.json()['id']} " in x)
    assert f"prompt={use['prompt_tokens']}" in line and re.search(r" cached=\d+ ", line)
    assert f"generated={use['completion_tokens']}" in line and "ttft_ms=" in line and " ms=" in line
    assert "k-first-hour" not in log  # the tenant is a label, never the key
    assert re.search(r"POST /v1/chat/completions 404 id=- tenant=\w+ ms=[\d.]+ error=model_not_found", log)


@pytest.mark.parametrize("extra,status", [
    *[(extra, 400 if "logit_bias" in UNSUPPORTED else 200)  # applied once make_job passes them (issue 36 item 4)
      for extra in ({"frequency_penalty": 0.5}, {"presence_penalty": 1}, {"logit_bias": {"5": 10}})],
    # response_format is served (issue 36 item 1) where llguidance reads the tokenizer; the tiny WordLevel one: 422
    ({"response_format": {"type": "json_object"}}, 422), ({"functions": [{"name": "f"}]}, 400),
    ({"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "tools": []}, 200),
    ({"messages": [{"role": "user", "content": None}]}, 400),
    ({"messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": None},
                   {"role": "user", "content": "w6"}]}, 200),
])
def test_unsupported_parameters_and_null_content_are_explicit(server, extra, status):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        name = next(iter(extra))
        if name == "messages":
            assert "'content' is required" in error["message"]
        else:
            assert error["param"] == name and error["code"] == "unsupported_parameter"
            assert name in error["message"] and "leave it out" in error["message"]


def test_completions_logprobs_zero_is_served_and_null_is_off(server):
    """``/v1/completions`` takes ``logprobs`` as an integer (issue 36 items 2 and 6): 0 is served (each token's
    logprob, the chosen token its only alternative), null and ``false`` are off, ``true`` (chat's form) is a 400
    naming the integer form."""
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 2
    assert [list(top) for top in logprobs["top_logprobs"]] == [[token] for token in logprobs["tokens"]]
    body["logprobs"] = None
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    body["logprobs"] = False
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    body["logprobs"] = True
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 400 and "integer" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_top_k_and_min_p_are_applied_when_sampling(server, route):
    """Issue 36 item 4: top_k and min_p filter a sampled request (they were refused, and before that ignored):
    ``top_k: 1`` and ``min_p: 1`` leave only the most likely token, so a hot, seeded request answers as a greedy
    one does; a wider filter is reproducible under its seed; off values are served as before."""
    body = {"model": "tiny", "max_tokens": 6}
    body.update({"prompt": "w5 w6"} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "w5 w6"}]})
    anthropic = route == "/v1/messages"

    def text(extra):
        r = httpx.post(server.url + route, headers=server.headers(), json={**body, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        d = r.json()
        return (d["content"][0]["text"] if d["content"] else "") if anthropic else (
            d["choices"][0]["text"] if route == "/v1/completions" else d["choices"][0]["message"]["content"])
    greedy = text({"temperature": 0})
    assert text({"temperature": 1.0, "top_k": 1}) == greedy  # whatever the seed
    if not anthropic:  # (Anthropic has no min_p, nor a seed: an unknown field, refused as such)
        hot = [text({"temperature": 1.0, "seed": s}) for s in (1, 2, 3)]
        assert text({"top_k": 3, "temperature": 0.9, "seed": 4}) == text({"top_k": 3, "temperature": 0.9,
                                                                           "seed": 4})
        assert any(h != greedy for h in hot)  # sampling does change this answer: the filters above did the work
        assert text({"temperature": 1.0, "min_p": 1.0, "seed": 5}) == greedy
        assert text({"top_k": -1, "min_p": 0, "temperature": 0.7, "seed": 1}) == text({"temperature": 0.7,
                                                                                       "seed": 1})


@pytest.mark.server  # spec-cache serve in a subprocess of its own
def test_cached_tokens_grow_over_a_three_turn_chat_on_loopback_by_default(target, tmp_path):
    """First hour, item 1: on 127.0.0.1 with no API key the default granularity is 1 (exact, as mlx_lm.server
    reports), so a short conversation shows its cache working; the startup log says so and why."""
    import openai

    from tests.apps.test_server import Server

    srv = Server(target, tmp_path / "store", tmp_path, keys=(), operator=None, granularity=None)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages, cached = [], []
        for text in ("w5 w6 w7", "w8 w9", "w10 w11 w12"):
            messages.append({"role": "user", "content": text})
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            assert cached[-1] < r.usage.prompt_tokens
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        assert 0 < cached[1] < cached[2], cached  # every prompt here is far under the store's 256-token chunk
        log = srv.log.read_text()
        assert "cached_tokens exact (default on loopback 127.0.0.1 with no API key" in log
    finally:
        srv.stop()


# -- chat ----------------------------------------------------------------------------------------------------------
def test_chat_resumes_each_turn_from_the_cache_and_obeys_its_commands(target, tmp_path):
    saved = tmp_path / "conversation.json"
    script = f"w5 w6\nw7 w8\n/save {saved}\n/reset\nw5 w6\n/nope\n"
    out = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "store"), "chat", "--model",
                          str(target), "--max-tokens", "5"], cwd=ROOT, env=env(tmp_path), input=script,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    replies = out.stdout.splitlines()
    assert len(replies) == 3 and replies[0] == replies[2]  # the same first turn after /reset: the same reply
    turns = re.findall(r"\[turn (\d+): (\d+) prompt tokens, (\d+) from the cache", out.stderr)
    (t1, p1, c1), (t2, p2, c2), (t3, p3, c3) = [tuple(map(int, t)) for t in turns]
    assert (t1, t2, t3) == (1, 2, 1) and c1 == 0
    assert c2 >= p1 + 5 - 1  # turn 2 resumed past turn 1's prompt and reply (its finish checkpoint)
    assert c3 == p3 - 1  # the first turn again: restored up to its last token
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == replies[0] and messages[3]["content"] == replies[1]
    assert "[new conversation]" in out.stderr and "unknown command /nope" in out.stderr


def test_chat_takes_top_k_and_min_p(target, tmp_path):
    """``chat --top-k 1`` (and ``--min-p 1``) when sampling hot answers as the greedy chat does (issue 36)."""
    def reply(*extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "spec_cache", "chat", "--no-cache", "--model", str(target),
                              "--max-tokens", "6", *extra], cwd=ROOT, env=env(tmp_path), input="w5 w6\n",
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout
    greedy = reply()
    assert reply("--temperature", "1.5", "--top-k", "1", "--seed", "4") == greedy
    assert reply("--temperature", "1.5", "--min-p", "1", "--seed", "4") == greedy


def test_the_demo_keeps_its_models_identity_memo_in_its_own_work_directory(monkeypatch, tmp_path):
    """The tiny demo's models are deleted at the end: their identity memo must not stay in ~/.cache."""
    import argparse

    from spec_cache.apps import demo

    monkeypatch.delenv("SPEC_CACHE_IDENTITY_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seen = {}

    def fake_main(args, method, max_tokens, work, cache_dir):
        from spec_cache.naming.identity import default_memo, model_identity
        from spec_cache.testing.tiny import write_tiny_target

        seen["memo"], seen["work"] = os.environ.get("SPEC_CACHE_IDENTITY_DIR"), work
        model_identity(write_tiny_target(Path(work) / "target", seed=1, tokenizer=False), memo=default_memo())
        return 0

    monkeypatch.setattr(demo, "_main", fake_main)
    assert demo.main(argparse.Namespace(cache=str(tmp_path / "unused"), cache_given=False)) == 0
    assert seen["memo"] == os.path.join(seen["work"], "identity")
    assert "SPEC_CACHE_IDENTITY_DIR" not in os.environ and not Path(seen["work"]).exists()
    assert not (tmp_path / "xdg").exists()  # nothing written to the user's cache
