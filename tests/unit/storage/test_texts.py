"""The text table (``storage.texts``) on a local LanceDB: per-video replacement, summaries the checker
reads, and full-text search — plain words, exact phrases, sources — before and after the index exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.config import S3Settings
from storage.db import IndexDatabase
from storage.texts import TextRow, TextTable, VideoText, text_table_name


def _video(vid: str, *rows: tuple[float, str, str], version: str = "v1") -> VideoText:
    return VideoText(
        vid,
        f"s3://b/{vid}.mp4",
        version,
        f"fp-{vid}-{version}",
        "subtitles",
        [TextRow(f"{vid}-t{i:06d}", t, t + 2.0, text, source, 0.9) for i, (t, text, source) in enumerate(rows)],
    )


@pytest.fixture
def table(tmp_path: Path) -> TextTable:
    return TextTable(IndexDatabase(S3Settings(), str(tmp_path / "db")), text_table_name("subtitles", "g1"))


def test_a_video_s_segments_are_replaced_and_removed_whole(table: TextTable) -> None:
    table.replace_many(
        [_video("a", (1.0, "old words", "subtitle"), (3.0, "more", "ocr")), _video("b", (0.0, "b", "speech"))]
    )
    table.replace_many([_video("a", (5.0, "new words", "subtitle"), version="v2")])
    assert (table.count("a"), table.count("b")) == (1, 1)
    summary = table.summaries_in("", "s3://z", include_from=True)
    assert summary["a"].fingerprints == {"fp-a-v2": 1} and summary["a"].duplicate_ids == 0
    table.replace_many([_video("a")])
    assert (table.count("a"), table.count("b")) == (0, 1)


@pytest.mark.parametrize("folded", [False, True], ids=["rows-unindexed", "rows-folded-in"])
def test_words_phrases_and_sources_are_searched(table: TextTable, folded: bool) -> None:
    table.replace_many([_video("c", (0.0, "first write builds the index", "ocr"))])
    table.replace_many(
        [
            _video("a", (1.0, "the quarterly revenue grew", "speech"), (9.0, "Architecture Review", "ocr")),
            _video("b", (4.0, "revenue was quarterly at best", "subtitle")),
        ]
    )
    assert not table.ensure_fts_index()  # built by the first write
    if folded:
        table.table().optimize()  # type: ignore[union-attr]
    plain = table.search("quarterly revenue", 10)
    assert {h.segment_id for h in plain} == {"a-t000000", "b-t000000"}
    assert [h.segment_id for h in table.search("quarterly revenue", 10, phrase=True)] == ["a-t000000"]
    assert [h.segment_id for h in table.search("architecture", 10, sources=["ocr"])] == ["a-t000001"]
    assert table.search("architecture", 10, sources=["speech", "subtitle"]) == []


def test_an_exact_word_is_what_matches_no_stop_word_dropped_and_nothing_stemmed(table: TextTable) -> None:
    table.replace_many(
        [_video("a", (1.0, "the tide grows", "subtitle")), _video("b", (2.0, "a tide grew", "subtitle"))]
    )
    # A stop-word list would drop "the" from the query (and match nothing, or everything).
    assert [h.video_id for h in table.search("the", 10)] == ["a"]
    # A stemmer would make "grow" match "grows" (and "grew" nothing else).
    assert table.search("grow", 10) == []
    assert [h.video_id for h in table.search("grew", 10)] == ["b"]
    assert [h.video_id for h in table.search("the tide", 10, phrase=True)] == ["a"]


def test_rows_written_after_the_index_are_found(table: TextTable) -> None:
    table.replace_many([_video("a", (1.0, "harbour at dawn", "subtitle"))])
    table.ensure_fts_index()
    table.replace_many([_video("b", (2.0, "A red boat at the Harbour", "subtitle"))])
    assert {h.video_id for h in table.search("harbour", 10)} == {"a", "b"}
    assert [h.video_id for h in table.search("red BOAT", 10, phrase=True)] == ["b"]


def test_a_bad_write_is_refused(table: TextTable) -> None:
    with pytest.raises(ValueError, match="source"):
        table.replace_many([_video("a", (1.0, "x", "telepathy"))])
    with pytest.raises(ValueError, match="twice"):
        table.replace_many([_video("a", (1.0, "x", "ocr")), _video("a", (2.0, "y", "ocr"))])
    assert table.search("x", 10) == [] and table.count() == 0


def test_a_fuzzy_search_finds_a_word_misread_by_a_letter_below_the_exact_one(table: TextTable) -> None:
    table.replace_many([_video("c", (0.0, "first write builds the index", "ocr"))])
    table.replace_many(
        [
            _video("a", (1.0, "Architecture Reviev", "ocr")),  # OCR read a "w" as a "v"
            _video("b", (4.0, "the architecture review board", "subtitle")),
            _video("d", (2.0, "a lantern in the orchard", "speech")),
        ]
    )
    # Near words are looked up in the index only: rows it does not cover yet match exactly (until
    # index maintenance folds them in)
    assert [h.video_id for h in table.search("review", 10, fuzzy=True)] == ["b"]
    table.optimize(keep_versions_s=3600)
    assert [h.video_id for h in table.search("review", 10)] == ["b"]
    fuzzy = table.search("review", 10, fuzzy=True)
    assert [h.video_id for h in fuzzy] == ["b", "a"] and fuzzy[0].score > fuzzy[1].score
    assert [h.video_id for h in table.search("reviews", 10, fuzzy=True)] == ["b"]  # two letters from "reviev"
    # The first letter is kept: a word a letter away at its start is another word
    assert table.search("xeview", 10, fuzzy=True) == []


def test_an_alternative_reading_is_stored_and_answered_as_one(table: TextTable) -> None:
    rows = [
        TextRow("s-t000000", 1.0, 3.0, "and he can help", "speech", 0.4, (1.0, 1.4, 1.8, 2.4)),
        TextRow("s-t000001", 1.0, 3.0, "the beacon can help", "speech", 0.4, (1.0, 1.4, 1.8, 2.4), alternative=1),
    ]
    table.replace_many([VideoText("s", "s3://b/s.mp4", "v1", "fp-s-v1", "speech", rows)])
    [found] = table.search("beacon", 5)
    assert (found.segment_id, found.alternative, found.word_starts) == ("s-t000001", 1, (1.0, 1.4, 1.8, 2.4))
    assert {h.alternative for h in table.search("help", 5)} == {0, 1}


def _rows1_table(path: Path, *videos: str) -> TextTable:
    """A text table written by an older release in the layout before ``alternative`` (rows1): one
    segment for each of ``videos``."""
    import lancedb
    import pyarrow as pa

    from storage.texts import TEXT_SCHEMA

    name = text_table_name("rows1-subtitles", "g1")
    old = pa.schema([f for f in TEXT_SCHEMA if f.name != "alternative"])
    rows = [
        {
            "segment_id": f"{vid}-t000000", "video_id": vid, "uri": f"s3://b/{vid}.mp4", "version": "v1",
            "fingerprint": "fp", "pipeline": "subtitles", "start_s": 1.0, "end_s": 2.0,
            "text": f"the harbour at dawn {vid}", "source": "subtitle", "confidence": 1.0, "word_starts": [],
            "track": "",
        }
        for vid in videos
    ]  # fmt: skip
    lancedb.connect(str(path / "db")).create_table(name, pa.Table.from_pylist(rows, schema=old))
    return TextTable(IndexDatabase(S3Settings(), str(path / "db")), name)


def test_a_table_of_the_layout_before_alternatives_is_searched_as_best_readings(tmp_path: Path) -> None:
    [found] = _rows1_table(tmp_path, "a").search("harbour", 5)
    assert (found.segment_id, found.alternative) == ("a-t000000", 0)


def test_a_video_is_removed_from_a_table_of_the_layout_before_alternatives(tmp_path: Path) -> None:
    table = _rows1_table(tmp_path, "a", "b", "c", "d")
    table.replace(table.no_rows("a", "s3://b/a.mp4"))
    assert [table.count(v) for v in "abcd"] == [0, 1, 1, 1]
    # Several removals in one commit ("x" never written): the videos not named keep their rows
    table.replace_many([table.no_rows(v, f"s3://b/{v}.mp4") for v in ("b", "x", "d")])
    assert [table.count(v) for v in "abcd"] == [0, 0, 1, 0]
    assert [h.video_id for h in table.search("harbour", 5)] == ["c"]
