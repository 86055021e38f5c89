"""``bench.relevance``'s corpus: every query has one right answer."""

from __future__ import annotations

import itertools
import random

from bench.relevance import Phrases


def test_no_two_words_come_together_in_two_lines_of_the_corpus() -> None:
    phrases = Phrases(random.Random(7))
    lines = [phrases.phrase() for _ in range(88)]
    # A mixed clip's line: a caption and the sentence said with it, any two of whose words a query may take
    lines += [[*shown, *phrases.phrase(beside=shown)] for shown in (phrases.phrase() for _ in range(16))]
    pairs = [frozenset(p) for words in lines for p in itertools.combinations(words, 2)]
    assert all(len(set(words)) == len(words) for words in lines)
    assert len(pairs) == len(set(pairs))
