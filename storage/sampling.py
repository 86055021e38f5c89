"""How frames are picked from a video: a ``Sampling`` value, and its label as the catalog stores it.

The label (``every_s=1``) is part of every index fingerprint and of the catalog's ``sampling``
column, so its text never changes for a sampling that exists: new strategies get new labels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SamplingStrategy(enum.StrEnum):
    """Which frames a sampling picks; the value is the label's key."""

    #: For each t = 0, every_s, 2·every_s, … of the player's timeline, the first frame at or after t.
    INTERVAL = "every_s"


@dataclass(frozen=True, slots=True)
class Sampling:
    """One frame per ``every_s`` seconds, picked by ``strategy``.

    Raises:
        ValueError: ``every_s`` isn't positive.
    """

    every_s: float
    strategy: SamplingStrategy = SamplingStrategy.INTERVAL

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"every_s must be positive (got {self.every_s!r})")

    @property
    def label(self) -> str:
        """The stored form (``every_s=1``, ``every_s=0.5``): the catalog column and the fingerprint's part."""
        return f"{self.strategy.value}={self.every_s:g}"

    @classmethod
    def parse(cls, label: str) -> Sampling:
        """The sampling a ``label`` names.

        Raises:
            ValueError: not a label of a known strategy with a positive interval.
        """
        key, sep, value = label.partition("=")
        if not sep:
            raise ValueError(f"not a sampling label: {label!r}")
        return cls(float(value), SamplingStrategy(key))


def hms(ts_s: float, decimals: int = 0) -> str:
    """A point on a video's timeline for people: ``01:02:03`` (truncated to the second), or with
    ``decimals`` digits of the second, ``01:02:03.4``."""
    if decimals <= 0:
        total = max(0, int(ts_s))
        return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"
    minutes, s = divmod(max(ts_s, 0.0), 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours:02d}:{minutes:02d}:{s:0{3 + decimals}.{decimals}f}"
