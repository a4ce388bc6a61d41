"""``generate``'s and ``chat``'s decoding: rows through the engine's session, text through the streaming
detokenizer, stop strings that stop decoding, Ctrl-C keeping what was printed.

``decode_rows`` drives the engine through the generator's seams for schedulers (``prepare``, ``engine.session``,
``save_checkpoint``), the same steps ``Generator.generate`` takes for a batch: look up the stored prefix, decode,
write the checkpoints after decoding. Each row's tokens go through the server's streaming detokenizer (never a
split multi-byte character, special tokens such as the EOS text never shown) and its stop-string matcher; a row
whose text reaches a stop string leaves the batch at the end of that round (``session.finish``, its finish
checkpoint written), as mlx_lm.generate stops, instead of decoding on to ``--max-tokens``. With ``out`` (one row),
the text is written there as it comes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from spec_cache.apps.server.detokenizer import StopMatcher, StreamingDetokenizer


@dataclass
class Streamed:
    """What a decoded row did; ``interrupted``: Ctrl-C ended it (its text so far was kept)."""

    tokens: list
    text: str
    stopped: bool
    cached_tokens: int
    restored_drafter: bool
    drafted: int
    accepted: int
    ttft_s: float
    interrupted: bool = False


class _RowText:
    """One row's text: detokenized as tokens arrive, cut at the first stop string, written to ``out`` if given."""

    def __init__(self, tokenizer, stops: list[str], eos: set, out) -> None:
        self.detok, self.matcher = StreamingDetokenizer(tokenizer), StopMatcher(stops)
        self.eos, self.out = eos, out
        self.pieces: list[str] = []
        self.stopped = False

    def write(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.out is not None:
                self.out.write(text)
                self.out.flush()

    def feed(self, tokens) -> bool:
        """Take a round's tokens; True when the text reached a stop string (the row should leave)."""
        if self.stopped:
            return False
        text, self.stopped = self.matcher.feed(self.detok.add([t for t in tokens if int(t) not in self.eos]))
        self.write(text)  # EOS text never shown
        return self.stopped

    def close(self) -> str:
        if not self.stopped:
            text, self.stopped = self.matcher.feed(self.detok.flush())
            self.write(text + ("" if self.stopped else self.matcher.flush()))
        return "".join(self.pieces)


def decode_rows(generator, prompts: list[list[int]], tokenizer, *, max_tokens: int, temperature: float, seed: int,
                top_p: float, stops: list[str], out=None, top_k: int = 0, min_p: float = 0.0,
                processors: dict | None = None) -> list[Streamed]:
    """Decode ``prompts`` in one batch; each row stops at its first stop string. ``processors``: logits processors
    by ``RowSampling``'s names (``repetition_penalty``, ...). ``out`` (one prompt only): write
    its text there as it comes, then a newline. KeyboardInterrupt ends every row (no finish checkpoints) and
    returns what was decoded, each result marked ``interrupted``."""
    from spec_cache.rows.generation import check_prompts
    from spec_cache.rows.sampling import RowSampling, Sampling

    if out is not None and len(prompts) != 1:
        raise ValueError("decode_rows writes text as it comes for one prompt only")
    prompts = check_prompts(prompts, generator.engine.target.vocab_size)
    greedy = temperature == 0
    sampling = None if greedy and top_p == 1.0 and not processors else RowSampling(temperature, top_p, seed, top_k,
                                                                                   min_p, **(processors or {}))
    started = time.perf_counter()
    eos = set(generator.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())
    session = generator.session(draft_sampling=Sampling(temperature, seed))
    texts = [_RowText(tokenizer, stops, eos, out) for _ in prompts]
    by_row: dict = {}  # row id -> its text
    handles = [session.prepare(prompt, max_tokens, sampling) for prompt in prompts]

    def on_tokens(handle, tokens):
        if by_row[handle.row].feed(tokens):
            session.finish(handle)  # leaves at the end of this round, its finish checkpoint written

    interrupted = False
    try:
        for handle, text in zip(handles, texts):
            by_row[session.admit(handle, on_tokens=on_tokens, submitted_at=started).row] = text
        session.run()
    except KeyboardInterrupt:  # the rows get no finish checkpoint; what was printed stays
        interrupted = True
    finally:
        session.close(write=not interrupted)  # then its checkpoints, unless Ctrl-C ended the rows
    decoded = []
    for text, row in zip(texts, handles):
        joined = text.close()
        r = row.result
        decoded.append(Streamed(
            tokens=list(r.tokens) if r is not None else list(text.detok.tokens), text=joined, stopped=text.stopped,
            cached_tokens=row.cached_tokens, restored_drafter=row.restored_drafter,
            drafted=r.drafted if r else 0, accepted=r.accepted if r else 0,
            ttft_s=r.ttft_s if r else time.perf_counter() - started, interrupted=interrupted))
    if out is not None:
        out.write("\n")
        out.flush()
    return decoded


def stream_one(generator, prompt: list[int], tokenizer, *, max_tokens: int, temperature: float, seed: int,
               top_p: float, stops: list[str], out=None, top_k: int = 0, min_p: float = 0.0) -> Streamed:
    """Decode ``prompt`` and write its text to ``out`` (default stdout) as it comes; KeyboardInterrupt ends the
    row (no finish checkpoint), flushes what was decoded and returns with ``interrupted``."""
    return decode_rows(generator, [prompt], tokenizer, max_tokens=max_tokens, temperature=temperature, seed=seed,
                       top_p=top_p, stops=stops, out=out or sys.stdout, top_k=top_k, min_p=min_p)[0]
