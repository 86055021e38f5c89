"""Text jobs (``JobSource.TEXT``) through the real ``Indexer`` over a local LanceDB: an index job leaves a
video's words to a text job (``text_due``), the text job fills the text table once the frames are in,
and the rows follow the video's version (an overwrite clears the old words, a delete removes them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from infra.dev.samples import write_video
from infra.dev.textclips import Cue, subtitled_clip
from pipeline.index.clock import StageClock
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.indexer import Indexer, Outcome
from pipeline.index.words import TextStage
from pipeline.settings import LimitSettings, ServeSettings, Settings, TextSettings
from pipeline.text.settings import pipeline_may_read
from pipeline.upkeep.check import Checker, Finding
from pipeline.upkeep.report import CheckReport
from pipeline.upkeep.text_backfill import MAX_SUBMITS, TextBackfill
from storage.catalog import VideoStatus
from storage.errors import TransientError
from storage.frames import FRAMES, VideoFrames
from storage.ids import segment_id, text_fingerprint
from storage.models import ModelState, ModelTable
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from storage.texts import TextRow, VideoText
from tests.unit.index.test_indexer import MeanColour, MemoryObjects

CUES = [Cue(1.0, 2.5, "the harbour at dawn"), Cue(3.0, 4.0, "a red boat")]
TEXT = ModelTable.for_text(TextSettings(subtitles=True).pipeline_id())


class Parts:
    def __init__(
        self,
        tmp_path: Path,
        *,
        text: ModelTable | None = TEXT,
        claim_after_s: float | None = None,
        limits: LimitSettings | None = None,
    ) -> None:
        serve = ServeSettings() if claim_after_s is None else ServeSettings(claim_after_s=claim_after_s)
        self.settings = Settings(text=TextSettings(subtitles=True), serve=serve, limits=limits or LimitSettings())
        self.store = IndexStore(self.settings.s3, uri=str(tmp_path / "lance"))
        self.objects = MemoryObjects()
        self.text: ModelTable | None = text
        self.words = TextStage(self.settings, self.objects, slots=1)
        self.indexer = Indexer(
            self.settings,
            MeanColour(),
            self.store,
            self.objects,
            text_table=lambda: self.text,
            words=self.words,
        )
        self.tmp = tmp_path

    def clip(self, key: str, cues: list[Cue], seconds: float = 5, fmt: str = "mov_text") -> None:
        self.objects.put(key, subtitled_clip(self.tmp / key, cues, seconds=seconds, fmt=fmt))

    def text_rows(self, key: str) -> list[str]:
        table = self.store.text_table(TEXT.table).table()
        if table is None:
            return []
        rows = table.search().where(f"video_id = '{job(key).video_id}'").select(["text"]).limit(None).to_list()
        return sorted(r["text"] for r in rows)


def job(key: str, source: JobSource = JobSource.EVENT, op: JobOp = JobOp.INDEX) -> IndexJob:
    return IndexJob(op=op, bucket="videos", key=key, source=source)


def test_an_index_job_leaves_the_words_to_a_text_job_which_adds_them_to_the_row(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    # Given an index job that settled the frames
    first = p.indexer.run(job("a.mp4"))
    assert (first.outcome, first.text_due) == (Outcome.INDEXED, True)
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.index_in(TEXT.table) is None
    assert p.text_rows("a.mp4") == []
    # When its text job runs
    text = p.indexer.run(job("a.mp4", JobSource.TEXT))
    # Then the words are in the text table and the row names them beside the frames
    assert (text.outcome, text.text_due) == (Outcome.INDEXED, False)
    assert p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"]
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED
    entry = record.index_in(TEXT.table)
    assert entry is not None and entry.frames == 2
    assert entry.fingerprint == text_fingerprint(record.version or "", TEXT.pipeline or "")
    assert record.frames == first.frames and record.duration_s == pytest.approx(5.0, abs=0.1)
    # And another index or text job of the same content changes nothing and asks for no words
    again = p.indexer.run(job("a.mp4"))
    assert (again.outcome, again.text_due) == (Outcome.UNCHANGED, False)
    assert p.indexer.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.UNCHANGED
    assert p.objects.downloads == 2


def test_a_text_job_before_the_frames_are_in_does_nothing(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    assert p.indexer.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.UNCHANGED
    assert p.store.catalog.get(job("a.mp4").video_id) is None and p.objects.downloads == 0


def test_an_overwrite_clears_the_old_words_and_its_text_job_reads_the_new_ones(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    # When the object is overwritten and its index job runs
    p.clip("a.mp4", [Cue(0.5, 1.5, "a green lighthouse")])
    result = p.indexer.run(job("a.mp4"))
    # Then the old words are gone with the old frames, and the row names no words until the text job
    assert (result.outcome, result.text_due) == (Outcome.INDEXED, True)
    assert p.text_rows("a.mp4") == []
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.index_in(TEXT.table) is None
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    assert p.text_rows("a.mp4") == ["a green lighthouse"]


def test_a_delete_removes_the_words_too(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    del p.objects.files["a.mp4"]
    assert p.indexer.run(job("a.mp4", op=JobOp.DELETE)).outcome is Outcome.DELETED
    assert p.text_rows("a.mp4") == [] and p.store.text_table(TEXT.table).count(job("a.mp4").video_id) == 0


def test_a_video_no_source_on_may_read_settles_no_words_with_its_frames_and_gets_no_text_job(tmp_path: Path) -> None:
    p = Parts(tmp_path)  # subtitles on, and a video with no subtitle track
    p.objects.put("a.mp4", write_video(tmp_path / "plain.mp4", seconds=3, size=(64, 48)))
    # When its index job runs
    first = p.indexer.run(job("a.mp4"))
    # Then its words are settled as none found with its frames, and no text job is asked for
    assert (first.outcome, first.text_due) == (Outcome.INDEXED, False)
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED
    assert (entry := record.index_in(TEXT.table)) is not None and entry.frames == 0
    assert entry.fingerprint == text_fingerprint(record.version or "", TEXT.pipeline or "")
    # And a text job of it run all the same (one queued earlier) finds them held: nothing fetched again
    assert p.indexer.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.UNCHANGED
    assert p.indexer.run(job("a.mp4")).text_due is False
    assert p.objects.downloads == 1


def test_a_subtitle_track_without_words_gets_an_empty_entry_from_its_text_job(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", [Cue(1.0, 2.0, "<i></i>")])  # a track whose one cue is markup only
    assert p.indexer.run(job("a.mp4")).text_due is True
    assert p.indexer.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.INDEXED
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and (entry := record.index_in(TEXT.table)) is not None and entry.frames == 0
    assert p.indexer.run(job("a.mp4")).text_due is False


def test_an_overwrite_by_a_video_without_a_subtitle_track_clears_the_old_words(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    assert p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"]
    p.objects.put("a.mp4", write_video(tmp_path / "plain.mp4", seconds=3, size=(64, 48)))
    result = p.indexer.run(job("a.mp4"))
    assert (result.outcome, result.text_due) == (Outcome.INDEXED, False)
    assert p.text_rows("a.mp4") == []
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and (entry := record.index_in(TEXT.table)) is not None and entry.frames == 0
    assert entry.fingerprint == text_fingerprint(record.version or "", TEXT.pipeline or "")


@pytest.mark.parametrize(
    ("text", "audio", "subtitle", "may"),
    [
        (TextSettings(subtitles=True), 1, 0, False),
        (TextSettings(subtitles=True), 0, 1, True),
        (TextSettings(speech=True), 0, 1, False),
        (TextSettings(speech=True), 1, 0, True),
        (TextSettings(subtitles=True, speech=True), 0, 0, False),
        (TextSettings(ocr=True), 0, 0, True),
    ],
)
def test_which_tracks_a_turned_on_source_may_read(text: TextSettings, audio: int, subtitle: int, may: bool) -> None:
    assert pipeline_may_read(text.pipeline_id(), audio, subtitle) is may


@pytest.mark.parametrize("pipeline", ["rows1+subtitles", "harness-words", "rows2+subtitles+whisper", "none"])
def test_a_pipeline_this_release_does_not_name_may_read_any_video(pipeline: str) -> None:
    assert pipeline_may_read(pipeline, 0, 0) is True


class FailingWords:
    def rows(self, head: ObjectHead, video_id: str, clock: StageClock) -> list[TextRow]:
        raise TransientError("the OCR engine is busy")


def test_a_failed_text_job_puts_the_row_back_searchable_and_fails_no_video(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    before = p.store.catalog.get(job("a.mp4").video_id)
    p.indexer._words = FailingWords()
    with pytest.raises(TransientError):
        p.indexer.run(job("a.mp4", JobSource.TEXT))
    after = p.store.catalog.get(job("a.mp4").video_id)
    assert before is not None and after is not None
    assert after.status is VideoStatus.INDEXED and after.indexes == before.indexes and after.frames == before.frames


def test_with_no_text_source_on_there_is_no_text_due(tmp_path: Path) -> None:
    p = Parts(tmp_path, text=None)
    p.clip("a.mp4", CUES)
    assert p.indexer.run(job("a.mp4")).text_due is False
    assert p.indexer.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.UNCHANGED


class Sink:
    def __init__(self, fail: bool = False) -> None:
        self.jobs: list[IndexJob] = []
        self.fail = fail

    def submit(self, job: IndexJob) -> str:
        if self.fail:
            raise TransientError("broker down")
        self.jobs.append(job)
        return str(len(self.jobs))


class DeadLetters:
    def __init__(self) -> None:
        self.letters: list[object] = []

    def publish(self, letter: object) -> None:
        self.letters.append(letter)


def test_the_handler_submits_the_text_job_after_the_frames_and_retries_when_the_broker_refuses(
    tmp_path: Path,
) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    refusing = IndexTaskHandler(p.indexer, DeadLetters(), max_retries=3, text_jobs=Sink(fail=True))
    payload = job("a.mp4").model_dump(mode="json")
    # A refused text job retries the index task (its frames stand)
    with pytest.raises(TransientError):
        refusing.handle(payload, TaskContext("t1", retries=0))
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED
    # The retry finds the frames in and submits the text job
    sink = Sink()
    handler = IndexTaskHandler(p.indexer, DeadLetters(), max_retries=3, text_jobs=sink)
    assert handler.handle(payload, TaskContext("t1", retries=1))["outcome"] == "unchanged"
    assert [(j.source, j.key) for j in sink.jobs] == [(JobSource.TEXT, "a.mp4")]
    # The text job itself asks for no other
    assert handler.handle(sink.jobs[0].model_dump(mode="json"), TaskContext("t2", retries=0))["outcome"] == "indexed"
    assert len(sink.jobs) == 1 and p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"]


def test_a_text_job_that_gives_up_fails_no_video(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer._words = FailingWords()
    letters = DeadLetters()
    handler = IndexTaskHandler(p.indexer, letters, max_retries=1, text_jobs=Sink())
    answer = handler.handle(job("a.mp4", JobSource.TEXT).model_dump(mode="json"), TaskContext("t", retries=1))
    assert answer["outcome"] == "failed" and len(letters.letters) == 1
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED


class BucketListing:
    """The checker's listing of a ``MemoryObjects`` bucket."""

    def __init__(self, objects: MemoryObjects) -> None:
        self._objects = objects

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        keys = sorted(
            k for k in self._objects.files if k.startswith(prefix) and (start_after is None or k > start_after)
        )
        heads = [self._objects.head(bucket, k) for k in keys]
        yield [h for h in heads if h is not None]


def check(p: Parts) -> CheckReport:
    """``vidx check`` over the frames table and the text table, as ``build_checker`` wires it."""
    frames = ModelTable(MeanColour.model_id, 0, FRAMES)
    return Checker(
        model_id=MeanColour.model_id,
        sampling=p.settings.sampling.spec,
        extensions=[".mp4"],
        catalog=p.store.catalog,
        frames=p.store.frames,
        lister=BucketListing(p.objects),
        sink=None,
        in_flight_grace_s=60.0,
        new_object_grace_s=60.0,
        models=lambda: [frames, TEXT],
        frames_for=p.store.table_for,
    ).run(["videos"])


def test_the_check_holds_the_text_table_against_the_rows_through_overwrites_and_deletes(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.clip("b.mp4", CUES)
    for key in ("a.mp4", "b.mp4"):
        p.indexer.run(job(key))
        p.indexer.run(job(key, JobSource.TEXT))
    report = check(p)
    assert (report.in_sync, report.inconsistencies) == (2, 0)
    # An overwrite and a delete, each followed by its jobs, leave no words behind
    p.clip("a.mp4", [Cue(0.5, 1.5, "a green lighthouse")])
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    del p.objects.files["b.mp4"]
    p.indexer.run(job("b.mp4", op=JobOp.DELETE))
    report = check(p)
    assert (report.in_sync, report.inconsistencies) == (1, 0)
    # Words the row does not name are found: the old version's, planted back beside the new one's
    a = job("a.mp4").video_id
    record = p.store.catalog.get(a)
    assert record is not None and record.version is not None
    stale = VideoText(a, record.uri, "old", text_fingerprint("old", TEXT.pipeline or ""), TEXT.pipeline or "", [])
    text = p.store.text_table(TEXT.table)
    text.replace(replace(stale, rows=[TextRow(segment_id(a, 0), 0.0, 1.0, "the harbour at dawn", "subtitle", 1.0)]))
    report = check(p)
    assert report.counts[Finding.ROWS_MISMATCH] == 1 and report.models == {MeanColour.model_id: 0, TEXT.model: 1}
    (found,) = report.found
    assert found.video_id == a and TEXT.table in found.detail
    # And a text job puts them right
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    assert check(p).inconsistencies == 0 and p.text_rows("a.mp4") == ["a green lighthouse"]


def test_the_text_backfill_reads_the_words_of_videos_indexed_before_a_text_source_was_on(tmp_path: Path) -> None:
    # Given two videos indexed while no text source was on
    p = Parts(tmp_path, text=None)
    p.clip("a.mp4", CUES)
    p.clip("b.mp4", [Cue(0.5, 1.5, "a green lighthouse")])
    for key in ("a.mp4", "b.mp4"):
        assert p.indexer.run(job(key)).text_due is False
    # When a text source is turned on (the start-up names the text table)
    p.text = TEXT
    assert p.store.models.write(ModelState(active=ModelTable(MeanColour.model_id, 0, FRAMES), text=TEXT), 0)
    now = [0.0]
    sink = Sink()
    backfill = TextBackfill(
        p.store, sink, interval_s=1, max_outstanding=1, resubmit_after_s=60, lease_ttl_s=10, clock=lambda: now[0]
    )
    # Then rounds submit a text job per video, one out at a time
    first = backfill.round()
    assert first is not None and (first.total, first.need, first.submitted) == (2, 2, 1)
    assert backfill.round().submitted == 0  # type: ignore[union-attr]  # its job is out, within resubmit_after_s
    p.indexer.run(sink.jobs[0])
    second = backfill.round()
    assert second is not None and (second.done, second.need, second.submitted) == (1, 1, 1)
    p.indexer.run(sink.jobs[1])
    # And once every video has its words the rounds stop walking the catalog
    last = backfill.round()
    assert last is not None and (last.done, last.need) == (2, 0)
    assert backfill.round() is None
    assert sorted(j.key for j in sink.jobs) == ["a.mp4", "b.mp4"] and {j.source for j in sink.jobs} == {JobSource.TEXT}
    # Until resubmit_after_s has passed: then a walk finds a video whose words went missing since
    p.store.catalog.write(
        (r := p.store.catalog.get(job("a.mp4").video_id)).evolve(indexes=r.indexes[:1]),  # type: ignore[union-attr]
        r.rev,  # type: ignore[union-attr]
    )
    assert backfill.round() is None
    now[0] += 61
    again = backfill.round()
    assert again is not None and (again.need, again.submitted) == (1, 1) and sink.jobs[-1].key == "a.mp4"
    assert p.text_rows("b.mp4") == ["a green lighthouse"]


def test_the_text_backfill_gives_a_video_whose_text_jobs_fail_a_bounded_number_of_tries(tmp_path: Path) -> None:
    p = Parts(tmp_path, text=None)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.text = TEXT
    assert p.store.models.write(ModelState(active=ModelTable(MeanColour.model_id, 0, FRAMES), text=TEXT), 0)
    now = [0.0]
    sink = Sink()
    backfill = TextBackfill(
        p.store, sink, interval_s=1, max_outstanding=8, resubmit_after_s=60, lease_ttl_s=10, clock=lambda: now[0]
    )
    for _ in range(MAX_SUBMITS + 2):
        backfill.round()
        now[0] += 61  # its job never lands
    assert len(sink.jobs) == MAX_SUBMITS
    last = backfill.round()  # a walk finds it, and gives it no more
    assert last is not None and (last.given_up, last.submitted) == (1, 0)
    assert backfill.round() is None  # nothing left this process can do for now: the dead letters say why


def test_frames_embedded_again_at_the_same_version_keep_the_words(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    # The frames rows are lost (the words are not): the next job embeds the frames again
    vid = job("a.mp4").video_id
    p.store.frames.replace(VideoFrames(vid, "s3://videos/a.mp4", "", "", "", rows=[]))
    result = p.indexer.run(job("a.mp4"))
    assert (result.outcome, result.text_due) == (Outcome.INDEXED, False)
    record = p.store.catalog.get(vid)
    assert record is not None and (entry := record.index_in(TEXT.table)) is not None and entry.frames == 2
    assert p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"]
    assert check(p).inconsistencies == 0


def test_a_text_job_whose_consumer_keeps_dying_settles_the_words_as_none_found(tmp_path: Path) -> None:
    # Each start claims at once, as a redelivered one does (a first start claims only past claim_after_s).
    p = Parts(tmp_path, claim_after_s=0)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    vid = job("a.mp4").video_id
    max_crashes = p.settings.serve.max_crashes
    words_job = job("a.mp4", JobSource.TEXT)
    # Its consumer dies reading the words (an OCR engine crashing on a frame), each start a new process
    for n in range(max_crashes):

        def die_reading(step: str, _job: IndexJob) -> None:
            if step == "fetch":
                raise RuntimeError("consumer killed")  # the process dies here, holding the claim

        dying = Indexer(
            p.settings,
            MeanColour(),
            p.store,
            p.objects,
            holder=f"proc:gone{n}",
            holder_alive=lambda h: False,
            hooks=die_reading,
            text_table=lambda: TEXT,
            words=p.words,
        )
        with pytest.raises(RuntimeError):
            dying.run(words_job, task_id="t-words")
    # The next start gives up reading: the words are settled as none found, the frames stand
    survivor = Indexer(
        p.settings,
        MeanColour(),
        p.store,
        p.objects,
        holder="proc:last",
        holder_alive=lambda h: False,
        text_table=lambda: TEXT,
        words=FailingWords(),
    )
    assert survivor.run(words_job, task_id="t-words").outcome is Outcome.INDEXED
    record = p.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.INDEXED and record.frames > 0
    assert (entry := record.index_in(TEXT.table)) is not None and entry.frames == 0
    # And no job asks for them again at this version
    assert p.indexer.run(job("a.mp4")).text_due is False
    assert check(p).inconsistencies == 0


def test_a_text_job_on_a_process_that_reads_no_words_leaves_the_row_alone(tmp_path: Path) -> None:
    # A text job replayed onto the index queue of a process with no source on, say
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    before = p.store.catalog.get(job("a.mp4").video_id)
    no_words = Indexer(p.settings, MeanColour(), p.store, p.objects, text_table=lambda: TEXT, words=None)
    assert no_words.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.UNCHANGED
    after = p.store.catalog.get(job("a.mp4").video_id)
    assert before is not None and after is not None and after.rev == before.rev  # not even claimed


class CountingWords:
    def __init__(self, inner: TextStage) -> None:
        self.inner, self.reads = inner, 0

    def rows(self, head: ObjectHead, video_id: str, clock: StageClock) -> list[TextRow]:
        self.reads += 1
        return self.inner.rows(head, video_id, clock)


def test_words_read_while_another_job_settled_the_row_join_it_without_a_second_reading(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    other = Indexer(p.settings, MeanColour(), p.store, p.objects, text_table=lambda: TEXT, words=p.words)
    settled: list[Outcome] = []

    def confirm_meanwhile(step: str, _job: IndexJob) -> None:
        # The words are read; before they are written a job of the same version (an API submit whose
        # `queued` mark asks it to settle) confirms the row over the text job's claim.
        if step == "write" and not settled:
            settled.append(
                other.run(
                    IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.API, settle=True)
                ).outcome
            )

    words = CountingWords(p.words)
    racing = Indexer(
        p.settings, MeanColour(), p.store, p.objects, hooks=confirm_meanwhile, text_table=lambda: TEXT, words=words
    )
    assert racing.run(job("a.mp4", JobSource.TEXT)).outcome is Outcome.INDEXED
    assert settled == [Outcome.UNCHANGED] and words.reads == 1
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED
    assert [e.table for e in record.indexes] == [FRAMES, TEXT.table] and record.index_in(TEXT.table).frames == 2  # type: ignore[union-attr]
    assert p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"] and check(p).inconsistencies == 0


def test_a_retry_of_an_overwrite_by_a_video_without_a_subtitle_track_clears_the_words_its_first_start_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = Parts(tmp_path)
    p.clip("a.mp4", CUES)
    p.indexer.run(job("a.mp4"))
    p.indexer.run(job("a.mp4", JobSource.TEXT))
    p.objects.put("a.mp4", write_video(tmp_path / "plain.mp4", seconds=3, size=(64, 48)))
    # Given the overwrite's first start, whose frame commit fails before the old words are cleared
    real = p.indexer._writer_for
    failed: list[str] = []

    class FailingCommit:
        def replace(self, video: object) -> None:
            raise TransientError("the frame commit timed out")

    def writer_for(table: str) -> object:
        if not table.startswith("text") and not failed:
            failed.append(table)
            return FailingCommit()
        return real(table)

    monkeypatch.setattr(p.indexer, "_writer_for", writer_for)
    with pytest.raises(TransientError):
        p.indexer.run(job("a.mp4"))
    assert failed and p.text_rows("a.mp4") == ["a red boat", "the harbour at dawn"]
    # When its retry runs
    result = p.indexer.run(job("a.mp4"))
    # Then the row says no words and the text table holds none of the old version's
    assert (result.outcome, result.text_due) == (Outcome.INDEXED, False)
    assert p.text_rows("a.mp4") == []
    record = p.store.catalog.get(job("a.mp4").video_id)
    assert record is not None and (entry := record.index_in(TEXT.table)) is not None and entry.frames == 0
