"""What the EventRouter remembers of messages it settled, by body digest: a redelivery after a lost
ack, and the other copy of one event (MinIO's ``dual`` delivery), are told from a message published
anew."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

#: Most digests kept while they are within the copy window (~150 bytes each): beyond ``memory`` they
#: are kept only for the window, so the later copy of an event is known at any rate up to this many
#: events per window.
COPY_MEMORY_CAP = 200_000


class Seen(Enum):
    NEW = "new"  # never settled, forgotten, or published anew: route it
    SETTLED = "settled"  # settled (its jobs submitted, or parked)
    COPY = "copy"  # its jobs were submitted within the copy window: the other copy of one event


class SettledMemory:
    """The digests of the last settled messages, with when their jobs were all submitted (None: parked).
    Holds ``memory`` of them, more while they are within ``copy_window_s`` (up to ``COPY_MEMORY_CAP``)."""

    def __init__(self, memory: int, copy_window_s: float, clock: Callable[[], float]) -> None:
        self._memory = memory
        self._window_s = copy_window_s
        self._clock = clock
        self._settled: OrderedDict[str, float | None] = OrderedDict()

    def seen(self, digest: str) -> Seen:
        if digest not in self._settled:
            return Seen.NEW
        routed_at = self._settled[digest]
        if routed_at is not None and self._clock() - routed_at < self._window_s:
            return Seen.COPY
        return Seen.SETTLED

    def forget(self, digest: str) -> None:
        """The same body published anew (a replay): it is routed again."""
        self._settled.pop(digest, None)

    def settled(self, digest: str, *, routed: bool) -> None:
        """``digest`` was acked: its jobs all submitted (``routed``) or parked. Keeps the memory bounded:
        the oldest go first, but one routed within the window stays (its other copy may be on its way)."""
        self._settled[digest] = self._clock() if routed else None
        now = self._clock()
        while len(self._settled) > self._memory:
            routed_at = next(iter(self._settled.values()))
            within = routed_at is not None and now - routed_at < self._window_s
            if within and len(self._settled) <= COPY_MEMORY_CAP:
                break
            self._settled.popitem(last=False)
