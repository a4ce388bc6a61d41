"""The template seam (issue 22 item 3): a next turn, re-rendered by the chat template, restores at least the
whole previous prompt, with drafters whose rows are exact-length, from the memory tier and from LMDB after a
restart; greedy replies are unchanged. Message boundaries are computed on real templates (SmolLM2's, the tiny
model's); the agentic bench replays its transcript against a real server.
"""

from __future__ import annotations

import statistics
import time

import pytest

from spec_cache.apps.bench import agentic
from spec_cache.apps.server.scheduler import MAX_CHECKPOINT_AT, Job, Scheduler, checkpoint_points
from spec_cache.apps.server.seam import message_boundaries
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import Server, chat_ids, cold_reference, expected_text, stopped, user, words
from tests.apps.test_server_scheduler import Events
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

CONVERSATION = [{"role": "system", "content": "You are a careful coding agent. Read before you edit."},
                {"role": "user", "content": "Fix the rounding bug in allocate()."},
                {"role": "assistant", "content": "I will read ledger/core/rounding.py first."},
                {"role": "tool", "content": "def allocate(total, weights): ..."},
                {"role": "assistant", "content": "The remainder always lands on the first part."},
                {"role": "user", "content": "Make it deterministic."}]


def _renderer(tokenizer):
    def render(head, generation_prompt):
        return list(tokenizer.apply_chat_template(head, add_generation_prompt=generation_prompt, tokenize=True))
    return render


def _expected(tokenizer, messages, prompt):
    """Every head's end (with the generation prompt before an assistant message) that is a prefix of prompt."""
    render, ends = _renderer(tokenizer), {len(prompt)}
    for i in range(1, len(messages)):
        for gp in (False, True) if messages[i]["role"] == "assistant" else (False,):
            ids = render(messages[:i], gp)
            if prompt[: len(ids)] == ids:
                ends.add(len(ids))
    return sorted(ends)


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    root = tmp_path_factory.mktemp("smollm2-tokenizer")
    agentic.write_tokenizer(root)
    return load_tokenizer(root)


def test_boundaries_on_smollm2_template(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    prompt = list(tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True))
    offsets = message_boundaries(_renderer(tokenizer), CONVERSATION, prompt)
    assert offsets == _expected(tokenizer, CONVERSATION, prompt)
    # the previous turn's prompt (everything before the last assistant message, with the generation prompt)
    previous = list(tokenizer.apply_chat_template(CONVERSATION[:4], add_generation_prompt=True, tokenize=True))
    assert len(previous) in offsets and prompt[: len(previous)] == previous
    assert offsets[-1] == len(prompt) and len(offsets) >= 6  # 5 message ends + 2 generation prompts + the end
    text = tokenizer.decode(prompt[: offsets[1]])
    assert text.endswith("<|im_end|>\n")  # a boundary falls after a message's end-of-turn line, not inside it


def test_boundaries_on_the_tiny_template(tmp_path):
    from mlx_lm.utils import load_tokenizer

    from spec_cache.testing.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 256)
    tokenizer = load_tokenizer(tmp_path)
    messages = [{"role": "system", "content": words(50, 5)}, user(words(60, 3)),
                {"role": "assistant", "content": words(70, 4)}, user(words(80, 2))]
    prompt = chat_ids(tokenizer, messages)
    offsets = message_boundaries(_renderer(tokenizer), messages, prompt)
    # "<s> w3" + 5 words + "</s>" = 8 tokens; "<s> w4" + 3 + "</s>" = 6; the generation prompt "<s> w5" = 2, then
    # its 4 words + "</s>" = 5 (the assistant message); the last user message 5, the generation prompt 2
    assert offsets == [8, 14, 16, 21, 28] and len(prompt) == 28


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]


def _tiny_tokenizer(tmp_path):
    from mlx_lm.utils import load_tokenizer

    from spec_cache.testing.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 256)
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_heads_found_in_the_prompt_text_end_where_their_tokenization_does(smollm2_tokenizer, tmp_path, which,
                                                                          tools):
    """``TextLocator``: one tokenization of the prompt (with offsets) for every head, each head's text rendered
    only; the same offsets as tokenizing each head, on SmolLM2's template and the tiny one, with tools (the
    fallback) and without, at every floor."""
    from spec_cache.apps.server.seam import TextLocator
    from spec_cache.apps.server.tools import chat_ids as ids_of
    from spec_cache.apps.server.tools import chat_text

    tokenizer = smollm2_tokenizer if which == "smollm2" else _tiny_tokenizer(tmp_path)
    messages = CONVERSATION if which == "smollm2" else [
        {"role": "system", "content": words(50, 5)}, user(words(60, 3)),
        {"role": "assistant", "content": words(70, 4)}, user(words(80, 2)),
        {"role": "assistant", "content": words(90, 3)}, user(words(95, 2))]
    prompt = ids_of(tokenizer, messages, tools)
    tokenized = []

    def render(head, gp):
        tokenized.append(len(head))
        return ids_of(tokenizer, head, tools, generation_prompt=gp)

    def text(head, gp):
        return chat_text(tokenizer, head, tools, generation_prompt=gp)
    found = {}
    for floor in (0, len(prompt) // 2, len(prompt) - 5):
        tokenized.clear()
        expected = message_boundaries(render, messages, prompt, floor=floor)
        assert tokenized or floor
        tokenized.clear()
        locate = TextLocator(tokenizer, text, messages, prompt)
        found[floor] = message_boundaries(render, messages, prompt, floor=floor, locate=locate)
        assert found[floor] == expected
        assert tokenized == [] and locate.usable
    assert len(found[0]) >= 4  # message ends (and generation prompts) to checkpoint, not only the prompt's end


def test_a_locator_that_cannot_read_offsets_leaves_the_heads_to_tokenization(smollm2_tokenizer):
    from spec_cache.apps.server.seam import UNKNOWN, TextLocator

    def text(head, gp):
        return smollm2_tokenizer.apply_chat_template(head, add_generation_prompt=gp, tokenize=False)
    prompt = list(smollm2_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True))
    other = TextLocator(smollm2_tokenizer, text, CONVERSATION, [7] + prompt)  # not the prompt's tokenization
    assert other(CONVERSATION[:2], False) is UNKNOWN and other.usable is False
    expected = message_boundaries(_renderer(smollm2_tokenizer), CONVERSATION, prompt)
    slow = TextLocator(object(), text, CONVERSATION, prompt)  # no tokenizer with offsets
    assert message_boundaries(_renderer(smollm2_tokenizer), CONVERSATION, prompt, locate=slow) == expected
    assert slow.usable is False
    good = TextLocator(smollm2_tokenizer, text, CONVERSATION, prompt)
    assert good(CONVERSATION[:2], False) in expected
    cut = TextLocator(smollm2_tokenizer, lambda head, gp: text(CONVERSATION, True)[:-3] if head else "",
                      CONVERSATION, prompt, full_text=lambda: text(CONVERSATION, True))
    assert cut(CONVERSATION[:1], False) is None  # a text that ends inside a token: no offset, never a guess
    prefilled = TextLocator(smollm2_tokenizer, text, CONVERSATION, prompt + [11, 12])  # an assistant prefill after
    assert prefilled(CONVERSATION[:2], False) == good(CONVERSATION[:2], False)


def test_boundaries_never_name_an_offset_the_prompt_does_not_have():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    renders = {1: [1, 2], 2: [1, 9, 9], 3: RuntimeError("the template refuses this head")}

    def render(head, generation_prompt):
        value = renders[len(head)]
        if isinstance(value, Exception):
            raise value
        return value
    messages = [{"role": "user", "content": "a"}] * 4
    assert message_boundaries(render, messages, prompt) == [2, 8]  # not 3 (not a prefix), nothing for the error
    assert message_boundaries(render, messages, prompt, limit=1) == [8]  # only the last head rendered


def test_checkpoint_points_are_bounded():
    assert checkpoint_points([5, 0, 12, 5, 99, 3], 50) == (3, 5, 12)
    many = checkpoint_points(range(1, 100), 200)
    assert len(many) == MAX_CHECKPOINT_AT and many[-1] == 99  # the largest kept: nearest the next turn


# -- the scheduler in-process: every drafter kind, both tiers ---------------------------------------------------
def _idle(sched, timeout: float = 60) -> None:
    """Until every job (and each of its prefill phases) is done."""
    deadline = time.monotonic() + timeout
    while sched.queue_depth or sched.active_rows:
        assert time.monotonic() < deadline, "the scheduler did not go idle"
        time.sleep(0.01)


def _run_job(sched, prompt, max_tokens, checkpoint_at=(), log: list | None = None):
    """Run one job to its end; ``log`` (when given) gets ``("event", kind)`` for each event it delivers."""
    events = Events()

    def deliver(event):
        if log is not None:
            log.append(("event", event[0]))
        events(event)
    submitted = Job(prompt=list(prompt), max_tokens=max_tokens, sampling=RowSampling(), deliver=deliver,
                    checkpoint_at=checkpoint_at)
    sched.submit(submitted)
    assert events.done.wait(60)
    _idle(sched)
    return submitted, events


@pytest.mark.parametrize("memory", [None, 0], ids=["memory-tier", "lmdb-only"])
@pytest.mark.parametrize("drafter", [None, "draft-model", "assistant", "deepspec", "dflash", "qwen-mtp", "ngram"])
def test_checkpoints_at_the_end_of_the_prompt_and_a_boundary_serve_exactly(tiny, tmp_path, drafter, memory):
    """A next turn whose assistant part differs from what was generated restores the whole previous prompt with
    the drafter's row (exact-length: it needs a checkpoint exactly there); a request sharing the head up to a
    ``checkpoint_at`` offset restores exactly that offset; tokens are the target's own greedy ones."""
    cache = SpecCache.open(tmp_path / "store", memory_bytes=memory)
    generator = Generator.load(tiny.root / "target", tiny.drafter_dir(drafter) if drafter else None, cache=cache)
    sched = Scheduler(generator, max_rows=4, checkpoint_every=None)
    sched.start()
    try:
        first = list(range(3, 63))  # 60 tokens; a message boundary at 30
        _, events = _run_job(sched, first, 4, checkpoint_at=(30, len(first)))
        assert events.tokens == plain_greedy(tiny.target, first, 4)
        cache.drain()
        with_drafter = generator.drafter_namespace is not None
        second = first + [200, 201, 202, 90, 91]  # the previous reply re-rendered as other tokens, a new message
        assert events.tokens[0] != 200
        job2, events2 = _run_job(sched, second, 4)
        assert events2.cached >= len(first)
        assert job2.prepared.restored_drafter == with_drafter  # the exact-length drafter row came back too
        assert events2.tokens == plain_greedy(tiny.target, second, 4)
        head = first[:30] + [210, 211, 212, 213]
        job3, events3 = _run_job(sched, head, 3)
        assert events3.cached == 30 and job3.prepared.restored_drafter == with_drafter
        assert events3.tokens == plain_greedy(tiny.target, head, 3)
    finally:
        sched.stop(5)
        cache.close()


# -- a real server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    root = tmp_path_factory.mktemp("seam-model")
    target = write_tiny_target(root / "tiny", seed=11)
    drafters = {"draft-model": write_tiny_drafter(root / "draft-model", "draft-model", target, layers=1)}
    return root, target, drafters


@pytest.fixture(scope="module")
def greedy(tiny_model):
    """(tokenizer, greedy(prompt ids, n) -> mlx-lm's own greedy tokens, cut after the first EOS)."""
    return cold_reference(tiny_model[1])


def _serve(tiny_model, tmp, store, method):
    _, target, drafters = tiny_model
    srv = Server(target, store, tmp, "--method", method, "--drafter", str(drafters[method]), keys=("k",),
                 operator=None)
    return srv


def _turn(srv, messages, tokenizer, greedy):
    reply = srv.client().chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    expected = expected_text(tokenizer, greedy(chat_ids(tokenizer, messages), 6))
    assert reply.choices[0].message.content == expected  # greedy: what a cold run of this prompt gives
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


def test_turn_two_restores_the_whole_previous_prompt(tiny_model, greedy, tmp_path):
    """Over HTTP: the assistant turn comes back as other text than was generated (an agent's tool call, say): the
    restored prefix still covers the whole previous prompt (draft-model: exact-length drafter rows), from the memory
    tier; then from LMDB after a restart (fails without the end-of-prompt checkpoint: 92 < 93)."""
    tokenizer, run, method = *greedy, "draft-model"
    srv = _serve(tiny_model, tmp_path, tmp_path / "store", method)
    try:
        first = [{"role": "system", "content": words(100, 60)}, user(words(20, 8))]
        prompt1, _ = _turn(srv, first, tokenizer, run)
        second = first + [{"role": "assistant", "content": words(200, 5)}, user(words(40, 6))]
        prompt2, cached2 = _turn(srv, second, tokenizer, run)
        assert cached2 >= prompt1, (cached2, prompt1)
        stopped(srv)
        srv = _serve(tiny_model, tmp_path, tmp_path / "store", method)  # the memory tier is gone: LMDB only
        third = second + [{"role": "assistant", "content": words(210, 3)}, user(words(50, 4))]
        _, cached3 = _turn(srv, third, tokenizer, run)
        assert cached3 >= prompt2, (cached3, prompt2)
    finally:
        stopped(srv)


@pytest.mark.server  # the agentic bench drives spec-cache serve processes
def test_agentic_bench_ratio_comes_from_real_responses():
    result = agentic.run(turns=3, max_tokens=4, restart=False, cost=False)
    assert "skipped" not in result, result
    apis = [api for api, rows in result["apis"].items() if isinstance(rows, list)]  # anthropic: once it exists
    assert "openai" in apis
    for api in apis:
        rows = result["apis"][api]
        assert [r["turn"] for r in rows] == [1, 2, 3]
        for earlier, later in zip(rows, rows[1:]):
            assert later["prompt_tokens"] > earlier["prompt_tokens"] > 2000  # the system prompt and tools are long
            assert later["cached_tokens"] >= earlier["prompt_tokens"]  # restored the whole previous prompt
        assert result[f"agentic_cached_ratio_{api}"] == statistics.median(
            r["cached_tokens"] / r["prompt_tokens"] for r in rows[1:])
        assert 0.5 < result["agentic_cached_ratio"] <= result[f"agentic_cached_ratio_{api}"] < 1
