"""Clips whose words are known: subtitle tracks muxed in, text drawn over the picture (ffmpeg's
drawtext), speech synthesised by Flite — the ground truth of the text tests and of ``bench.relevance``.
Needs the ``ffmpeg`` and ``flite`` commands (infra/local/install-system.sh)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: Fonts drawtext may use (Debian's fonts-dejavu-core and fonts-liberation).
FONTS = {
    "sans": "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "sans-bold": "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "serif": "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "mono": "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
}
#: Flite's built-in voices.
VOICES = ("slt", "rms", "awb", "kal16")
#: Subtitle formats: the file written, and the codec it is muxed as.
SUBTITLE_FORMATS = {
    "srt": ("srt", "mkv", "copy"),
    "ass": ("ass", "mkv", "copy"),
    "vtt": ("vtt", "mkv", "copy"),
    "mov_text": ("srt", "mp4", "mov_text"),
}


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str


@dataclass(frozen=True)
class Overlay:
    start_s: float
    end_s: float
    text: str
    font: str = "sans"
    size: int = 36
    colour: str = "white"
    box: str | None = None  # a box colour behind the text (e.g. "black@0.5"), or none
    x: str = "(w-text_w)/2"
    y: str = "h*0.15"


@dataclass(frozen=True)
class Line:
    at_s: float
    text: str
    voice: str = "slt"


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def _ts(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def _srt(cues: list[Cue]) -> str:
    return "".join(f"{i}\n{_ts(c.start_s)} --> {_ts(c.end_s)}\n{c.text}\n\n" for i, c in enumerate(cues, 1))


def _picture(seconds: float, size: tuple[int, int], still: bool = False) -> list[str]:
    """A moving picture with no text in it (ffmpeg's testsrc2 draws a timestamp: OCR would read it),
    or a still one (a slide). The same every run: three colour waves drifting at their own speeds, drawn
    small and scaled up (ffmpeg 5.1's ``gradients`` source draws other colours each run even with a
    seed, so a corpus made of it read differently each time)."""
    w, h = size
    if still:
        return ["-f", "lavfi", "-i", f"color=c=0x203040:s={w}x{h}:r=10:d={seconds}"]
    waves = "r='110+70*sin(2*PI*(X/W+T/8))':g='110+70*sin(2*PI*(Y/H+T/11))':b='110+70*cos(2*PI*((X+Y)/(W+H)-T/13))'"
    small = f"{max(2, w // 10)}x{max(2, h // 10)}"
    source = f"color=c=black:s={small}:r=10:d={seconds},format=rgb24,geq={waves},scale={w}x{h}:flags=bicubic"
    return ["-f", "lavfi", "-i", source]


def subtitled_clip(
    path: Path, cues: list[Cue], seconds: float, fmt: str = "srt", size: tuple[int, int] = (320, 180)
) -> Path:
    """A clip with one subtitle track of ``cues`` in ``fmt`` (srt, ass, vtt: Matroska; mov_text: MP4);
    ``path``'s suffix is set to the container's."""
    source_ext, container, codec = SUBTITLE_FORMATS[fmt]
    out = path.with_suffix(f".{container}")
    with tempfile.TemporaryDirectory() as tmp:
        srt = Path(tmp) / "cues.srt"
        srt.write_text(_srt(cues), encoding="utf-8")
        sub = srt
        if source_ext != "srt":
            sub = Path(tmp) / f"cues.{source_ext}"
            _run(["ffmpeg", "-v", "error", "-y", "-i", str(srt), str(sub)])
        _run(
            [
                "ffmpeg",
                "-v",
                "error",
                "-y",
                *_picture(seconds, size),
                "-i",
                str(sub),
                "-map",
                "0:v",
                "-map",
                "1:s",
                "-c:v",
                "libx264",
                "-preset",
                "ultrafast",
                "-g",
                "20",
                "-c:s",
                codec,
                "-t",
                str(seconds),
                str(out),
            ]
        )
    return out


def _fitting(o: Overlay, width: int) -> int:
    """``o``'s font size, smaller where its text (and box) would be wider than 94% of ``width``: a caption
    cut at the frame's edges is not the text the test expects read."""
    from PIL import ImageFont

    room = width * 0.94 - (16 if o.box else 0)
    size = o.size
    while size > 8 and ImageFont.truetype(FONTS[o.font], size).getlength(o.text) > room:
        size -= 2
    return size


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace(":", "\\:").replace("'", "\u2019").replace("%", "\\%")


def _drawn(overlays: list[Overlay], width: int) -> str:
    """The ffmpeg filter chain that draws ``overlays`` on a picture ``width`` wide (``null``: none)."""
    draws = []
    for o in overlays:
        box = f":box=1:boxcolor={o.box}:boxborderw=8" if o.box else ""
        draws.append(
            f"drawtext=fontfile={FONTS[o.font]}:text='{_escape(o.text)}':fontsize={_fitting(o, width)}"
            f":fontcolor={o.colour}{box}:x={o.x}:y={o.y}:enable='between(t,{o.start_s},{o.end_s})'"
        )
    return ",".join(draws) if draws else "null"


def with_words(
    video: Path,
    out: Path,
    *,
    cues: list[Cue] | None = None,
    overlays: list[Overlay] | None = None,
    lines: list[Line] | None = None,
    width: int,
) -> Path:
    """``video`` (MP4, no audio) with a subtitle track of ``cues`` (mov_text), ``overlays`` drawn on its
    picture (``width`` wide) and an audio track saying ``lines`` (AAC), written to ``out``, as long as
    ``video``; with no overlays its picture is copied, frame for frame."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, maps = ["-i", str(video)], ["-map", "0:v"]
        if cues:
            srt = Path(tmp) / "cues.srt"
            srt.write_text(_srt(cues), encoding="utf-8")
            inputs += ["-i", str(srt)]
            maps += ["-map", "1:s", "-c:s", "mov_text"]
        if lines:
            said, graph = _said(lines, Path(tmp), first=len(inputs) // 2)
            inputs += said
            maps += ["-filter_complex", graph, "-map", "[a]", "-c:a", "aac"]
        picture = ["-c:v", "copy"]
        if overlays:
            picture = ["-vf", _drawn(overlays, width), "-c:v", "libx264", "-preset", "ultrafast", "-g", "20"]
        # As long as the picture: the padded audio would run on, a subtitle track ends at its last cue.
        _run(["ffmpeg", "-v", "error", "-y", *inputs, *maps, *picture, "-t", f"{_seconds(video):.3f}", str(out)])
    return out


def _seconds(video: Path) -> float:
    """How long ``video``'s picture lasts (its container's duration where the stream has none)."""
    import av

    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
        return float(container.duration or 0) / av.time_base


def overlaid_clip(
    path: Path, overlays: list[Overlay], seconds: float, size: tuple[int, int] = (640, 360), *, still: bool = False
) -> Path:
    """A clip (MP4, H.264) with ``overlays`` drawn over a moving picture (``still``: a plain one), each
    in its time span, in a font size that fits the frame's width (``_fitting``)."""
    chain = _drawn(overlays, size[0])
    _run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-y",
            *_picture(seconds, size, still),
            "-vf",
            chain,
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-g",
            "20",
            "-t",
            str(seconds),
            str(path),
        ]
    )
    return path


def _said(lines: list[Line], tmp: Path, first: int) -> tuple[list[str], str]:
    """The ffmpeg inputs (Flite's recording of each line, written to ``tmp``) and the filter graph that
    mixes them into ``[a]``, each from its ``at_s``; ``first``: the index of the first of those inputs."""
    if shutil.which("flite") is None:
        raise RuntimeError("flite is not installed (infra/local/install-system.sh)")
    inputs: list[str] = []
    mix = []
    for i, line in enumerate(lines):
        wav = tmp / f"{i}.wav"
        _run(["flite", "-voice", line.voice, "-t", line.text, "-o", str(wav)])
        inputs += ["-i", str(wav)]
        delay = round(line.at_s * 1000)
        mix.append(f"[{i + first}:a]adelay={delay}|{delay},aresample=16000[a{i}]")
    labels = "".join(f"[a{i}]" for i in range(len(lines)))
    return inputs, ";".join([*mix, f"{labels}amix=inputs={len(lines)}:normalize=0,apad[a]"])


def spoken_clip(path: Path, lines: list[Line], seconds: float, size: tuple[int, int] = (320, 180)) -> Path:
    """A clip (MP4, H.264 + AAC) whose audio says each of ``lines`` from its ``at_s`` (Flite's voices)."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, graph = _said(lines, Path(tmp), first=1)
        _run(
            [
                "ffmpeg",
                "-v",
                "error",
                "-y",
                *_picture(seconds, size),
                *inputs,
                "-filter_complex",
                graph,
                "-map",
                "0:v",
                "-map",
                "[a]",
                "-c:v",
                "libx264",
                "-preset",
                "ultrafast",
                "-c:a",
                "aac",
                "-t",
                str(seconds),
                str(path),
            ]
        )
    return path
