"""Prompt lookup's index (issue 28 item 2): the suffix automaton over a row's prompt + output.

The index must find exactly what a scan of the whole history would (the longest suffix of ``history + [pending]``
that ended earlier, and its earliest end), however the history was fed to it (all at once, in verify windows,
restored from a checkpoint), and the draft must grow with the match: a copied run drafts the whole depth.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.drafters.ngram import RECENT, MatchIndex, NgramProvider, draft_length

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def scan(history: list[int], pending: int) -> tuple[int, int]:
    """The reference: the longest suffix of ``history + [pending]`` found at an earlier end, trying every length
    from the longest down and every end; its latest end for a match of up to ``RECENT`` tokens, else its
    earliest."""
    seq = history + [pending]
    size = len(seq)
    for length in range(size - 1, 0, -1):
        suffix = seq[size - length:]
        ends = [end for end in range(length, size) if seq[end - length:end] == suffix]
        if ends:
            return length, ends[-1] if length <= RECENT else ends[0]
    return 0, 0


def scan_draft(history: list[int], pending: int, depth: int, min_n: int) -> list[int]:
    length, end = scan(history, pending)
    if depth <= 0 or length < min_n:
        return []
    return (history + [pending])[end:end + draft_length(length, depth)]


#: small alphabets make long repeats (copied runs) and many ties common
histories = st.integers(1, 4).flatmap(lambda alphabet: st.lists(st.integers(0, alphabet), max_size=60))


@SETTINGS
@given(history=histories, pending=st.integers(0, 4), depth=st.integers(0, 9), min_n=st.integers(1, 3),
       cuts=st.lists(st.integers(1, 7), max_size=20))
def test_the_index_agrees_with_a_scan_of_the_whole_history(history, pending, depth, min_n, cuts):
    index = MatchIndex(3, min_n)
    fed = 0
    for cut in cuts:  # verify windows of any size, then the rest
        index.extend(history[fed:fed + cut])
        fed += cut
    index.extend(history[fed:])
    assert index.tokens == history
    assert index.match(pending) == scan(history, pending)
    assert index.propose(pending, depth) == scan_draft(history, pending, depth, min_n)


@SETTINGS
@given(history=histories)
def test_every_prefix_is_answered_as_it_grows_token_by_token(history):
    index = MatchIndex(3, 1)
    for size, token in enumerate(history):
        for pending in range(5):
            assert index.match(pending) == scan(history[:size], pending)
        index.extend([token])


def test_the_longest_match_wins_over_later_shorter_ones_and_ties_go_to_the_earliest():
    index = MatchIndex(3, 1, [4, 5, 6, 1, 2, 3, 7, 7, 9, 1, 2, 3, 8, 8, 4, 5, 6, 1, 2])
    assert index.match(3) == (6, 6)  # "4 5 6 1 2 3" (ended at 6) beats the later "9 1 2 3"
    assert index.propose(3, 4) == [7, 7, 9, 1]
    tie = MatchIndex(3, 1, [5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 8, 0, 1, 2])
    assert tie.match(3) == (3, 4)  # "1 2 3" twice, each preceded by another token: the earliest continues longest
    assert tie.propose(3, 6) == [9, 9, 7, 1, 2, 3]
    assert MatchIndex(3, 1, [1, 2, 3]).propose(7, 4) == []  # never seen
    assert MatchIndex(3, 2, [4, 1, 9, 9, 2]).propose(1, 6) == []  # a 1-token match is below min 2
    lone = MatchIndex(3, 1, [8, 5, 1, 2, 7, 5, 3, 4, 6])
    assert lone.match(5) == (1, 6) and lone.propose(5, 6) == [3, 4]  # a lone shared token: its latest occurrence


def test_the_draft_grows_with_the_match_on_copied_text():
    passage = list(range(100, 140))  # a prompt's passage; the answer copies it with one token changed
    answer = passage[:10] + [999] + passage[11:20]
    index = MatchIndex(3, 1, passage + [0] + answer[:11])
    lengths = []
    for token in answer[11:]:  # the copy resumes after the change: the match grows by one each token
        lengths.append(len(index.propose(token, 8)))
        index.extend([token])
    assert lengths == [2, 4, 6, 8, 8, 8, 8, 8, 8]
    assert index.match(passage[20]) == (10, 21)  # the copy went on: 10 tokens since the change
    assert index.propose(passage[20], 8) == passage[21:29]
    assert [draft_length(n, 6) for n in (0, 1, 2, 3, 50)] == [0, 2, 4, 6, 6]


def test_a_restored_checkpoint_rebuilds_the_same_index():
    provider = NgramProvider()
    history = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 8, 1, 2]
    rows = provider.open(None, [None, None])
    rows.prefill([history[:5], history], None)
    rows.consume([history[5:], []], None, [len(history) - 5, 0])
    checkpoint = rows.capture(0)
    assert checkpoint.processed_tokens == len(history)
    restored = provider.open(None, [checkpoint])
    assert restored.draft([3], 6) == [rows.draft([3, 3], 6)[1]] == [MatchIndex(3, 1, history).propose(3, 6)]
    assert restored.draft([3], 6) == [[4, 5, 9, 1, 2, 3]]
