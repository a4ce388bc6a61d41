"""Echo with prompt logprobs from the cache (issue 36): an ``echo`` + ``logprobs`` request restores its prompt from
the KV cache as far as the scheduler's table of prompt scores (``logprobs.PromptScores``, per tenant and
``logprobs`` count) covers it, and answers the stored scores there and the engine's after. The answer is the very
JSON a cold request gets (bit for bit: the same floats, tokens, alternatives and offsets), ``cached_tokens`` says
what was restored, and nothing crosses tenants (API keys, cache salts).

The cold answers come from requests under salts of their own (a fresh tenant: an empty table and namespace)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from spec_cache.apps.server.logprobs import PromptScores
from spec_cache.rows.logprobs import TokenLogprob
from tests.apps.test_server import KEY_A, KEY_B, Server, stopped
from tests.apps.test_server_logprobs import model, reference  # noqa: F401 (fixtures)

TOL = 1e-4
CONTEXT = " ".join(f"w{20 + (i * 7) % 60}" for i in range(40))
CHOICES = [" w5 w6 w7", " w9", " w11 w12 w13 w14 w15", " w5 w8"]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("serve-echo-cache")
    srv = Server(model[0], tmp / "store", tmp, drafter=model[1])
    yield srv
    stopped(srv)


def echo(srv, prompt, *, key=KEY_A, salt=None, logprobs=2, max_tokens=0) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": logprobs,
            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(srv.url + "/v1/completions", headers=srv.headers(key), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def cold(srv, prompt, **options) -> dict:
    return echo(srv, prompt, salt=f"cold-{uuid.uuid4().hex}", **options)


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def same(a: dict, b: dict) -> None:
    """The same answer: every choice's text and logprobs JSON, equal (floats compared exactly)."""
    assert [(c["index"], c["text"], c["logprobs"]) for c in a["choices"]] == \
           [(c["index"], c["text"], c["logprobs"]) for c in b["choices"]]


def test_echo_restores_what_the_table_scored_and_answers_the_cold_bits(server, reference):
    """lm-eval's multiple choice, one request per choice: the first choice prefills cold and fills the table; each
    next one restores the shared context and its answer equals a cold request's exactly; the same request again
    restores all but its last token."""
    tokenizer, _, forward = reference
    ids = [[int(t) for t in tokenizer.encode(CONTEXT + choice)] for choice in CHOICES]
    context = len(tokenizer.encode(CONTEXT))
    assert all(p[:context] == ids[0][:context] for p in ids)
    salt = f"mc-{uuid.uuid4().hex}"
    colds = [cold(server, p) for p in ids]
    for reply in colds:
        assert cached(reply) == 0
    for i, (prompt, reference_reply) in enumerate(zip(ids, colds)):
        reply = echo(server, prompt, salt=salt)
        same(reply, reference_reply)
        # restored: the prompt up to where it parts from the ones before (what the table scored), but its last
        # token (whose score the restored state cannot give)
        shared = max((common(prompt, before) for before in ids[:i]), default=0)
        assert shared >= (context if i else 0)
        assert cached(reply) == max(shared - 1, 0)
        rows = forward(prompt)
        values = reply["choices"][0]["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(prompt)
        for p in range(1, len(prompt)):
            assert abs(values[p] - rows[p - 1][prompt[p]]) < TOL
    again = echo(server, ids[2], salt=salt)
    same(again, colds[2])
    assert cached(again) == len(ids[2]) - 1
    # max_tokens 1 (lm-eval's other form): the prompt from the table, the generated token's entry after it
    one = echo(server, ids[3], salt=salt, max_tokens=1)
    same(one, cold(server, ids[3], max_tokens=1))
    assert cached(one) == len(ids[3]) - 1


def test_other_logprobs_counts_and_tenants_start_cold(server):
    """The table is per tenant and per ``logprobs`` count: another count, another cache salt, another API key
    restore nothing from what one tenant scored, and get the cold answer."""
    prompt = CONTEXT + " w40 w41"
    salt = f"t-{uuid.uuid4().hex}"
    first = echo(server, prompt, salt=salt)
    assert cached(echo(server, prompt, salt=salt)) > 0
    other_count = echo(server, prompt, salt=salt, logprobs=1)
    assert cached(other_count) == 0  # the KV is there; the table has no scores with 1 alternative
    same(other_count, cold(server, prompt, logprobs=1))
    assert cached(echo(server, prompt, salt=f"{salt}-other")) == 0
    other_key = echo(server, prompt, salt=salt, key=KEY_B)
    assert cached(other_key) == 0
    same(other_key, first)


def test_batched_prompts_share_the_context(server, reference):
    """lm-eval's batched loglikelihood (several prompts per request, the choices of one question together): one
    prompt prefills the context, the others wait for its scores and restore the context (``Scheduler._echo_waits``);
    every answer is the cold one; a second batch of the same context restores it at once."""
    tokenizer = reference[0]
    prompts = [CONTEXT + " w3" + choice for choice in CHOICES]
    ids = [[int(t) for t in tokenizer.encode(p)] for p in prompts]
    colds = [cold(server, p) for p in prompts]
    salt = f"b-{uuid.uuid4().hex}"
    first = echo(server, prompts, salt=salt)
    # the first prompt (admitted first) prefills cold; the others restore up to where they part from it, but the
    # last token there (whose score the restored state cannot give)
    assert cached(first) == sum(common(ids[0], p) - 1 for p in ids[1:])
    for choice, reference_reply in zip(sorted(first["choices"], key=lambda c: c["index"]), colds):
        assert (choice["text"], choice["logprobs"]) == (reference_reply["choices"][0]["text"],
                                                        reference_reply["choices"][0]["logprobs"])
    second = echo(server, [CONTEXT + " w3" + choice for choice in CHOICES[1:]], salt=salt)
    assert cached(second) == sum(len(p) - 1 for p in ids[1:])  # every one of them scored already
    for choice, reference_reply in zip(sorted(second["choices"], key=lambda c: c["index"]), colds[1:]):
        assert choice["logprobs"] == reference_reply["choices"][0]["logprobs"]


def entry(token: int, top: int = 2) -> TokenLogprob:
    return TokenLogprob(token, -0.5, tuple((t, -1.0) for t in range(top)))


def scores(prompt, top=2):
    return [None] + [entry(t, top) for t in prompt[1:]]


def test_prompt_scores_longest_prefix_per_tenant_and_count():
    table = PromptScores()
    table.put("a", 2, [1, 2, 3, 4], scores([1, 2, 3, 4]))
    assert table.longest("a", 2, [1, 2, 3, 9, 9]) == (3, scores([1, 2, 3]))
    assert table.longest("a", 2, [1, 2, 3, 4, 5]) == (4, scores([1, 2, 3, 4]))
    assert table.longest("a", 2, [7, 2]) == (0, [])
    assert table.longest("b", 2, [1, 2, 3]) == (0, [])  # another tenant
    assert table.longest(None, 2, [1, 2, 3]) == (0, [])
    assert table.longest("a", 1, [1, 2, 3]) == (0, [])  # another logprobs count
    # a prompt an entry covers adds nothing
    table.put("a", 2, [1, 2], scores([1, 2]))
    table.put("a", 2, [1, 2, 3, 4], scores([1, 2, 3, 4]))
    assert len(table) == 1
    table.put("a", 2, [1, 2, 3, 4, 5], scores([1, 2, 3, 4, 5]))
    assert len(table) == 2 and table.longest("a", 2, [1, 2, 3, 4, 5, 6])[0] == 5
    # incomplete scores are not kept
    table.put("a", 2, [8, 9, 10], [None, entry(9), None])
    table.put("a", 2, [8, 9, 10], scores([8, 9]))
    assert len(table) == 2


def test_prompt_scores_long_prompts_through_the_index():
    """Prompts longer than the index's blocks: the longest common prefix is found exactly, at any offset, among
    many entries that share a long context (lm-eval's choices), and dropped entries leave the index."""
    table = PromptScores(max_entries=50)
    context = list(range(100, 300))
    for choice in range(60):  # the first 10 leave (max_entries)
        prompt = context + [choice] * (choice % 11 + 1)
        table.put("a", 1, prompt, scores(prompt, 1))
    assert len(table) == 50
    for cut in (0, 1, 7, 8, 9, 150, 199, 200):
        assert table.longest("a", 1, context[:cut] + [-1])[0] == cut
    assert table.longest("a", 1, context + [54] * 3 + [0])[0] == 203  # choice 54: 11 of them
    assert table.longest("a", 1, context + [5, 5])[0] == 200  # choice 5 left; the context is still known
    assert table.longest("b", 1, context)[0] == 0
    for first in range(60, 120):  # every earlier entry leaves: nothing of them stays indexed
        table.put("a", 1, [-first, 1], scores([-first, 1], 1))
    assert table.longest("a", 1, context)[0] == 0
    assert len(table._index) == 1  # the empty prefix alone: two-token prompts index no block


def test_prompt_scores_bounded_least_recently_used_first():
    table = PromptScores(max_entries=2)
    for first in (1, 2, 3):
        table.put("a", 2, [first, 5, 6], scores([first, 5, 6]))
    assert len(table) == 2 and table.longest("a", 2, [1, 5, 6])[0] == 0
    table.longest("a", 2, [2, 5, 6])  # used: 3 goes next
    table.put("a", 2, [4, 5, 6], scores([4, 5, 6]))
    assert table.longest("a", 2, [2, 5, 6])[0] == 3 and table.longest("a", 2, [3, 5, 6])[0] == 0
    size = table.bytes // 2
    table = PromptScores(max_bytes=size * 2)
    for first in (1, 2, 3):
        table.put("a", 2, [first, 5, 6], scores([first, 5, 6]))
    assert len(table) == 2 and table.bytes <= size * 2
    assert table.longest("a", 2, [1, 5, 6])[0] == 0
    tiny = PromptScores(max_bytes=10)  # an entry larger than the whole table is not kept
    tiny.put("a", 2, [1, 5, 6], scores([1, 5, 6]))
    assert len(tiny) == 0 and tiny.bytes == 0


def test_a_context_longer_than_a_prefill_chunk(server):
    """A context over the prefill chunk (512 tokens): the cold request forwards the choice inside its second
    chunk, the warm one in a chunk of its own after the restored context; the same bits."""
    long_context = " ".join(f"w{(i * 13) % 90}" for i in range(600))
    prompts = [long_context + choice for choice in CHOICES[:3]]
    colds = [cold(server, p) for p in prompts]
    salt = f"long-{uuid.uuid4().hex}"
    for i, (prompt, reference_reply) in enumerate(zip(prompts, colds)):
        reply = echo(server, prompt, salt=salt)
        same(reply, reference_reply)
        assert (cached(reply) >= 599) == (i > 0)  # the context but its last token


#: lm-eval multiple choice over contexts longer than the wait threshold: three questions, four choices each
LM_EVAL_ROWS = [{"q": " ".join(f"w{(i * k) % 80 + 3}" for i in range(48)),
                  "choices": ["w5 w6", "w7", "w8 w9 w10", "w11"], "gold": 0} for k in (3, 7, 11)]


def test_lm_eval_multiple_choice_restores_its_contexts(server, tmp_path, monkeypatch):
    """lm-eval's ``local-completions`` loglikelihood (batch size 4: a question's choices in one request): the
    contexts are restored (``spec_cache_cached_prompt_tokens_total`` grows by most of them), and every answer
    lm-eval sums its loglikelihoods from equals a cold request's of the same token ids, exactly."""
    lm_eval = pytest.importorskip("lm_eval")
    import json

    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from tests.apps.test_lm_eval import model_path, task_yaml

    monkeypatch.setenv("OPENAI_API_KEY", KEY_A)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    sent = []

    def recording(self, *args, _create=LocalCompletionsAPI._create_payload, **kwargs):
        body = _create(self, *args, **kwargs)
        sent.append(json.loads(json.dumps(body)))
        return body
    monkeypatch.setattr(LocalCompletionsAPI, "_create_payload", recording)
    answers = []

    def parse(outputs, *args, _parse=LocalCompletionsAPI.parse_logprobs, **kwargs):
        answers.extend(outputs if isinstance(outputs, list) else [outputs])
        return _parse(outputs, *args, **kwargs)
    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(parse))
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in LM_EVAL_ROWS))
    (tmp_path / "echo_mc.yaml").write_text(task_yaml(
        "echo_mc", data, tmp_path / "datasets", "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"))
    before = server.metric("spec_cache_cached_prompt_tokens_total")
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args={"model": "tiny", "base_url": server.url + "/v1/completions",
                                               "max_retries": 1, "timeout": 120, "batch_size": 4,
                                               "tokenizer": str(model_path(server)),
                                               "tokenizer_backend": "huggingface"},
        tasks=["echo_mc"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
        fewshot_random_seed=0)
    restored = server.metric("spec_cache_cached_prompt_tokens_total") - before
    prompts = [p for body in sent for p in body["prompt"]]
    assert len(prompts) == 12 and max(len(body["prompt"]) for body in sent) == 4
    assert restored >= 9 * 40  # nine of the twelve restore their context (48 words), less a few tokens
    # what lm-eval summed (each choice's echo answer) equals a cold answer of the same tokens, bit for bit
    assert len(answers) == len(sent) and len(out["samples"]["echo_mc"]) == 3
    for body, answer in zip(sent, answers):
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        for prompt, choice in zip(body["prompt"], choices):
            reference_reply = cold(server, prompt, logprobs=1, max_tokens=1)["choices"][0]
            assert (choice["text"], choice["logprobs"]) == (reference_reply["text"], reference_reply["logprobs"])
