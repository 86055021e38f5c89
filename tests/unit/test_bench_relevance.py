"""``bench.relevance``'s corpus: every query has one right answer."""

from __future__ import annotations

import itertools
import random

from bench.relevance import Phrases, _said_with


def test_no_two_words_come_together_in_two_lines_of_the_corpus() -> None:
    phrases = Phrases(random.Random(7))
    lines = [phrases.phrase() for _ in range(104)]
    # A mixed query pairs a caption's first word with the first word said meanwhile: a pair of its own
    said = [_said_with(phrases, " ".join(shown).title()) for shown in lines[:16]]
    pairs = [frozenset(p) for words in lines + said for p in itertools.combinations(words, 2)]
    pairs += [frozenset((shown[0], words[0])) for shown, words in zip(lines[:16], said, strict=True)]
    assert len(pairs) == len(set(pairs))
