"""Subtitle tracks as text segments (PyAV): every text subtitle stream the container carries — SubRip,
ASS/SSA, mov_text (MP4's timed text), WebVTT and the other text formats FFmpeg decodes to ASS — with
each event's time from its packet. Bitmap tracks (DVD, PGS, DVB) carry pictures, not words: they are
skipped here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av

from pipeline.media.probe import open_container, timeline_zero
from pipeline.text.segments import NO_DEADLINE, TextSegment, TextSource, WordsDeadline, clean_text
from storage.texts import capped_text

#: How long an event with no duration of its own is shown (until the next one, if that comes sooner).
DEFAULT_EVENT_S = 3.0
#: Events kept per video at most (a track is text: a pathological one must not fill the index).
MAX_EVENTS = 20_000


def read_subtitles(
    path: Path,
    max_events: int = MAX_EVENTS,
    max_chars: tuple[int, int] | None = None,
    deadline: WordsDeadline = NO_DEADLINE,
) -> list[TextSegment]:
    """The text events of every text subtitle track of the video at ``path``, in time order per track:
    at most ``max_events``; with ``max_chars`` (a segment's cap, the video's), the file is read no further
    once the events kept pass the video's cap, each counted as a segment's cap leaves it (``capped_text``):
    the caller's ``capped_words`` then leaves at least the last of them out, and says so.

    Raises:
        CorruptVideo, NotAVideo: the file can't be opened as a container (``open_container``).
        LimitExceeded: the ``deadline`` passed.
    """
    with open_container(path) as container:
        streams = [s for s in container.streams if s.type == "subtitle"]
        if not streams:
            return []
        zero = timeline_zero(container) or Fraction(0)
        events: dict[int, list[tuple[float, float | None, str]]] = {s.index: [] for s in streams}
        # A damaged container past some events: those read still count.
        with contextlib.suppress(av.error.FFmpegError):
            _read_events(container.demux(streams), zero, events, (max_events, max_chars), deadline)
        return [seg for s in streams for seg in _segments(events[s.index], _track(s))]


def _read_events(
    packets: Iterator[av.Packet],
    zero: Fraction,
    events: dict[int, list[tuple[float, float | None, str]]],
    limits: tuple[int, tuple[int, int] | None],
    deadline: WordsDeadline,
) -> None:
    (limit, max_chars), kept, chars = limits, 0, 0
    segment_chars, video_chars = max_chars or (0, 0)
    for packet in packets:
        deadline.check()
        if kept >= limit or (max_chars is not None and chars > video_chars):
            return  # the rest of the file is not demuxed
        if packet.pts is None or packet.stream.time_base is None:
            continue
        try:
            subtitles = packet.decode()
        except av.error.FFmpegError:
            continue  # one damaged event: the rest of the track still counts
        tb = packet.stream.time_base
        start = float(packet.pts * tb - zero)
        duration = float(packet.duration * tb) if packet.duration else None
        for subtitle in subtitles:
            text = _text_of(subtitle)
            if text and kept < limit:
                events[packet.stream.index].append((start, duration, text))
                kept, chars = kept + 1, chars + len(capped_text(text, segment_chars))


def _text_of(subtitle: object) -> str:
    raw = getattr(subtitle, "dialogue", None)  # AssSubtitle: the Dialogue line's text field
    if raw is None:
        raw = getattr(subtitle, "text", None)  # TextSubtitle
    if raw is None:
        return ""  # BitmapSubtitle
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    return clean_text(str(raw))


def _track(stream: av.stream.Stream) -> str:
    language = (stream.metadata or {}).get("language", "")
    return f"{stream.index}:{language}" if language and language != "und" else str(stream.index)


def _segments(events: list[tuple[float, float | None, str]], track: str) -> list[TextSegment]:
    events.sort(key=lambda e: e[0])
    out: list[TextSegment] = []
    for i, (start, duration, text) in enumerate(events):
        following = events[i + 1][0] if i + 1 < len(events) else None
        end = start + duration if duration else start + DEFAULT_EVENT_S
        if duration is None and following is not None:
            end = min(end, max(start, following))
        if end <= 0:
            continue  # shown before the player's 0 only
        out.append(TextSegment(max(0.0, start), end, text, TextSource.SUBTITLE, 1.0, track=track))
    return out
