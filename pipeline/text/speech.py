"""Speech as text segments: the audio track, resampled to 16 kHz mono by PyAV, cut into utterances by
PocketSphinx's voice-activity segmenter, each decoded by PocketSphinx with its bundled US-English
acoustic model, language model and dictionary (no download). One segment per utterance, each word's
start kept (``TextSegment.word_starts``) so a match points at the word.

A recogniser's best reading of a rare word is often wrong (an unusual name, a word the language
model finds unlikely where it was said) while the right word is among its next readings. So each
utterance also gives its *alternative* readings: of its ``alternatives`` most likely hypotheses
(PocketSphinx's n-best list), each one that heard a word no reading kept before did, as a segment of
its own (``TextSegment.alternative`` > 0), its words timed by aligning it to the best reading. Search
finds them and counts a word only they heard below one the best reading heard
(``pipeline.query.hybrid.ALTERNATIVE_WEIGHT``)."""

from __future__ import annotations

import difflib
import io
import itertools
import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from numpy.typing import NDArray

from pipeline.media.probe import open_container, timeline_zero
from pipeline.text.segments import NO_DEADLINE, TextSegment, TextSource, WordsDeadline
from storage.errors import CorruptVideo, ModelUnavailable

RATE = 16_000
#: PocketSphinx reports times in frames of 10 ms.
_FRAME_S = 0.01
#: Fillers and markers the recogniser emits besides words; ``word(2)``: an alternate pronunciation.
_NOT_WORDS = {"<s>", "</s>", "<sil>", "[noise]", "[laugh]", "[breath]", "[cough]", "[um]", "[uh]"}
_ALT = re.compile(r"\(\d+\)$")


@dataclass
class SpeechStats:
    audio_s: float = 0.0
    utterances: int = 0
    seconds: float = 0.0


class SpeechUnavailable(ModelUnavailable):
    """pocketsphinx is missing (the text settings say speech is on)."""


def read_audio(path: Path, max_s: float, deadline: WordsDeadline = NO_DEADLINE) -> tuple[NDArray[np.int16], float]:
    """The first audio track of ``path`` as 16 kHz mono int16 samples (at most ``max_s`` seconds), and
    where its first sample lies on the player's timeline. No audio track: no samples.

    Raises:
        CorruptVideo, NotAVideo: the file can't be opened as a container.
        LimitExceeded: the ``deadline`` passed (asked before each audio frame).
    """
    with open_container(path) as container:
        if not container.streams.audio:
            return np.zeros(0, np.int16), 0.0
        stream = container.streams.audio[0]
        zero = timeline_zero(container) or Fraction(0)
        start = float(stream.start_time * stream.time_base - zero) if stream.start_time and stream.time_base else 0.0
        # Kept as it is, below 0 too (an audio track that starts before the picture): words said
        # before 0 are dropped, the others keep their place on the timeline.
        resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        chunks: list[NDArray[np.int16]] = []
        total, limit = 0, int(max_s * RATE)
        try:
            for frame in container.decode(stream):
                deadline.check()
                for out in resampler.resample(frame):
                    chunk = np.asarray(out.to_ndarray(), dtype=np.int16).reshape(-1)
                    chunks.append(chunk)
                    total += len(chunk)
                if total >= limit:
                    break
            else:
                chunks.extend(np.asarray(o.to_ndarray(), dtype=np.int16).reshape(-1) for o in resampler.resample(None))
        except av.error.FFmpegError:
            pass  # a damaged tail: what decoded still counts
        pcm = np.concatenate(chunks).astype(np.int16) if chunks else np.zeros(0, np.int16)
        return pcm[:limit], start


class SpeechRecognizer:
    """PocketSphinx over utterances; one decoder per recogniser, one thread at a time."""

    def __init__(self, max_audio_s: float = 4 * 3600.0, alternatives: int = 0) -> None:
        try:
            from pocketsphinx import Decoder, Segmenter
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise SpeechUnavailable("pocketsphinx is not installed") from exc
        self._decoder = Decoder(samprate=RATE, loglevel="FATAL")
        self._segmenter_cls = Segmenter
        self._max_audio_s = max_audio_s
        self._alternatives = alternatives
        self.stats = SpeechStats()

    def read_file(self, path: Path, deadline: WordsDeadline = NO_DEADLINE) -> list[TextSegment]:
        """The utterances of ``path``'s first audio track.

        Raises:
            LimitExceeded: the ``deadline`` passed (``read_audio``, ``read_pcm``).
        """
        pcm, offset = read_audio(path, self._max_audio_s, deadline)
        return self.read_pcm(pcm, offset, deadline)

    def read_pcm(
        self, pcm: NDArray[np.int16], offset_s: float = 0.0, deadline: WordsDeadline = NO_DEADLINE
    ) -> list[TextSegment]:
        """The utterances of 16 kHz mono int16 ``pcm`` whose first sample is at ``offset_s`` (the
        ``deadline`` asked before each utterance)."""
        started = time.perf_counter()
        self.stats.audio_s += len(pcm) / RATE
        segments: list[TextSegment] = []
        segmenter = self._segmenter_cls(sample_rate=RATE)
        for utterance in segmenter.segment(io.BytesIO(pcm.tobytes())):
            deadline.check()
            self.stats.utterances += 1
            segments.extend(self._decode(utterance.pcm, offset_s + utterance.start_time))
        self.stats.seconds += time.perf_counter() - started
        return segments

    def _decode(self, pcm: bytes, at_s: float) -> list[TextSegment]:
        """The utterance's best reading, then its alternative readings (none where the best heard nothing)."""
        d = self._decoder
        try:
            d.start_utt()
            d.process_raw(pcm, full_utt=True)
            d.end_utt()
        except RuntimeError as exc:  # pocketsphinx's own errors on audio it can't take
            raise CorruptVideo(f"speech: the recogniser refused the audio ({exc})") from exc
        words: list[str] = []
        starts: list[float] = []
        probs: list[float] = []
        before: set[str] = set()  # said before the picture starts: dropped, and not new in another reading
        end = at_s
        for seg in d.seg():
            word = _ALT.sub("", seg.word).lower()
            at = at_s + seg.start_frame * _FRAME_S
            if not word or word in _NOT_WORDS or word.startswith("++"):
                continue
            if at < 0:
                before.add(word)
                continue
            words.append(word)
            starts.append(round(at, 2))
            probs.append(float(seg.prob))
            end = at_s + (seg.end_frame + 1) * _FRAME_S
        if not words:
            return []
        confidence = round(sum(probs) / len(probs), 3)
        best = TextSegment(starts[0], round(end, 2), " ".join(words), TextSource.SPEECH, confidence, tuple(starts))
        if self._alternatives <= 0:
            return [best]
        nbest = itertools.islice(d.nbest(), self._alternatives)
        readings = ([w.lower() for w in h.hypstr.split()] for h in nbest)
        return [best, *alternative_readings(best, readings, before)]


def alternative_readings(
    best: TextSegment, readings: Iterable[list[str]], dropped: Collection[str] = ()
) -> list[TextSegment]:
    """Of ``readings`` (most likely first), each that heard a word neither ``best`` nor a reading kept
    before it did (nor one of ``dropped``, the best reading's words said before the picture starts), as a
    segment: ``alternative`` n for the n-th kept, the best's span and confidence, each word timed where
    it lines up with the best reading (a word in place of best words: spread over their time; one
    added: the time of the best word after it)."""
    heard = set(best.text.split()) | set(dropped)
    base = best.text.split()
    ends = [*best.word_starts[1:], best.end_s]
    kept: list[TextSegment] = []
    for reading in readings:
        words = [w for w in (_ALT.sub("", r) for r in reading) if w and w not in _NOT_WORDS and not w.startswith("++")]
        if not words or heard.issuperset(words):
            continue
        heard.update(words)
        starts: list[float] = []
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=base, b=words, autojunk=False).get_opcodes():
            if op == "equal":
                starts += best.word_starts[i1:i2]
                continue
            if op == "delete":
                continue
            begin = best.word_starts[i1] if i1 < len(base) else best.end_s
            until = ends[i2 - 1] if i2 > i1 else begin
            step = (until - begin) / (j2 - j1)
            starts += [round(begin + n * step, 2) for n in range(j2 - j1)]
        kept.append(
            TextSegment(
                best.start_s,
                best.end_s,
                " ".join(words),
                TextSource.SPEECH,
                best.confidence,
                tuple(starts),
                alternative=len(kept) + 1,
            )
        )
    return kept
