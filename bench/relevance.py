"""Relevance of the words in a video, through the search endpoint: ``python -m bench.relevance [--clips N]``.

A corpus with known answers, made by ``infra.dev.textclips``: clips with a muxed subtitle track
(SubRip, ASS, WebVTT, mov_text in turn), clips with captions drawn over a moving picture (fonts, sizes,
positions, colours and boxes varied), clips with Flite speech (its four voices in turn) and mixed clips (a
caption shown while a sentence is said). Each cue, caption and sentence is a query of two of its words (a
mixed one: one word of the caption and one of the sentence); its right moment is its clip, with the player
starting (the moment's ``ts_s``) within ±1 s of the words. No two words come together in two lines of the
corpus (``Phrases``), so each query has one right answer; each word alone shows up in about five lines.

Every clip goes through the product's indexing: the ``Indexer``'s index job (frames embedded by the tiny
SigLIP checkpoint, the only one this machine can have) and its text job (``TextStage``: every source on)
into a local LanceDB. Every query is then asked of ``GET /v1/search`` (the API app in this process,
``create_app`` over the ``SearchService`` the Api deployment serves, called through HTTP by Starlette's
test client) three ways on the same queries: every source (the hybrid search people get), the words only
(``sources=subtitle,ocr,speech``) and the pictures only (``sources=visual``: with random weights, what
chance gives, not what a real SigLIP would). Reported: recall@1 and @5 per source of the query for
each. Writes the ``relevance`` section of bench/results/latest.json."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bench.common import save_section
from events.jobs import IndexJob, JobOp, JobSource
from infra.dev.textclips import SUBTITLE_FORMATS, VOICES, Cue, Line, Overlay, overlaid_clip, spoken_clip, subtitled_clip
from pipeline.index.indexer import Indexer
from pipeline.index.result import Outcome
from pipeline.index.words import TextStage
from pipeline.settings import LimitSettings, Settings, TextSettings
from storage.frames import FRAMES
from storage.models import ModelTable
from storage.s3 import ObjectHead
from storage.tables import IndexStore

#: Words the phrases are made of: each phrase takes three, so two rare ones identify it.
VOCABULARY = [
    "harbour",
    "lantern",
    "orchard",
    "meadow",
    "granite",
    "compass",
    "violet",
    "thunder",
    "saffron",
    "glacier",
    "walnut",
    "falcon",
    "copper",
    "ember",
    "willow",
    "marble",
    "canyon",
    "pepper",
    "quartz",
    "island",
    "rocket",
    "velvet",
    "timber",
    "sparrow",
    "jasmine",
    "cobalt",
    "lemon",
    "summit",
    "beacon",
    "pebble",
    "winter",
    "garden",
    "silver",
    "anchor",
    "forest",
    "candle",
    "river",
    "kettle",
    "prairie",
    "coral",
    "amber",
    "pillow",
    "basket",
    "ribbon",
    "tiger",
    "rabbit",
    "castle",
    "ladder",
    "mirror",
    "button",
    "barrel",
    "carpet",
    "dragon",
    "helmet",
    "jacket",
    "lizard",
    "magnet",
    "muffin",
    "parrot",
    "pencil",
    "pocket",
    "saddle",
    "tunnel",
    "wagon",
    "whistle",
]
CLIP_SECONDS = 16
BUCKET = "bench"
#: How far a moment may be from the right one and still count.
TOLERANCE_S = 1.0
STYLES = [
    {"font": "sans", "size": 40, "colour": "white", "box": "black@0.6", "y": "h*0.15"},
    {"font": "serif", "size": 32, "colour": "yellow", "box": None, "y": "h*0.8"},
    {"font": "sans-bold", "size": 48, "colour": "white", "box": "navy@0.8", "y": "(h-text_h)/2"},
    {"font": "mono", "size": 28, "colour": "black", "box": "white@0.9", "y": "h*0.7"},
]


@dataclass(frozen=True)
class Truth:
    clip: str
    source: str
    start_s: float
    query: str


class Phrases:
    """Phrases of three words of ``VOCABULARY`` in which no two words come together twice in the corpus
    (a mixed clip's caption and the sentence said with it count as one line): a query of two words of
    one line has that line as its only right answer (a word alone shows up in other lines, as it would
    in any library)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._pairs: set[frozenset[str]] = set()

    def phrase(self, beside: Sequence[str] = ()) -> list[str]:
        """Three words no two of which came together before, nor one of them with a word ``beside`` (the
        caption a sentence is said with)."""
        for _ in range(10_000):
            words = self._rng.sample(VOCABULARY, 3)
            pairs = {frozenset(p) for p in itertools.combinations(words, 2)}
            pairs |= {frozenset((b, w)) for b in beside for w in words}
            if not set(beside) & set(words) and not pairs & self._pairs:
                self._pairs |= pairs
                return words
        raise RuntimeError("no phrase left whose pairs of words are all new: a larger vocabulary is needed")


def build_corpus(
    directory: Path, clips: int, seed: int = 7, speech_clips: int | None = None
) -> tuple[dict[str, Path], list[Truth]]:
    """``clips`` clips of each kind (``speech_clips`` of speech, at least ``clips``) and their queries."""
    phrases = Phrases(random.Random(seed))
    paths: dict[str, Path] = {}
    truths: list[Truth] = []
    formats = list(SUBTITLE_FORMATS)
    for n in range(clips):
        name = f"sub{n}"
        cues = [Cue(t, t + 2.5, " ".join(phrases.phrase())) for t in (1.0, 5.0, 9.0, 13.0)]
        paths[name] = subtitled_clip(directory / name, cues, CLIP_SECONDS, fmt=formats[n % len(formats)])
        truths += [Truth(name, "subtitle", c.start_s, " ".join(c.text.split()[:2])) for c in cues]
        name = f"ocr{n}"
        style = STYLES[n % len(STYLES)]
        overlays = [Overlay(t, t + 4.0, " ".join(phrases.phrase()).title(), **style) for t in (1.0, 6.0, 11.0)]  # type: ignore[arg-type]
        paths[name] = overlaid_clip(directory / f"{name}.mp4", overlays, CLIP_SECONDS)
        truths += [Truth(name, "ocr", o.start_s, " ".join(o.text.lower().split()[:2])) for o in overlays]
        truths += _speech_clip(directory, n, phrases, paths)
        # Mixed: a caption shown while a sentence is said; the query is one word of each.
        name = f"mixed{n}"
        style = STYLES[(n + 1) % len(STYLES)]
        times = (1.0, 9.0)
        shown = [Overlay(t, t + 4.0, " ".join(phrases.phrase()).title(), **style) for t in times]  # type: ignore[arg-type]
        said = [
            Line(t, f"the {' '.join(phrases.phrase(beside=o.text.lower().split()))}", VOICES[(n + 1) % len(VOICES)])
            for t, o in zip(times, shown, strict=True)
        ]
        paths[name] = _mixed_clip(directory, name, shown, said)
        truths += [
            Truth(name, "mixed", o.start_s, f"{o.text.lower().split()[0]} {ln.text.split()[1]}")
            for o, ln in zip(shown, said, strict=True)
        ]
    for n in range(clips, max(clips, speech_clips or 0)):
        truths += _speech_clip(directory, n, phrases, paths)
    return paths, truths


def _speech_clip(directory: Path, n: int, phrases: Phrases, paths: dict[str, Path]) -> list[Truth]:
    """Speech clip ``n`` (two sentences, voice ``n`` of Flite's four in turn) and its queries."""
    name = f"speech{n}"
    lines = [Line(t, f"the {' '.join(phrases.phrase())}", VOICES[n % len(VOICES)]) for t in (1.0, 8.0)]
    paths[name] = spoken_clip(directory / f"{name}.mp4", lines, CLIP_SECONDS)
    return [Truth(name, "speech", ln.at_s, " ".join(ln.text.split()[1:3])) for ln in lines]


def _mixed_clip(directory: Path, name: str, shown: list[Overlay], said: list[Line]) -> Path:
    """A clip whose picture carries ``shown`` and whose sound says ``said`` (two passes, then muxed)."""
    picture = overlaid_clip(directory / f"{name}-picture.mp4", shown, CLIP_SECONDS)
    sound = spoken_clip(directory / f"{name}-sound.mp4", said, CLIP_SECONDS)
    out = directory / f"{name}.mp4"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-i", str(picture), "-i", str(sound),
         "-map", "0:v", "-map", "1:a", "-c", "copy", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    picture.unlink()
    sound.unlink()
    return out


class LocalObjects:
    """The bucket as the indexer sees it: clip name -> file (``ObjectSource``)."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self._paths = paths

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        path = self._paths.get(key)
        if path is None:
            return None
        etag = hashlib.md5(path.read_bytes()).hexdigest()
        return ObjectHead(bucket, key, path.stat().st_size, etag, None, "video/mp4", None)

    def download(self, head: ObjectHead, dest: Path) -> int:
        shutil.copyfile(self._paths[head.key], dest)
        return dest.stat().st_size


class QueryEncoder:
    """The Encoder deployment's query side, in this process."""

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        return self._encoder.embed_texts([text])[0]

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        return self._encoder.embed_images([rgb])[0]


class Live:
    """``LiveModels`` of the bench's index: the tiny model's frames table and the text table."""

    def __init__(self, active: ModelTable, text: ModelTable) -> None:
        self._active, self._text = active, text

    def active(self) -> ModelTable:
        return self._active

    def text(self) -> ModelTable:
        return self._text


class NoJobs:
    def submit(self, job: IndexJob) -> str:
        raise NotImplementedError


async def _no_stats() -> dict[str, Any]:
    return {}


def _recall(ranked: dict[Truth, list[dict[str, Any]]], source: str, k: int) -> float:
    """Of the queries of ``source``, the share whose right moment is among the first ``k``."""
    wanted = [t for t in ranked if t.source == source]
    found = sum(1 for t in wanted if any(_right(t, m) for m in ranked[t][:k]))
    return round(found / len(wanted), 3) if wanted else 0.0


def _right(truth: Truth, moment: dict[str, Any]) -> bool:
    return bool(moment["uri"].endswith(f"/{truth.clip}.mp4") and abs(moment["ts_s"] - truth.start_s) <= TOLERANCE_S)


def index_corpus(paths: dict[str, Path], tmp: Path) -> tuple[Settings, IndexStore, Any, Live, dict[str, float]]:
    """Every clip indexed by the product's index job then its text job; seconds per stage summed."""
    from infra.dev.tinymodel import build_tiny_siglip
    from pipeline.embedding.siglip import SiglipEncoder

    model = build_tiny_siglip(tmp / "tiny", seed=0)
    # One caller asks every query: no per-caller search rate here.
    settings = Settings(
        text=TextSettings(subtitles=True, ocr=True, speech=True), limits=LimitSettings(search_rate_per_s=0)
    )
    settings = settings.model_copy(update={"model": settings.model.model_copy(update={"id": str(model)})})
    encoder = SiglipEncoder(settings.model)
    store = IndexStore(settings.s3, uri=str(tmp / "db"))
    active = ModelTable(encoder.model_id, encoder.dim, FRAMES)
    text = ModelTable.for_text(settings.text.pipeline_id())
    objects = LocalObjects({f"{name}.mp4": path for name, path in paths.items()})
    words = TextStage(settings, objects, slots=1)
    indexer = Indexer(settings, encoder, store, objects, text_table=lambda: text, words=words)
    seconds: dict[str, float] = {}
    try:
        for name in paths:
            for source in (JobSource.EVENT, JobSource.TEXT):
                result = indexer.run(IndexJob(op=JobOp.INDEX, bucket=BUCKET, key=f"{name}.mp4", source=source))
                if result.outcome is not Outcome.INDEXED:
                    raise RuntimeError(f"{name}: the {source.value} job ended {result.outcome.value}")
                for stage, took in result.stages.items():
                    label = f"{source.value}:{stage}"  # the index jobs' and the text jobs' stages apart
                    seconds[label] = seconds.get(label, 0.0) + took
    finally:
        words.close()
    # As index maintenance does every round: the words written since the index was built folded into it.
    store.text_table(text.table).optimize(keep_versions_s=3600)
    return settings, store, encoder, Live(active, text), seconds


def main(argv: list[str] | None = None) -> None:
    from fastapi.testclient import TestClient

    from pipeline.api.app import create_app
    from pipeline.query.search import SearchService

    parser = argparse.ArgumentParser(prog="python -m bench.relevance", description=__doc__)
    parser.add_argument("--clips", type=int, default=8, help="clips of each kind")
    parser.add_argument(
        "--speech-clips", type=int, default=16, help="speech clips (at least --clips): speech is read least surely"
    )
    parser.add_argument("--misses", type=int, default=0, help="print each query the words-only search missed at this k")
    args = parser.parse_args(argv)
    ways = {"hybrid": None, "words": "subtitle,ocr,speech", "visual": "visual"}
    ranked: dict[str, dict[Truth, list[dict[str, Any]]]] = {way: {} for way in ways}
    with tempfile.TemporaryDirectory(prefix="vidx-relevance-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.monotonic()
        paths, truths = build_corpus(tmp, args.clips, speech_clips=args.speech_clips)
        built_s = time.monotonic() - started
        started = time.monotonic()
        settings, store, encoder, live, stages = index_corpus(paths, tmp)
        indexed_s = time.monotonic() - started
        service = SearchService(settings, store, QueryEncoder(encoder), models=live)
        app = create_app(settings, service, store, NoJobs(), _no_stats)
        with TestClient(app) as http:
            for way, sources in ways.items():
                for truth in truths:
                    params: dict[str, Any] = {"q": truth.query, "k": 5}
                    if sources is not None:
                        params["sources"] = sources
                    resp = http.get("/v1/search", params=params)
                    resp.raise_for_status()
                    ranked[way][truth] = resp.json()["results"]
    if args.misses:
        for truth, found in ranked["words"].items():
            if not any(_right(truth, m) for m in found[: args.misses]):
                got = [(m["uri"].rsplit("/", 1)[-1], m["ts_s"], m.get("text"), m["score"]) for m in found[:3]]
                print(f"missed {truth}: {got}", flush=True)
    metrics: dict[str, float] = {"clips": len(paths), "queries": len(truths)}
    for source in ("subtitle", "ocr", "speech", "mixed"):
        for k in (1, 5):
            metrics[f"{source}_recall{k}"] = _recall(ranked["hybrid"], source, k)
            metrics[f"{source}_words_recall{k}"] = _recall(ranked["words"], source, k)
            metrics[f"{source}_visual_recall{k}"] = _recall(ranked["visual"], source, k)
        print(
            f"{source:8s} hybrid recall@1 {metrics[f'{source}_recall1']:.3f}  @5 {metrics[f'{source}_recall5']:.3f}   "
            f"words only @5 {metrics[f'{source}_words_recall5']:.3f}   "
            f"visual-only @1 {metrics[f'{source}_visual_recall1']:.3f}  @5 {metrics[f'{source}_visual_recall5']:.3f}",
            flush=True,
        )
    text_s = {k.split(":")[1]: round(v, 1) for k, v in stages.items() if k.startswith("text:")}
    jobs = len(paths)
    # What a text job costs beside reading words: the row's claim and finish, the HEADs, the fetch, the write.
    overhead = sum(v for k, v in stages.items() if k in {f"text:{s}" for s in ("catalog", "head", "fetch", "write")})
    metrics["text_job_overhead_ms"] = round(1000 * overhead / jobs, 1)
    metrics["text_job_words_ms"] = round(
        1000 * sum(v for k, v in stages.items() if k.startswith("text:text_")) / jobs, 1
    )
    notes = [
        f"{args.clips} clips of each kind ({max(args.clips, args.speech_clips)} of speech), {CLIP_SECONDS} s each: "
        "subtitle tracks (SubRip, ASS, WebVTT, mov_text in "
        "turn, 4 cues each), captions drawn over a moving picture (4 styles of font, size, colour, box and "
        "position, 3 captions each), Flite speech (4 voices, 2 sentences each), and mixed clips (a caption "
        "shown while a sentence is said, twice each). A query is two words of its cue, caption or sentence (mixed: "
        "one word of the caption and one of the sentence), from 65 words; no two words come together in two "
        "lines, so each query has one right answer. Right: its clip, the moment's ts_s (where the player "
        "starts) within 1 s of the words.",
        "Each clip indexed by the Indexer's index job (tiny SigLIP) and its text job (every source on), then "
        "each query asked of GET /v1/search (the API app in process): every source (hybrid: reciprocal rank "
        "fusion), the words only, the pictures only (random weights: chance, no real ones can be installed).",
        f"corpus built in {built_s:.0f} s, indexed in {indexed_s:.0f} s (the text jobs' stages, s: {text_s}). "
        "text_job_overhead_ms: a text job's time beside reading words (claim and finish in the catalog, HEADs, "
        "the fetch, the write), per video, on a local LanceDB and local files: what a text job adds to a "
        "video beyond its sources' own cost (bench.stages.text_cost).",
    ]
    save_section("relevance", metrics, notes)


if __name__ == "__main__":
    main()
