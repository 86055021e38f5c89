"""Search by what a video says and shows, through the whole product: three uploads dropped into the
bucket with the plain ``minio`` client — one with a subtitle track, one with text drawn on its picture,
one with speech — go MinIO -> RabbitMQ -> EventRouter -> IndexConsumer (frames) -> text queue ->
TextConsumer (subtitles, Tesseract, PocketSphinx) -> LanceDB, and each is found by a text query to
``GET /v1/search`` at the second its words come, with the words marked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.dev.textclips import Cue, Line, Overlay, overlaid_clip, spoken_clip, subtitled_clip
from infra.harness.faults import AppHost, start_app
from infra.harness.services import Services, eventually, unique_prefix
from tests.harness import report_lines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: Longest wait for an upload's words to be found (its frames, then its text job).
FOUND_S = 240.0
#: How far from the second its words come a moment may start and still be the right moment.
WITHIN_S = 1.0


@pytest.fixture(scope="module")
def host(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppHost]:
    env = {"VIDX_TEXT__SUBTITLES": "true", "VIDX_TEXT__OCR": "true", "VIDX_TEXT__SPEECH": "true"}
    with start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state"), env=env) as app:
        yield app


def _search(host: AppHost, q: str, sources: str | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"q": q, "k": 5}
    if sources is not None:
        params["sources"] = sources
    resp = host.http.get("/v1/search", params=params)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["results"])


def _found(host: AppHost, q: str, key: str, source: str) -> dict[str, Any] | None:
    """The first moment of ``key`` that ``source``'s words found for ``q``, if any."""
    return next((m for m in _search(host, q) if m["uri"].endswith(f"/{key}") and source in m["sources"]), None)


@pytest.mark.parametrize(
    ("source", "query", "at_s", "words"),
    [
        ("subtitle", "quarterly revenue", 3.0, ["quarterly", "revenue"]),
        ("ocr", '"Architecture Review"', 2.0, ["Architecture", "Review"]),
        ("speech", "lighthouse keeper", 2.0, ["lighthouse", "keeper"]),
    ],
)
def test_an_upload_is_found_by_its_words_at_the_second_they_come(
    request: pytest.FixtureRequest,
    host: AppHost,
    tmp_path: Path,
    source: str,
    query: str,
    at_s: float,
    words: list[str],
) -> None:
    # Given an upload whose only words are in one source, at a known second
    key = f"words/{source}.mp4"
    if source == "subtitle":
        clip = subtitled_clip(tmp_path / "clip", [Cue(at_s, at_s + 2, "the quarterly revenue grew")], 8, "mov_text")
    elif source == "ocr":
        overlay = Overlay(at_s, at_s + 3, "Architecture Review", size=44, box="black@0.7")
        clip = overlaid_clip(tmp_path / "clip.mp4", [overlay], seconds=8)
    else:
        clip = spoken_clip(tmp_path / "clip.mp4", [Line(at_s, "the lighthouse keeper lives alone")], seconds=8)
    started = time.monotonic()
    host.services.minio_client().fput_object(host.bucket, key, str(clip), content_type="video/mp4")
    # When its words are searched
    eventually(lambda: _found(host, query, key, source) is not None, f"{key} found by {query!r}", FOUND_S, 1.0)
    took_s = time.monotonic() - started
    moment = _found(host, query, key, source)
    assert moment is not None
    # Then the moment is at the second its words come, carries them, and marks the query's words
    assert abs(moment["start_s"] - at_s) <= WITHIN_S and moment["start_s"] <= moment["ts_s"] <= moment["end_s"]
    assert moment["text_source"] == source and moment["video_url"].endswith(f"#t={moment['ts_s']:g}")
    text = moment["text"]
    marked = [text[a:b].lower() for a, b in moment["text_marks"]]
    assert all(w.lower() in marked for w in words)
    # And the thumbnail it shows is served
    assert host.http.get(moment["thumbnail_url"]).status_code == 200
    # And asking for another source only does not find it by these words
    other = "ocr" if source != "ocr" else "subtitle"
    assert not any(m["uri"].endswith(f"/{key}") for m in _search(host, query, other))
    report_lines(
        request.config,
        [
            f"text search {source}: {query!r} found {key} at {moment['start_s']:.1f}s (words at {at_s:.1f}s), "
            f"{took_s:.1f}s after the upload, sources {'+'.join(moment['sources'])}, words {text!r}"
        ],
    )
