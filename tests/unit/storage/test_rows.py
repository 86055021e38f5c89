"""What every table of videos' rows does alike (``storage.rows``), on both kinds over a local LanceDB: a
video's "no rows" value removes its rows and leaves the others, summaries count what each video holds,
and a table never written answers empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage.config import S3Settings
from storage.db import IndexDatabase
from storage.frames import FrameRow, FrameTable, VideoFrames
from storage.rows import VideoRowsTable
from storage.texts import TextRow, TextTable, VideoText, text_table_name


def _frames(vid: str, n: int) -> VideoFrames:
    rows = [FrameRow(f"{vid}-{i}", float(i), np.ones(4, dtype=np.float32), None) for i in range(n)]
    return VideoFrames(vid, f"s3://b/{vid}", "v1", f"fp-{vid}", "m", rows)


def _text(vid: str, n: int) -> VideoText:
    rows = [TextRow(f"{vid}-{i}", float(i), i + 1.0, "words", "ocr", 0.9) for i in range(n)]
    return VideoText(vid, f"s3://b/{vid}", "v1", f"fp-{vid}", "subtitles", rows)


@pytest.fixture(params=["frames", "text"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[VideoRowsTable[Any], Any]:
    db = IndexDatabase(S3Settings(), str(tmp_path / "db"))
    if request.param == "frames":
        return FrameTable(db, "frames-x"), _frames
    return TextTable(db, text_table_name("subtitles", "g1")), _text


def test_a_video_s_no_rows_value_removes_its_rows_and_leaves_the_others(
    kind: tuple[VideoRowsTable[Any], Any],
) -> None:
    table, video = kind
    table.replace_many([video("a", 3), video("b", 2)])
    table.replace(table.no_rows("a", "s3://b/a"))
    assert (table.count("a"), table.count("b"), table.count()) == (0, 2, 2)


def test_summaries_count_each_video_s_rows_and_fingerprints(kind: tuple[VideoRowsTable[Any], Any]) -> None:
    table, video = kind
    table.replace_many([video("a", 3), video("b", 2)])
    streamed = dict(table.summaries(batch_rows=2))
    ranged = table.summaries_in("s3://b/a", "s3://b/b", include_from=True)
    for found in (streamed, ranged, {"a": table.summary("a"), "b": table.summary("b")}):
        assert {vid: (s.rows, dict(s.fingerprints), s.duplicate_ids, s.uri) for vid, s in found.items()} == {
            "a": (3, {"fp-a": 3}, 0, "s3://b/a"),
            "b": (2, {"fp-b": 2}, 0, "s3://b/b"),
        }


def test_a_table_never_written_answers_empty_and_takes_removals(kind: tuple[VideoRowsTable[Any], Any]) -> None:
    table, _ = kind
    table.replace(table.no_rows("a", "s3://b/a"))
    table.delete("a")
    assert (table.count(), table.summary("a").rows, dict(table.summaries())) == (0, 0, {})
    assert table.summaries_in("", "s3://z", include_from=True) == {}
