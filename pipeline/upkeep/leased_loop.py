"""A background service's loop: a round every interval on a daemon thread, run by one worker of the
fleet at a time (the holder of a named lease in ``storage.leases``); and ``LeasedService``, the one wrapper
every upkeep service runs under (index maintenance, the model and text backfills, the scheduled check):
each supplies only its round."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Generic, TypeVar

from storage.leases import Leases

log = logging.getLogger(__name__)

T = TypeVar("T")


def new_holder() -> str:
    """A lease holder id unique to this process and loop: ``host:pid:token``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeasedLoop:
    """The lease ``lease`` and the thread of the service ``service`` (its thread's name).

    ``once`` runs a round only while this worker holds the lease; ``start`` calls a tick every
    ``every_s`` until its stop event is set, and a tick that fails is logged and the next one tries
    again. The tick takes the lease itself (through ``once`` or ``hold``), so a service can choose
    its round after the lease answers, or run the same round on demand.
    """

    def __init__(
        self,
        service: str,
        leases: Leases,
        lease: str,
        *,
        every_s: float,
        ttl_s: float,
        first_tick_now: bool = False,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``first_tick_now``: the first tick as the thread starts (else after one ``every_s``);
        ``clock``: the epoch seconds lease expiries are kept in."""
        self.service = service
        self._leases = leases
        self._lease = lease
        self._every_s = every_s
        self._ttl_s = ttl_s
        self._first_tick_now = first_tick_now
        self._holder = holder or new_holder()
        self._clock = clock
        self._leader = False
        #: When (epoch seconds) a tick of ``run`` last ended without raising; None before the first.
        self.last_ok: float | None = None

    @property
    def holder(self) -> str:
        return self._holder

    @property
    def leader(self) -> bool:
        """Whether the last answer of the lease was that this worker holds it."""
        return self._leader

    def hold(self) -> bool:
        """Take or renew the lease for ``ttl_s`` from now; whether this worker holds it.

        Raises:
            TransientError: the index database failed (``leader`` keeps its last answer).
        """
        self._leader = self._leases.acquire(self._lease, self._holder, self._ttl_s, self._clock())
        return self._leader

    def once(self, work: Callable[[], T]) -> T | None:
        """``work()`` if this worker holds the lease (taken or renewed first); None if another does.

        Raises:
            TransientError: the index database failed; and whatever ``work`` raises.
        """
        return work() if self.hold() else None

    def run(self, stop: threading.Event, tick: Callable[[], object], on_error: Callable[[str], None] | None) -> None:
        """``tick()`` every ``every_s`` until ``stop`` is set. A tick that raises is logged and its
        ``Type: message`` handed to ``on_error``; the loop goes on."""
        if not self._first_tick_now and stop.wait(self._every_s):
            return
        while not stop.is_set():
            try:
                tick()
                self.last_ok = time.time()
            except Exception as exc:  # a store blip must not end the loop
                why = f"{type(exc).__name__}: {exc}"
                # One line a round (a store down fails every round); the traceback for debugging.
                log.warning("%s round failed: %s", self.service, why)
                log.debug("%s round failed", self.service, exc_info=True)
                if on_error is not None:
                    on_error(why)
            stop.wait(self._every_s)

    def start(
        self, tick: Callable[[], object], on_error: Callable[[str], None] | None = None
    ) -> tuple[threading.Thread, threading.Event]:
        """``run`` on a daemon thread named after the service; set the returned event to stop it."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop, tick, on_error), name=self.service, daemon=True)
        thread.start()
        return thread, stop


class LeasedService(Generic[T]):
    """A background service as the upkeep runs it: ``work`` is its round, run by ``run_once`` while this
    worker holds ``loop``'s lease and by ``start`` on ``loop``'s thread every interval.

    ``last`` is what the last round returned (None before the first) and ``last_error`` why the last tick
    failed, kept until a round succeeds; ``idle`` is called on a tick another worker's lease skipped,
    ``on_error`` with a failed tick's ``Type: message``. ``tick``: what the thread runs instead of
    ``run_once``, for a service that picks its round by the time and takes the lease itself.
    """

    def __init__(
        self,
        loop: LeasedLoop,
        work: Callable[[], T],
        *,
        idle: Callable[[], object] | None = None,
        on_error: Callable[[str], None] | None = None,
        tick: Callable[[], object] | None = None,
    ) -> None:
        self.loop = loop
        self._work = work
        self._idle = idle
        self._on_error = on_error
        self._tick = tick or self.run_once
        self.last: T | None = None
        self.last_error: str | None = None

    @property
    def name(self) -> str:
        """The service's name: its thread's, as logged."""
        return self.loop.service

    @property
    def last_ok(self) -> float | None:
        """When (epoch seconds) a tick of this service last ended without an error; None before the first."""
        return self.loop.last_ok

    def run_once(self) -> T | None:
        """The round if this worker holds the lease (taken or renewed first), kept as ``last``; None if
        another worker holds it.

        Raises:
            TransientError: the index database failed; and whatever the round raises.
        """
        if not self.loop.hold():
            if self._idle is not None:
                self._idle()
            return None
        self.last = self._work()
        self.last_error = None
        return self.last

    def start(self) -> tuple[threading.Thread, threading.Event]:
        """The ticks on a daemon thread named after the service, until the returned event is set; a tick
        that fails is logged, kept as ``last_error`` and the next one tries again."""
        return self.loop.start(self._tick, self._failed)

    def _failed(self, why: str) -> None:
        self.last_error = why[:500]
        if self._on_error is not None:
            self._on_error(why)
