"""lm-eval (EleutherAI's lm-evaluation-harness) against a real ``spec-cache serve`` process (issue 36).

lm-eval runs its real flow, as its users run it: ``lm_eval.simple_evaluate`` with a task from a local YAML file
(``--include_path``; the data a JSONL file beside it, so no dataset is fetched) against ``local-completions``
(``loglikelihood`` for a multiple-choice task and ``generate_until``, both with ``batch_size`` 4, so one request
carries several prompts) and ``local-chat-completions`` (``generate_until`` through the chat template). lm-eval
tokenizes with the served model's own tokenizer directory (``tokenizer_backend=huggingface``; the server has no
``/tokenizer_info``) and sends token-id prompts.

What lm-eval gets is checked against references computed without the server: every loglikelihood (and its
``is_greedy``) against mlx-lm's forward pass over the same tokens, every generation against mlx-lm's greedy
``generate_step`` on the same prompt (cut at the first stop string), and each also against the answer the
official ``openai`` client gets for the same request. ``max_retries=1``: a request the server refuses fails the
evaluation instead of being retried.

The model and the server are ``tests/apps/test_clients.py``'s (the scripted model, one key, the defaults): its
greedy script makes a choice's loglikelihood either about 0 (the script's next token), a few nats (the weak start
of the script after ``assistant``) or about -8e6 (off the script), so a wrong sum or a lost token shows.

The test of a continuation after which the model would end found that the server left the end-of-sequence token's
entry out of an echo answer, so lm-eval dropped the continuation's last token instead (fixed in jobs._scored_pieces).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.apps.test_clients import KEY, server  # noqa: F401 (the module's server: a fixture)
from tests.apps.test_server import chat_ids, expected_text

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CHAT = "<|im_start|>user Hello<|im_end|><|im_start|>assistant"
TOOL_RESULT = "<|im_start|>user <tool_response> sunny </tool_response><|im_end|><|im_start|>assistant"
BATCH = 4

#: multiple choice: the context, the choices (lm-eval adds " " before each), the gold index. No choice ends where
#: the model's greedy next token is the end of sequence (see ENDING).
CHOICES = [  # (the scripted tokenizer's call token is the call with a space either side; a word is "▁word")
    {"q": "<tool_call>", "choices": [f"{CALL} ", "It is", "<tool_call>"], "gold": 0},
    {"q": "<tool_response> It", "choices": ["in", "is sunny", "It is"], "gold": 1},
    # off the script's weak start (lm-eval's " " before a choice is a lone-space piece before an added token, so
    # " <tool_call>" leaves the script): "It is" costs a few nats, the rest millions
    {"q": CHAT, "choices": ["It is", "<tool_call>"], "gold": 0},
    {"q": TOOL_RESULT, "choices": ["<tool_call>", "It is"], "gold": 1},  # a tool result in context: the reply
]
#: choices after which the model would end (its greedy next token is the end of sequence, '<|im_end|>')
ENDING = [
    {"q": "It is", "choices": ["Paris.", "sunny in Paris."], "gold": 1},
    {"q": "<tool_call>", "choices": ["Hello", f"{CALL} </tool_call>"], "gold": 1},
]
#: generate_until: prompts and their answers, cut before the first of the task's stop strings (the server cuts)
UNTIL = ["Paris.", "\n\n"]
PROMPTS = [{"q": "<tool_response> It", "a": "is sunny in "}, {"q": "<tool_call>", "a": f"{CALL} </tool_call>"},
           {"q": "It is sunny", "a": "in "}, {"q": CHAT, "a": f"<tool_call> {CALL} </tool_call>"},
           {"q": TOOL_RESULT, "a": "It is sunny in "}]
CHAT_PROMPTS = [{"q": "What is the weather in Paris?", "a": f"<tool_call> {CALL} </tool_call>"},
                {"q": "<tool_response> sunny </tool_response>", "a": "It is sunny in "},
                {"q": "Hello", "a": f"<tool_call> {CALL} </tool_call>"}]


def model_path(srv) -> Path:
    return Path(srv.proc.args[srv.proc.args.index("--model") + 1])


def task_yaml(name: str, data: Path, cache: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"  cache_dir: {json.dumps(str(cache))}\ntest_split: test\n" + body)


@pytest.fixture(scope="module")
def harness(server, tmp_path_factory):
    """The task folder (``--include_path``) and lm-eval's environment: the key in ``OPENAI_API_KEY`` (where
    lm-eval's local models read it), nothing fetched from the Hugging Face hub."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_API_KEY", KEY)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        lm_eval = pytest.importorskip("lm_eval")
        from lm_eval.tasks import TaskManager

        tasks = tmp_path_factory.mktemp("lm-eval-tasks")
        cache = tmp_path_factory.mktemp("lm-eval-datasets")
        mc = ("output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
              "doc_to_target: gold\nmetric_list:\n  - metric: acc\n")
        generate = ("output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                    f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: 8\n"
                    "metric_list:\n  - metric: exact_match\n")
        for name, rows, body in (("tiny_mc", CHOICES, mc), ("tiny_mc_ending", ENDING, mc),
                                 ("tiny_gen", PROMPTS, generate), ("tiny_chat_gen", CHAT_PROMPTS, generate)):
            data = tasks / f"{name}.jsonl"
            data.write_text("".join(json.dumps(row) + "\n" for row in rows))
            (tasks / f"{name}.yaml").write_text(task_yaml(name, data, cache, body))
        yield lm_eval, TaskManager(include_path=str(tasks), include_defaults=False)


@pytest.fixture(scope="module")
def reference(server):
    """mlx-lm's model and tokenizer loaded from the served directory (the references' model)."""
    from mlx_lm import load

    return load(str(model_path(server)))


@pytest.fixture
def payloads(monkeypatch):
    """The bodies lm-eval sends (its ``_create_payload``, recorded)."""
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    sent = []
    for cls in (LocalCompletionsAPI, LocalChatCompletion):
        def recording(self, *args, _create=cls._create_payload, **kwargs):
            body = _create(self, *args, **kwargs)
            sent.append(json.loads(json.dumps(body)))
            return body
        monkeypatch.setattr(cls, "_create_payload", recording)
    return sent


def evaluate(harness, srv, kind: str, task: str, **kwargs) -> dict:
    lm_eval, tasks = harness
    endpoint = "/v1/chat/completions" if kind == "local-chat-completions" else "/v1/completions"
    args = {"model": "tiny", "base_url": srv.url + endpoint, "max_retries": 1, "timeout": 120}
    if kind == "local-completions":
        args.update(tokenizer=str(model_path(srv)), tokenizer_backend="huggingface", batch_size=BATCH)
    return lm_eval.simple_evaluate(model=kind, model_args=args, tasks=[task], task_manager=tasks, log_samples=True,
                                   bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                                   fewshot_random_seed=0, **kwargs)


def reference_loglikelihood(reference, context: str, continuation: str) -> tuple[float, bool, list[int], int]:
    """(sum of the continuation's logprobs, whether each of its tokens is the greedy one, the whole prompt, the
    context's length), split as lm-eval splits: the whole text's tokens after the context's."""
    import mlx.core as mx

    model, tokenizer = reference
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctxlen = len(tokenizer.encode(context, add_special_tokens=False))
    logits = model(mx.array([whole]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    positions = range(ctxlen, len(whole))
    total = sum(logprobs[i - 1, whole[i]].item() for i in positions)
    greedy = all(mx.argmax(logprobs[i - 1]).item() == whole[i] for i in positions)
    return total, greedy, whole, ctxlen


def reference_generation(reference, prompt: list[int], max_tokens: int, stops: list[str]) -> str:
    """mlx-lm's greedy answer to ``prompt`` (up to the first EOS, at most ``max_tokens``), cut at the first stop."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tokenizer = reference
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
    text = expected_text(tokenizer, tokens)
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]


def check_loglikelihoods(out: dict, task: str, rows: list[dict], reference, payloads: list[dict]) -> None:
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc"]["q"] for s in samples] == [r["q"] for r in rows]
    scored = 0
    for sample, row in zip(samples, rows):
        got = [tuple(r[0]) for r in sample["resps"]]
        assert [tuple(a) for a in sample["arguments"]] == [(row["q"], " " + c) for c in row["choices"]]
        want = [reference_loglikelihood(reference, row["q"], " " + c) for c in row["choices"]]
        for (loglikelihood, greedy), (total, ref_greedy, _, _), choice in zip(got, want, row["choices"]):
            assert loglikelihood == pytest.approx(total, rel=1e-5, abs=1e-3), (row["q"], choice, got, want)
            assert greedy == ref_greedy, (row["q"], choice)
        best = max(range(len(want)), key=lambda i: want[i][0])
        assert sample["acc"] == float(best == row["gold"])
        scored += len(row["choices"])
    assert out["results"][task]["acc,none"] == pytest.approx(sum(s["acc"] for s in samples) / len(samples))
    # what lm-eval sent: token-id prompts, several a request, each echoed with one logprob a token
    prompts = [p for body in payloads for p in body["prompt"]]
    assert len(prompts) == scored and max(len(body["prompt"]) for body in payloads) == BATCH
    for body in payloads:
        assert (body["echo"], body["logprobs"], body["max_tokens"], body["temperature"]) == (True, 1, 1, 0)
        assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in body["prompt"])
    wholes = {tuple(reference_loglikelihood(reference, r["q"], " " + c)[2]) for r in rows for c in r["choices"]}
    assert {tuple(p) for p in prompts} == wholes


def test_local_completions_loglikelihood_batched(harness, server, reference, payloads):
    out = evaluate(harness, server, "local-completions", "tiny_mc")
    check_loglikelihoods(out, "tiny_mc", CHOICES, reference, payloads)
    assert out["results"]["tiny_mc"]["acc,none"] == 1.0  # every gold choice is the model's likeliest


def test_local_completions_loglikelihood_of_a_continuation_the_model_would_end(harness, server, reference,
                                                                                 payloads):
    """lm-eval scores a continuation as sum(token_logprobs[ctxlen:-1]) of an echo + logprobs + max_tokens 1 answer
    (len(prompt) + 1 entries, OpenAI's shape). With echo the end-of-sequence token a row stops at has its entry
    too; without it lm-eval dropped the continuation's last token: 'It is' + ' Paris.' scored 0, not -8e6."""
    out = evaluate(harness, server, "local-completions", "tiny_mc_ending")
    check_loglikelihoods(out, "tiny_mc_ending", ENDING, reference, payloads)


def check_generations(out: dict, task: str, rows: list[dict], expected: list[str]) -> None:
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc"]["q"] for s in samples] == [r["q"] for r in rows]
    assert [s["resps"][0][0] for s in samples] == expected
    assert [s["exact_match"] for s in samples] == [float(e == r["a"]) for e, r in zip(expected, rows)]


def test_local_completions_generate_until_batched(harness, server, reference, payloads):
    out = evaluate(harness, server, "local-completions", "tiny_gen")
    _, tokenizer = reference
    stops = UNTIL + [tokenizer.eos_token]  # lm-eval's stop strings: the task's and the EOS text
    prompts = [tokenizer.encode(r["q"], add_special_tokens=False) for r in PROMPTS]
    expected = [reference_generation(reference, p, 8, stops) for p in prompts]
    check_generations(out, "tiny_gen", PROMPTS, expected)
    assert out["results"]["tiny_gen"]["exact_match,none"] == 1.0
    # what lm-eval sent: token-id prompts, up to BATCH a request, greedy, the stop strings
    assert sorted(p for body in payloads for p in body["prompt"]) == sorted(prompts)
    assert max(len(body["prompt"]) for body in payloads) == BATCH
    for body in payloads:
        assert (body["max_tokens"], body["temperature"], body["stop"]) == (8, 0, stops)
    # the official client gets the same answers for the same request
    client = server.client()
    for prompt, want in zip(prompts, expected):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=stops,
                                        seed=1234)
        assert got.choices[0].text == want


def test_local_chat_completions_generate_until(harness, server, reference, payloads):
    out = evaluate(harness, server, "local-chat-completions", "tiny_chat_gen", apply_chat_template=True)
    _, tokenizer = reference
    chats = [[{"role": "user", "content": r["q"]}] for r in CHAT_PROMPTS]
    expected = [reference_generation(reference, chat_ids(tokenizer, c), 8, UNTIL) for c in chats]
    check_generations(out, "tiny_chat_gen", CHAT_PROMPTS, expected)
    assert out["results"]["tiny_chat_gen"]["exact_match,none"] == 1.0
    # what lm-eval sent: one conversation a request (lm-eval batches no chat requests), the task's stop strings
    assert sorted(json.dumps(body["messages"]) for body in payloads) == sorted(json.dumps(c) for c in chats)
    for body in payloads:
        assert (body["max_tokens"], body["temperature"], body["stop"]) == (8, 0, UNTIL)
    client = server.client()
    for chat, want in zip(chats, expected):
        got = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8, temperature=0, stop=UNTIL,
                                             seed=1234)
        assert got.choices[0].message.content == want
