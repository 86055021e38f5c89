"""Relevance of the words in a video: ``python -m bench.relevance [--clips N]``.

A corpus with known answers, made by ``infra.dev.textclips``: clips with a muxed subtitle track
(SubRip, ASS, WebVTT, mov_text in turn), clips with captions drawn over a moving picture (fonts, sizes,
positions, colours and boxes varied) and clips with Flite speech (its four voices in turn). Each cue,
caption and sentence is a query of its two rarest words; its right moment is its clip at its start,
within ±1 s.

This first version measures the text side at the library level: every clip read by ``TextExtractor``
(every source on, as a video would be), its rows in one local text table (``storage.texts``), each
query searched there (``TextTable.search``: BM25 over all sources). A hit's moment is its segment's
start, or for speech the start of the first query word it holds; hits of one clip within 1 s of each
other are one moment. Reported: recall@1 and recall@5 per source of the query, beside visual-only
recall on the same queries: SigLIP text-to-frame cosine over the same clips' frames sampled every 1 s —
with the tiny random checkpoint this machine has (no real weights can be installed here), so it is what
chance gives, not what a real SigLIP would. Through the product's search endpoint (hybrid fusion) once
that exists. Writes the ``relevance`` section of bench/results/latest.json."""

from __future__ import annotations

import argparse
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import save_section
from infra.dev.textclips import SUBTITLE_FORMATS, VOICES, Cue, Line, Overlay, overlaid_clip, spoken_clip, subtitled_clip
from pipeline.settings import Settings, TextSettings
from pipeline.text.extract import TextExtractor
from storage.config import S3Settings
from storage.db import IndexDatabase
from storage.texts import TextHit, TextTable, VideoText, text_table_name

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
]
CLIP_SECONDS = 16
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


def _phrase(rng: random.Random) -> list[str]:
    return rng.sample(VOCABULARY, 3)


def build_corpus(directory: Path, clips: int, seed: int = 7) -> tuple[dict[str, Path], list[Truth]]:
    """``clips`` clips of each kind and their queries."""
    rng = random.Random(seed)
    paths: dict[str, Path] = {}
    truths: list[Truth] = []
    formats = list(SUBTITLE_FORMATS)
    for n in range(clips):
        name = f"sub{n}"
        cues = [Cue(t, t + 2.5, " ".join(_phrase(rng))) for t in (1.0, 5.0, 9.0, 13.0)]
        paths[name] = subtitled_clip(directory / name, cues, CLIP_SECONDS, fmt=formats[n % len(formats)])
        truths += [Truth(name, "subtitle", c.start_s, " ".join(c.text.split()[:2])) for c in cues]
        name = f"ocr{n}"
        style = STYLES[n % len(STYLES)]
        overlays = [Overlay(t, t + 4.0, " ".join(_phrase(rng)).title(), **style) for t in (1.0, 6.0, 11.0)]  # type: ignore[arg-type]
        paths[name] = overlaid_clip(directory / f"{name}.mp4", overlays, CLIP_SECONDS)
        truths += [Truth(name, "ocr", o.start_s, " ".join(o.text.lower().split()[:2])) for o in overlays]
        name = f"speech{n}"
        lines = [Line(t, f"the {' '.join(_phrase(rng))}", VOICES[n % len(VOICES)]) for t in (1.0, 8.0)]
        paths[name] = spoken_clip(directory / f"{name}.mp4", lines, CLIP_SECONDS)
        truths += [Truth(name, "speech", ln.at_s, " ".join(ln.text.split()[1:3])) for ln in lines]
    return paths, truths


def _moments(hits: list[TextHit], query: str) -> list[tuple[str, float]]:
    """(clip, time) moments in rank order; a speech hit points at the first query word it holds."""
    words = set(query.lower().split())
    out: list[tuple[str, float]] = []
    for h in hits:
        t = h.start_s
        if h.word_starts:
            tokens = [re.sub(r"\W", "", w).lower() for w in h.text.split()]
            at = next((i for i, w in enumerate(tokens) if w in words), None)
            t = h.word_starts[at] if at is not None and at < len(h.word_starts) else t
        if not any(c == h.video_id and abs(t - s) <= TOLERANCE_S for c, s in out):
            out.append((h.video_id, t))
    return out


def _recall(ranked: dict[Truth, list[tuple[str, float]]], source: str, k: int) -> float:
    wanted = [t for t in ranked if t.source == source]
    found = sum(1 for t in wanted if any(c == t.clip and abs(s - t.start_s) <= TOLERANCE_S for c, s in ranked[t][:k]))
    return round(found / len(wanted), 3) if wanted else 0.0


def _visual(paths: dict[str, Path], truths: list[Truth], tmp: Path) -> dict[Truth, list[tuple[str, float]]]:
    """Visual-only moments: the tiny SigLIP's text embedding against every sampled frame's."""
    from infra.dev.tinymodel import build_tiny_siglip
    from pipeline.embedding.siglip import SiglipEncoder
    from pipeline.media.decode import sample_frames

    settings = Settings()
    model = build_tiny_siglip(tmp / "tiny", seed=0)
    encoder = SiglipEncoder(settings.model.model_copy(update={"id": str(model)}))
    keys: list[tuple[str, float]] = []
    vectors = []
    for name, path in paths.items():
        frames = list(sample_frames(path, settings.sampling.spec, settings.limits))
        vectors.append(encoder.embed_images([f.rgb for f in frames]))
        keys += [(name, f.ts_s) for f in frames]
    frames_v = np.concatenate(vectors)
    queries = encoder.embed_texts([t.query for t in truths])
    out: dict[Truth, list[tuple[str, float]]] = {}
    for truth, q in zip(truths, queries, strict=True):
        order = np.argsort(-(frames_v @ q))
        ranked: list[tuple[str, float]] = []
        for i in order:
            c, s = keys[int(i)]
            if not any(c == c2 and abs(s - s2) <= TOLERANCE_S for c2, s2 in ranked):
                ranked.append((c, s))
            if len(ranked) >= 5:
                break
        out[truth] = ranked
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relevance", description=__doc__)
    parser.add_argument("--clips", type=int, default=8, help="clips of each kind")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vidx-relevance-") as tmp_name:
        tmp = Path(tmp_name)
        paths, truths = build_corpus(tmp, args.clips)
        every_source = Settings(text=TextSettings(subtitles=True, ocr=True, speech=True))
        table = TextTable(IndexDatabase(S3Settings(), str(tmp / "db")), text_table_name("bench", "g1"))
        videos = []
        with TextExtractor(every_source) as extractor:
            for name, path in paths.items():
                extraction = extractor.extract(path)
                videos.append(VideoText(name, f"s3://bench/{name}", "v1", "fp", "bench", extraction.rows(name)))
        table.replace_many(videos)
        table.ensure_fts_index()
        text = {t: _moments(table.search(t.query, 20), t.query) for t in truths}
        visual = _visual(paths, truths, tmp)
    metrics: dict[str, float] = {"clips": len(paths), "queries": len(truths)}
    for source in ("subtitle", "ocr", "speech"):
        for k in (1, 5):
            metrics[f"{source}_recall{k}"] = _recall(text, source, k)
            metrics[f"{source}_visual_recall{k}"] = _recall(visual, source, k)
        print(
            f"{source:8s} recall@1 {metrics[f'{source}_recall1']:.3f}  @5 {metrics[f'{source}_recall5']:.3f}   "
            f"visual-only @1 {metrics[f'{source}_visual_recall1']:.3f}  @5 {metrics[f'{source}_visual_recall5']:.3f}"
        )
    notes = [
        f"{args.clips} clips of each kind, {CLIP_SECONDS} s each: subtitle tracks (SubRip, ASS, WebVTT, mov_text in "
        "turn, 4 cues each), captions drawn over a moving picture (4 styles of font, size, colour, box and "
        "position, 3 captions each), Flite speech (4 voices, 2 sentences each). A query is two words of its "
        "cue, caption or sentence; right: its clip, within 1 s of its start.",
        "Text side at the library level (TextExtractor with every source on, one local text table, BM25 over "
        "all sources); visual-only: the tiny random SigLIP's text-to-frame cosine on the same clips, i.e. "
        "chance (no real weights here). Not yet through the product's search endpoint.",
    ]
    save_section("relevance", metrics, notes)


if __name__ == "__main__":
    main()
