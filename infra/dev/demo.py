"""``vidx demo``: the whole product in one command, offline if need be.

Starts the local stack (with subtitles, on-screen text and speech read, unless the environment says otherwise),
uploads three generated videos with a plain S3 client (no API call), each carrying words (speech, a
subtitle track, a caption drawn on the picture), waits until they are indexed, then runs an image search (a
frame of video 2 at t = 4 s), a text search, and a search by each video's words, and prints the moments.
The stack is left running.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from infra.dev import stack
from infra.dev.samples import frame_at, write_video
from infra.dev.textclips import Cue, Line, Overlay, with_words
from pipeline.cli.common import ApiClient, CliError, format_moment
from pipeline.settings import Settings
from storage.ids import video_id
from storage.models import TEXT_MODEL_PREFIX

Echo = Callable[[str], None]
#: How long the demo tries the model hub before falling back to the tiny local model.
HUB_TIMEOUT_S = 60.0
INDEX_TIMEOUT_S = 600.0
SAMPLE_SECONDS = 12
SAMPLE_SIZE = (320, 240)
QUERY_VIDEO, QUERY_SECOND = 2, 4
#: The words each sample carries (a subtitle track; a caption drawn on the picture; a spoken sentence), and
#: the searches that find them: (query, the source that reads them, video, second).
SUBTITLES = {2: [Cue(8.0, 10.5, "a red boat leaves the harbour at dawn")]}
CAPTIONS = {3: [Overlay(6.0, 9.5, "QUARTERLY RESULTS", font="sans-bold", size=30, box="black@0.6")]}
SPEECH = {1: [Line(2.0, "the lighthouse keeper lives alone")]}
WORD_SEARCHES = [
    ("red boat", "subtitles", 2, 8.0),
    ('"quarterly results"', "ocr", 3, 6.0),
    ("lighthouse keeper", "speech", 1, 2.0),
]
#: The text sources the demo's stack reads, each unless the environment sets it (or sets ``VIDX_TEXT``).
DEMO_TEXT = ("subtitles", "ocr", "speech")


def _seed(n: int) -> int:
    return 1000 + n


def choose_model(settings: Settings, echo: Echo) -> str:
    """The configured model if it can be loaded from the cache or the hub, else a tiny local one."""
    if "id" in settings.model.model_fields_set or Path(settings.model.id).is_dir():
        return settings.model.id
    outcome: dict[str, Any] = {}

    def fetch() -> None:
        from huggingface_hub import snapshot_download

        try:
            outcome["path"] = snapshot_download(settings.model.id, local_files_only=True)
        except Exception:  # not cached: try the hub once
            try:
                outcome["path"] = snapshot_download(settings.model.id)
            except Exception as exc:
                outcome["error"] = f"{type(exc).__name__}"

    echo(f"model: looking for {settings.model.id} (HF cache, then the hub) ...")
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(HUB_TIMEOUT_S)
    if "path" in outcome:
        return settings.model.id
    from infra.dev.tinymodel import build_tiny_siglip

    tiny = (settings.state_dir / "tiny-siglip").resolve()
    echo(
        f"model: the hub is not reachable ({outcome.get('error', 'timed out')}): using a tiny random SigLIP "
        f"checkpoint built locally at {tiny}. Image search works with it; text relevance needs real "
        "weights (set VIDX_MODEL__ID to a SigLIP checkpoint directory)."
    )
    if not (tiny / "config.json").exists():
        build_tiny_siglip(tiny, seed=0)
    return str(tiny)


def run_demo(settings: Settings, echo: Echo) -> None:
    """Raises:
    StackError, CliError: one clear line on what went wrong.
    """
    model_id = choose_model(settings, echo)
    # The app's driver builds its settings from the environment: a source the user set stays as set.
    named = {name.upper() for name in os.environ}
    turned = {} if "VIDX_TEXT" in named else {s: True for s in DEMO_TEXT if f"VIDX_TEXT__{s.upper()}" not in named}
    os.environ.update({f"VIDX_TEXT__{source.upper()}": "true" for source in turned})
    text = settings.text.model_copy(update=turned)
    settings = settings.model_copy(update={"model": settings.model.model_copy(update={"id": model_id}), "text": text})
    stack.up(settings, echo)

    samples = (settings.state_dir / "samples").resolve()
    client = stack.minio_client(settings)
    bucket = settings.s3.upload_bucket
    ids = []
    for n in (1, 2, 3):
        plain = write_video(samples / f"plain-{n}.mp4", seconds=SAMPLE_SECONDS, size=SAMPLE_SIZE, seed=_seed(n))
        path = samples / f"sample-{n}.mp4"
        with_words(
            plain, path, cues=SUBTITLES.get(n), overlays=CAPTIONS.get(n), lines=SPEECH.get(n), width=SAMPLE_SIZE[0]
        )
        key = f"demo/sample-{n}.mp4"
        client.fput_object(bucket, key, str(path), content_type="video/mp4")
        ids.append(video_id(bucket, key))
        echo(f"uploaded s3://{bucket}/{key} with a plain S3 client (no API call)")

    api = ApiClient(settings)
    deadline = time.monotonic() + INDEX_TIMEOUT_S
    pending = set(ids)
    while pending:
        for vid in list(pending):
            video = _video(api, vid)
            # The words follow the frames (a text job, once the frames are in): wait for them too.
            words = [m for m in video["models"] if m["model"].startswith(TEXT_MODEL_PREFIX)] if video else []
            if video and video["status"] == "indexed" and (words or not settings.text.on):
                said = f", {words[0]['frames']} word segments" if words else ""
                echo(f"indexed {video['uri']}: {video['frames']} frames{said}")
                pending.discard(vid)
            elif video and video["status"] == "failed":
                raise CliError(f"{video['uri']} failed: {video['error']}")
        if pending and time.monotonic() > deadline:
            raise CliError(
                f"videos not indexed, or their words not read, after {INDEX_TIMEOUT_S:.0f}s (an app started "
                "before with its text sources off reads no words: make down, then make demo); "
                f"see {settings.state_dir}/logs"
            )
        time.sleep(0.5)

    png = io.BytesIO()
    Image.fromarray(frame_at(QUERY_SECOND, _seed(QUERY_VIDEO), SAMPLE_SIZE)).save(png, format="PNG")
    query_path = samples / "query.png"
    query_path.write_bytes(png.getvalue())
    echo(f"\nimage search: the frame of sample-{QUERY_VIDEO}.mp4 at t = {QUERY_SECOND} s ({query_path})")
    answer = api.request("POST", "/v1/search/image", params={"k": 3}, files={"image": ("q.png", png.getvalue())})
    for moment in answer["results"]:
        echo("  " + format_moment(moment))
    if not answer["results"]:
        raise CliError("the image search found nothing")
    top = answer["results"][0]
    hit = top["video_id"] == ids[QUERY_VIDEO - 1] and abs(top["ts_s"] - QUERY_SECOND) < settings.sampling.every_s / 2
    echo(f"  top hit: {top['uri']} at {top['ts_s']:g} s -> {'right video and second' if hit else 'MISS'}")

    echo('\ntext search: "a grid of colourful squares"')
    answer = api.request("GET", "/v1/search", params={"q": "a grid of colourful squares", "k": 3})
    for moment in answer["results"]:
        echo("  " + format_moment(moment))
    missed = [] if hit else ["the image search"]
    for q, source, n, second in WORD_SEARCHES:
        if not getattr(settings.text, source):
            echo(f"\nwords search: {q}: skipped (VIDX_TEXT__{source.upper()} is set off)")
        elif not _words_found(api, ids, q, n, second, echo):
            missed.append(f"the words search {q}")
    echo(f"\nvidx is running at {settings.api_url} (docs: {settings.api_url}/docs). Stop it with: make down")
    if missed:
        raise CliError(f"{', '.join(missed)} did not find the right moment")


def _words_found(api: ApiClient, ids: list[str], q: str, n: int, second: float, echo: Echo) -> bool:
    """Search the videos' words alone for ``q``; whether the top moment is sample ``n`` at ``second`` (± 1 s)."""
    echo(f"\nwords search: {q} (subtitles, on-screen text and speech only)")
    answer = api.request("GET", "/v1/search", params={"q": q, "k": 3, "sources": "subtitle,ocr,speech"})
    for moment in answer["results"]:
        echo("  " + format_moment(moment) + f"  {moment.get('text_source')}: {moment.get('text')!r}")
    top = answer["results"][0] if answer["results"] else None
    hit = top is not None and top["video_id"] == ids[n - 1] and abs(top["ts_s"] - second) <= 1.0
    where = f"{top['uri']} at {top['ts_s']:g} s" if top else "nothing"
    echo(f"  top hit: {where} -> {'right video and second' if hit else 'MISS'}")
    return hit


def _video(api: ApiClient, vid: str) -> dict[str, Any] | None:
    """The video's record, or None while the catalog doesn't know it yet (404)."""
    try:
        record: dict[str, Any] = api.request("GET", f"/v1/videos/{vid}")
    except CliError:
        return None
    return record
