"""Dead letters are read back whichever way they reached the queue."""

from __future__ import annotations

import json

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.deadletters import DeadLetter, FailureKind, decode_dead_letter

JOB = IndexJob(op=JobOp.INDEX, bucket="videos", key="dir/clip 1.mp4", source=JobSource.EVENT, hint_version="e1")


def test_our_letters_round_trip() -> None:
    letter = DeadLetter(id="t1", kind=FailureKind.PERMANENT, reason="not a video: no video stream", attempts=1, job=JOB)
    back = decode_dead_letter(letter.model_dump_json().encode(), {})
    assert back == letter
    assert back.summary()["uri"] == "s3://videos/dir/clip 1.mp4"


def test_a_task_moved_by_rays_adapter_is_read_with_its_job() -> None:
    # What CeleryTaskProcessorAdapter._handle_task_failure sends: (task id, exception text,
    # str(args), str(kwargs), traceback) as the args of a task message.
    args = [JOB.model_dump(mode="json")]
    body = json.dumps([["t7", "boom", str(args), "{}", "Traceback ..."], {}, {}]).encode()
    letter = decode_dead_letter(body, {"task": "index_video", "id": "x", "retries": 0})
    assert (letter.id, letter.kind, letter.reason, letter.job) == ("t7", FailureKind.EXHAUSTED, "boom", JOB)


def test_a_task_with_an_unreadable_job_keeps_the_raw_text() -> None:
    body = json.dumps([["t8", "boom", "[<object at 0x1>]", "{}", ""], {}, {}]).encode()
    letter = decode_dead_letter(body, {"task": "index_video"})
    assert letter.kind is FailureKind.MALFORMED and letter.job is None and letter.raw_job == "[<object at 0x1>]"


@pytest.mark.parametrize("body", [b"not json", b'{"id": 3}', b"[]"])
def test_anything_else_is_an_error_naming_the_problem(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_dead_letter(body, {})
