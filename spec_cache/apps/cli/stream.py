"""``generate``'s one-prompt path: text on stdout as the tokens arrive, Ctrl-C keeping what was printed.

It drives the engine through the generator's seams for schedulers (``prepare``, ``engine.session``,
``save_checkpoint``), the same steps ``Generator.generate`` takes for a batch: look up the stored prefix, decode,
write the checkpoints after decoding. Each round's tokens go through the server's streaming detokenizer (never a
split multi-byte character, special tokens such as the EOS text never shown) and its stop-string matcher.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from spec_cache.apps.server.detokenizer import StopMatcher, StreamingDetokenizer


@dataclass
class Streamed:
    """What the streamed row did; ``interrupted``: Ctrl-C ended it (its text so far was printed)."""

    tokens: list
    text: str
    stopped: bool
    cached_tokens: int
    restored_drafter: bool
    drafted: int
    accepted: int
    ttft_s: float
    interrupted: bool = False


def stream_one(generator, prompt: list[int], tokenizer, *, max_tokens: int, temperature: float, seed: int,
               top_p: float, stops: list[str], out=None, top_k: int = 0, min_p: float = 0.0) -> Streamed:
    """Decode ``prompt`` and write its text to ``out`` (default stdout) as it comes; KeyboardInterrupt ends the
    row (no finish checkpoint), flushes what was decoded and returns with ``interrupted``."""
    from spec_cache.rows.generation import check_prompts
    from spec_cache.rows.sampling import RowSampling, Sampling

    out = out or sys.stdout
    prompt = check_prompts([prompt], generator.engine.target.vocab_size)[0]
    greedy = temperature == 0
    sampling = None if greedy and top_p == 1.0 else RowSampling(temperature, top_p, seed, top_k, min_p)
    started = time.perf_counter()
    prepared = generator.prepare(prompt, max_tokens, sampling=sampling)
    saves = []

    def on_checkpoint(row, tokens, caches, draft):
        if prepared.needs_save(tokens, draft, generator.drafter_namespace):
            saves.append((tokens, caches, draft))

    detok, matcher = StreamingDetokenizer(tokenizer), StopMatcher(stops)
    state = {"stopped": False, "result": None}
    session = generator.engine.session(eos_token_ids=generator.eos_token_ids,
                                       on_checkpoint=None if generator.cache is None else on_checkpoint,
                                       draft_sampling=Sampling(temperature, seed))

    printed = []

    def write(text: str) -> None:
        if text:
            printed.append(text)
            out.write(text)
            out.flush()

    eos = set(generator.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())

    def on_tokens(row_id, tokens):
        if state["stopped"]:
            return
        text, stopped = matcher.feed(detok.add([t for t in tokens if int(t) not in eos]))  # EOS text never shown
        write(text)
        if stopped:
            state["stopped"] = True
            session.finish(row_id)  # leaves at the end of this round, its finish checkpoint written

    def on_finish(row_id, result):
        state["result"] = result

    interrupted = False
    try:
        session.submit(prepared.request, on_tokens=on_tokens, on_finish=on_finish, submitted_at=started)
        while session.step():
            pass
    except KeyboardInterrupt:  # the row gets no finish checkpoint; what was printed stays
        interrupted = True
    finally:
        try:
            session.close()
        finally:
            if not interrupted:
                for tokens, caches, draft in saves:
                    generator.save_checkpoint(tokens, caches, draft)
    if not state["stopped"]:
        text, stopped = matcher.feed(detok.flush())
        write(text + ("" if stopped else matcher.flush()))
        state["stopped"] = stopped
    text = "".join(printed)
    out.write("\n")
    out.flush()
    r = state["result"]
    tokens = list(r.tokens) if r is not None else list(detok.tokens)
    return Streamed(tokens=tokens, text=text, stopped=state["stopped"], cached_tokens=prepared.cached_tokens,
                    restored_drafter=prepared.restored_drafter, drafted=r.drafted if r else 0,
                    accepted=r.accepted if r else 0, ttft_s=r.ttft_s if r else time.perf_counter() - started,
                    interrupted=interrupted)
