"""A text table: one row per text segment of a video (subtitle, on-screen text, speech), carrying the
fingerprint of the result it belongs to like a frames table's rows, and a full-text index on ``text``.

Rows are replaced per video in one ``merge_insert`` (``storage.rows``, as a frames table's), so readers never see half
a video's segments. The full-text index keeps word positions (phrases) and neither drops stop words
nor stems (an exact phrase is what the user typed); rows written after the index was built are found
too (LanceDB scans the unindexed part: exact words only) until index maintenance folds them in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pyarrow as pa

from storage.db import PRIMARY_KEY, IndexDatabase, read_errors_are_transient, sql_quote, write_errors_are_transient
from storage.rows import VideoRowsTable, unique_ids

TEXT_PREFIX = "text-"
FTS_INDEX = "text_idx"
#: A fuzzy search: an exact word counts this many times a word one letter away; each query word is
#: expanded to at most this many near words.
FUZZY_EXACT_BOOST = 3.0
FUZZY_EXPANSIONS = 20
#: What a segment's source may be (``pipeline.text.segments.TextSource``).
SOURCES = ("subtitle", "ocr", "speech")
#: The rows' layout, first in every text pipeline id: a new layout makes new tables (videos' words
#: read again by the text backfill), so a table is never written with rows of another layout.
#: rows2: ``alternative`` added.
TEXT_ROWS = "rows2"

TEXT_SCHEMA = pa.schema(
    [
        pa.field("segment_id", pa.string(), nullable=False, metadata=PRIMARY_KEY),
        pa.field("video_id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("version", pa.string(), nullable=False),
        #: (version, text pipeline) of the result this row belongs to.
        pa.field("fingerprint", pa.string(), nullable=False),
        pa.field("pipeline", pa.string(), nullable=False),
        pa.field("start_s", pa.float64(), nullable=False),
        pa.field("end_s", pa.float64(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("confidence", pa.float32(), nullable=False),
        pa.field("word_starts", pa.list_(pa.float64()), nullable=False),
        pa.field("track", pa.string(), nullable=False),
        #: 0: what the source read; n: the n-th other reading kept (``TextSegment.alternative``).
        pa.field("alternative", pa.int16(), nullable=False),
    ]
)


def text_table_name(pipeline: str, generation: str) -> str:
    """``text-<hash of the pipeline id>-<generation>``: a new generation per switch, so rows left by an
    aborted fill are never read."""
    return f"{TEXT_PREFIX}{hashlib.sha256(pipeline.encode()).hexdigest()[:8]}-{generation}"


@dataclass(frozen=True, slots=True)
class TextRow:
    segment_id: str
    start_s: float
    end_s: float
    text: str
    source: str
    confidence: float
    word_starts: tuple[float, ...] = ()
    track: str = ""
    alternative: int = 0


@dataclass(frozen=True, slots=True)
class VideoText:
    """All segments of one text result of one video (none: the video's rows are removed)."""

    video_id: str
    uri: str
    version: str
    fingerprint: str
    pipeline: str
    rows: list[TextRow]


@dataclass(frozen=True, slots=True)
class TextHit:
    segment_id: str
    video_id: str
    uri: str
    version: str
    start_s: float
    end_s: float
    text: str
    source: str
    word_starts: tuple[float, ...]
    score: float
    alternative: int = 0


class TextTable(VideoRowsTable[VideoText]):
    """One text table of an index database (created on the first write)."""

    id_column = "segment_id"

    def __init__(self, db: IndexDatabase, name: str) -> None:
        super().__init__(db, name)
        self._fts_seen = False
        self._alternatives: bool | None = None

    def table(self, create: bool = False) -> Any | None:
        return self.opened(TEXT_SCHEMA if create else None)

    def no_rows(self, video_id: str, uri: str) -> VideoText:
        return VideoText(video_id, uri, "", "", "", rows=[])

    # -- writes -----------------------------------------------------------------------------------
    def arrow_rows(self, videos: Sequence[VideoText]) -> pa.Table:
        """The segments of ``videos`` as one Arrow table.

        Raises:
            ValueError: two rows share a ``segment_id``, or a row's source is not one of ``SOURCES``.
        """
        rows = [(v, r) for v in videos for r in v.rows]
        unique_ids([r.segment_id for _, r in rows], "segment_id")
        if any(r.source not in SOURCES for _, r in rows):
            raise ValueError(f"a segment's source is not one of {SOURCES}")
        return pa.Table.from_pylist(
            [
                {
                    "segment_id": r.segment_id,
                    "video_id": v.video_id,
                    "uri": v.uri,
                    "version": v.version,
                    "fingerprint": v.fingerprint,
                    "pipeline": v.pipeline,
                    "start_s": r.start_s,
                    "end_s": r.end_s,
                    "text": r.text,
                    "source": r.source,
                    "confidence": r.confidence,
                    "word_starts": list(r.word_starts),
                    "track": r.track,
                    "alternative": r.alternative,
                }
                for v, r in rows
            ],
            schema=TEXT_SCHEMA,
        )

    def after_write(self) -> None:
        if not self._fts_seen:
            # At once, not at a maintenance round: without the index a search scans with no tokenizer
            # (case-sensitive, whole strings); with it, rows written later are searched with its
            # tokenizer until an optimize folds them in. Looked for on every write until seen, so a
            # writer that died between its first merge and the index, or lost the race to build it,
            # leaves no table without one.
            self.ensure_fts_index()

    @write_errors_are_transient
    def ensure_fts_index(self) -> bool:
        """Build the full-text index on ``text`` if the table has rows and no such index; whether it built one."""
        from lancedb.index import FTS

        table = self.table()
        if table is None or table.count_rows() == 0:
            return False
        if any(getattr(i, "name", None) == FTS_INDEX for i in table.list_indices()):
            self._fts_seen = True
            return False
        config = FTS(with_position=True, remove_stop_words=False, stem=False)
        try:
            table.create_index("text", config=config, name=FTS_INDEX)
        except Exception:
            # Another writer built it first (or building failed): a later write looks again.
            if not any(getattr(i, "name", None) == FTS_INDEX for i in table.list_indices()):
                raise
        self._fts_seen = True
        return True

    @read_errors_are_transient
    def unindexed_rows(self) -> int | None:
        """Rows the full-text index does not cover yet (searched by a scan until an optimize folds them
        in); None: no table, or no index yet."""
        table = self.table()
        if table is None:
            return None
        stats = table.index_stats(FTS_INDEX)
        return None if stats is None else int(stats.num_unindexed_rows)

    @write_errors_are_transient
    def optimize(self, keep_versions_s: float) -> None:
        """Compact, fold new rows into the full-text index, drop versions older than ``keep_versions_s``."""
        table = self.table()
        if table is not None:
            table.optimize(cleanup_older_than=timedelta(seconds=keep_versions_s))

    @read_errors_are_transient
    def search(
        self, query: str, limit: int, sources: Sequence[str] = SOURCES, *, phrase: bool = False, fuzzy: bool = False
    ) -> list[TextHit]:
        """The ``limit`` segments that best match ``query`` (BM25; ``phrase``: its words in order, next to
        each other; ``fuzzy``: a word also matches one a letter away, scored below the exact one — OCR and
        speech misread a letter or a sound now and then), of the given ``sources``, best first. Rows not
        yet in the index are searched too; alternative readings as any row (``TextHit.alternative``)."""
        from lancedb.query import BooleanQuery, MatchQuery, Occur, PhraseQuery

        table = self.table()
        if table is None or not query.strip() or not sources:
            return []
        # pydantic models: mypy reads their defaults as required
        match: Any = MatchQuery
        if phrase:
            fts: Any = PhraseQuery(query, "text")  # type: ignore[call-arg]
        elif fuzzy:
            exact = match(query, "text", boost=FUZZY_EXACT_BOOST)
            near = match(query, "text", fuzziness=1, prefix_length=1, max_expansions=FUZZY_EXPANSIONS)
            fts = BooleanQuery([(Occur.SHOULD, exact), (Occur.SHOULD, near)])
        else:
            fts = match(query, "text")
        search = table.search(fts, query_type="fts")
        if set(sources) != set(SOURCES):
            search = search.where(f"source IN ({', '.join(sql_quote(s) for s in sources)})", prefilter=True)
        columns = [
            "segment_id",
            "video_id",
            "uri",
            "version",
            "start_s",
            "end_s",
            "text",
            "source",
            "word_starts",
            "_score",
        ]
        if self._alternatives is None:  # a table's layout never changes: looked at once
            self._alternatives = "alternative" in table.schema.names
        if self._alternatives:  # a rows1 table (an older release's) has none: all best readings
            columns.insert(-1, "alternative")
        rows = search.select(columns).limit(limit).to_list()
        return [
            TextHit(
                r["segment_id"],
                r["video_id"],
                r["uri"],
                r["version"],
                float(r["start_s"]),
                float(r["end_s"]),
                r["text"],
                r["source"],
                tuple(r["word_starts"] or ()),
                float(r["_score"]),
                int(r.get("alternative") or 0),
            )
            for r in rows
        ]


def capped_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters at a word: the words that fit whole, or the first
    word's first ``max_chars`` characters when even it does not fit."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    if not text[max_chars].isspace() and len(head.split()) > 1:
        head = head.rsplit(None, 1)[0]  # the cut fell inside a word: that word goes
    return head.rstrip()
