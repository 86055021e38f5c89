"""The cost of reading a video's words, per source and per video-minute: ``python -m bench.stages.text_cost
[--seconds S]``.

One generated clip of ``S`` seconds (640×360, 10 fps, H.264 + AAC) carries all three: a subtitle track
(a cue every 4 s), on-screen text (a caption that changes every 5 s over a moving picture, so OCR reads
every sampled frame: its worst case) and speech (a Flite sentence every 6 s). Each source runs alone on
it (``TextExtractor`` with only that source on), after a warm-up on a 10 s clip with the same extractor;
CPU seconds are those of this process and the processes below it (the decode worker OCR's frames come
from), read from /proc; wall seconds the run's. Recall of the right words is
``bench.relevance``'s: here, only what each source found, to show it worked.

Writes the ``text_cost`` section of bench/results/latest.json."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import save_section
from infra.dev.textclips import Cue, Line, Overlay, overlaid_clip, spoken_clip, subtitled_clip
from pipeline.settings import Settings, TextSettings
from pipeline.text.extract import TextExtractor

WORDS = ["harbour", "lantern", "orchard", "meadow", "granite", "compass", "violet", "thunder", "saffron", "glacier"]


def _clip(directory: Path, seconds: int) -> Path:
    """One clip with a subtitle track, captions and speech (three passes of ffmpeg: muxed at the end)."""
    import subprocess

    cues = [Cue(t, t + 3.0, f"subtitle {WORDS[i % len(WORDS)]} {i}") for i, t in enumerate(range(0, seconds - 3, 4))]
    overlays = [
        Overlay(t, min(t + 5.0, seconds), f"Caption {WORDS[i % len(WORDS)].title()} {i}", size=40, box="black@0.6")
        for i, t in enumerate(range(0, seconds, 5))
    ]
    lines = [
        Line(t + 0.5, f"the {WORDS[i % len(WORDS)]} is near", "slt") for i, t in enumerate(range(0, seconds - 4, 6))
    ]
    subs = subtitled_clip(directory / "subs", cues, seconds, fmt="srt")
    shown = overlaid_clip(directory / "shown.mp4", overlays, seconds)
    said = spoken_clip(directory / "said.mp4", lines, seconds)
    out = directory / "all.mkv"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-i", str(shown), "-i", str(said), "-i", str(subs),
         "-map", "0:v", "-map", "1:a", "-map", "2:s", "-c", "copy", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def tree_cpu_s() -> float:
    """CPU seconds of this process and every process below it (the decode worker OCR's frames come
    from included), those it waited for counted too."""
    import os

    from bench.procstat import snapshot

    procs = snapshot().procs
    me = os.getpid()
    below, frontier = {me}, [me]
    while frontier:
        parent = frontier.pop()
        for p in procs.values():
            if p.ppid == parent and p.pid not in below:
                below.add(p.pid)
                frontier.append(p.pid)
    ticks = sum(procs[pid].ticks + procs[pid].child_ticks for pid in below if pid in procs)
    return ticks / os.sysconf("SC_CLK_TCK")


def _run(source: str, warm: Path, clip: Path) -> dict[str, float]:
    """One source alone on ``clip``, after a warm-up on ``warm`` with the same extractor (its OCR
    engine and speech decoder made then, as a consumer's are by its first video)."""
    on = {"subtitles": False, "ocr": False, "speech": False, source: True}
    with TextExtractor(Settings(text=TextSettings.model_validate(on))) as extractor:
        extractor.extract(warm)
        cpu0, wall0 = tree_cpu_s(), time.perf_counter()
        out = extractor.extract(clip)
        cpu, wall = tree_cpu_s() - cpu0, time.perf_counter() - wall0
    if out.errors:
        raise RuntimeError(f"{source}: {out.errors}")
    return {"cpu_s": cpu, "wall_s": wall, "segments": len(out.segments)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.text_cost", description=__doc__)
    parser.add_argument("--seconds", type=int, default=120)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vidx-text-") as tmp:
        directory = Path(tmp)
        (directory / "warm").mkdir()
        warm = _clip(directory / "warm", 10)
        clip = _clip(directory, args.seconds)
        metrics: dict[str, float] = {"clip_seconds": args.seconds}
        for source in ("subtitles", "ocr", "speech"):
            run = _run(source, warm, clip)
            per_min = 60.0 / args.seconds
            metrics[f"{source}_cpu_s_per_video_min"] = round(run["cpu_s"] * per_min, 3)
            metrics[f"{source}_wall_s_per_video_min"] = round(run["wall_s"] * per_min, 3)
            metrics[f"{source}_segments"] = run["segments"]
            print(
                f"{source:9s} {run['cpu_s'] * per_min:7.2f} CPU-s and {run['wall_s'] * per_min:7.2f} s "
                f"per video-minute, {int(run['segments'])} segments in {args.seconds} s"
            )
    s = args.seconds
    shown = {"subtitles": len(range(0, s - 3, 4)), "ocr": len(range(0, s, 5)), "speech": len(range(0, s - 4, 6))}
    notes = [
        f"One {s} s 640x360 clip carrying all three: {shown['subtitles']} subtitle cues, {shown['ocr']} captions "
        f"(a new one every 5 s over a moving picture, so OCR reads every sampled frame: its worst case) and "
        f"{shown['speech']} spoken sentences (Flite). Each source alone, after a warm-up on a 10 s clip with the "
        "same extractor; CPU seconds of this process and those below it (OCR's decode worker) per minute of video.",
        "`*_segments` is what each source found, beside what the clip holds (above): a sign it worked, not a "
        "recall figure (OCR splits a caption it reads partly in some frames into several segments; speech "
        "adds its alternative readings; recall is bench.relevance's).",
    ]
    save_section("text_cost", {**metrics, **{f"{k}_in_clip": v for k, v in shown.items()}}, notes)


if __name__ == "__main__":
    main()
