"""Decode workers: child processes that run decodes and are killed when one overruns its time.

FFmpeg can't be stopped from another thread in the middle of a call (a decoder caught in a loop, a
read that never returns; closing the container under it frees memory it is using), so the one hard
bound on a decode's time is a process boundary. A worker is started once and reused: its start (an
interpreter, PyAV, numpy) is paid per worker, not per video. This module is the transport (framed
messages over the worker's stdin/stdout, deadlines, the pool); what a worker runs is the handler
given to ``serve`` in the child (``pipeline.media.decode``).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, BinaryIO

#: Message kinds (one byte each).
READY, DONE, ERROR = b"R", b"D", b"E"

#: kind, header length, payload length.
_FRAME = struct.Struct("!cII")
#: How long a worker killed with SIGKILL may take to be reaped before it is given up on.
_REAP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Message:
    """One framed message: a kind, a JSON header and raw bytes (pixels)."""

    kind: bytes
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""


class Overrun(Exception):
    """The worker sent nothing within the time it was given; it has been killed."""


class WorkerDied(Exception):
    """The worker ended in the middle of a request."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode
        self.signal_name: str | None = None
        if returncode is not None and returncode < 0:
            try:
                self.signal_name = signal.Signals(-returncode).name
            except ValueError:
                self.signal_name = f"signal {-returncode}"
        super().__init__(self.signal_name or f"exit status {returncode}")


class StartFailed(Exception):
    """A new worker could not be started, or wasn't ready in time."""


class RemoteError(Exception):
    """An exception raised in the worker: its type's name and message (the traceback stays there)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
        self.message = message


def send(out: BinaryIO, message: Message) -> None:
    header = json.dumps(message.header).encode() if message.header else b""
    out.write(_FRAME.pack(message.kind, len(header), len(message.payload)))
    out.write(header)
    out.write(message.payload)
    out.flush()


def serve(handle: Callable[[dict[str, Any], Callable[[Message], None]], None]) -> None:
    """The worker's loop: one JSON request per line on stdin, answered by the messages ``handle``
    sends, then ``DONE`` (or ``ERROR`` with the exception's type and message). Ends at end of input."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    # Anything else written to stdout (a C library, a stray print) would corrupt the messages.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(message: Message) -> None:
        send(out, message)

    try:
        reply(Message(READY))
        for line in sys.stdin.buffer:
            request = json.loads(line)
            try:
                handle(request, reply)
            except BrokenPipeError:
                raise
            except Exception as exc:
                cause = exc.__cause__ or exc.__context__
                header: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
                if cause is not None:
                    header["cause"] = {"type": type(cause).__name__, "message": str(cause)}
                reply(Message(ERROR, header))
            else:
                reply(Message(DONE))
    except BrokenPipeError:
        return  # the parent is gone, or stopped reading: nobody wants the rest


class Worker:
    """One worker process, started with ``entry`` (Python code that calls ``serve``)."""

    def __init__(self, entry: str, start_timeout_s: float, niceness: int = 0) -> None:
        """Start the worker and wait until it is ready. ``niceness``: added to its nice value, so the
        work it does yields the CPU to the processes that answer requests (the API, the broker).

        Raises:
            StartFailed: it could not be started, ended while starting, or wasn't ready within
                ``start_timeout_s``.
        """
        # The worker imports what this process imports, from the same places.
        code = f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; {entry}"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
        except OSError as exc:
            raise StartFailed(f"can't start {sys.executable}: {exc}") from exc
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        # poll, not select: a consumer process may hold more than select's 1024 descriptors.
        self._readable = select.poll()
        self._readable.register(self._stdout.fileno(), select.POLLIN)
        self.pid = self._proc.pid
        if niceness > 0:
            with suppress(OSError):  # the process may already have ended: reading READY says so
                os.setpriority(os.PRIO_PROCESS, self.pid, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
        self.requests = 0
        #: Between a request and its DONE or ERROR.
        self.busy = False
        try:
            ready = self.receive(start_timeout_s)
        except Overrun as exc:
            raise StartFailed(f"not ready within {start_timeout_s:g}s") from exc
        except WorkerDied as exc:
            raise StartFailed(f"ended while starting ({exc})") from exc
        except BaseException:
            self.kill()
            raise
        if ready.kind != READY:
            self.kill()
            raise StartFailed(f"sent {ready.kind!r} instead of being ready")

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def request(self, body: dict[str, Any]) -> None:
        """Send one request; its answer is read with ``receive``.

        Raises:
            WorkerDied: the worker is gone.
        """
        self.busy = True
        self.requests += 1
        try:
            self._stdin.write(json.dumps(body).encode() + b"\n")
        except (BrokenPipeError, ValueError) as exc:
            raise self._died() from exc

    def receive(self, timeout_s: float) -> Message:
        """The next message, waiting at most ``timeout_s`` for it (the worker is killed if it doesn't come).

        Raises:
            Overrun: nothing within ``timeout_s``; the worker is killed.
            WorkerDied: the worker ended before a whole message came.
        """
        deadline = time.monotonic() + timeout_s
        kind, header_len, payload_len = _FRAME.unpack(self._read(_FRAME.size, deadline))
        header = json.loads(self._read(header_len, deadline)) if header_len else {}
        payload = self._read(payload_len, deadline) if payload_len else bytearray()
        if kind in (DONE, ERROR):
            self.busy = False
        return Message(kind, header, payload)

    def _read(self, size: int, deadline: float) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        fd = self._stdout.fileno()
        while got < size:
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._readable.poll(left_ms):
                self.kill()
                raise Overrun()
            n = os.readv(fd, [view[got:]])
            if not n:
                raise self._died()
            got += n
        return buffer

    def _died(self) -> WorkerDied:
        self.kill()
        return WorkerDied(self._proc.returncode)

    def kill(self) -> None:
        """End the worker now (SIGKILL) and reap it."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def close(self) -> None:
        """End an idle worker: its input ends, it leaves its loop (killed if it doesn't)."""
        try:
            self._stdin.close()
            self._proc.wait(_REAP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        self._reap()

    def _reap(self) -> None:
        try:
            self._proc.wait(_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return  # stuck in the kernel (a dead mount); nothing more can be done from here
        for pipe in (self._stdin, self._stdout):
            with suppress(OSError):
                pipe.close()


class WorkerPool:
    """Idle workers kept for reuse; a worker that didn't finish its request cleanly is never reused."""

    def __init__(
        self, entry: str, *, max_idle: int, start_timeout_s: float, requests_per_worker: int, niceness: int = 0
    ) -> None:
        self._entry = entry
        self._niceness = niceness
        self._max_idle = max_idle
        self._start_timeout_s = start_timeout_s
        self._requests_per_worker = requests_per_worker
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @contextmanager
    def lease(self) -> Iterator[Worker]:
        """A worker for one request: an idle one, or a new one (see ``Worker`` for what starting raises).
        It goes back to the pool only if its request ended with DONE or ERROR; otherwise it is killed."""
        worker = self._take() or Worker(self._entry, self._start_timeout_s, self._niceness)
        try:
            yield worker
        finally:
            self._give_back(worker)

    def prestart(self, count: int) -> int:
        """Start workers until ``count`` are idle (at most ``max_idle``), so that the first requests of a
        new process don't each pay for a start (an interpreter importing PyAV: 0.3-0.7 s of CPU). Returns
        how many it started.

        Raises:
            StartFailed: as ``Worker``.
        """
        want, started = min(count, self._max_idle), 0
        while started < want:
            with self._lock:
                self._forget_if_forked()
                if sum(1 for w in self._idle if w.alive) >= want:
                    return started
            worker = Worker(self._entry, self._start_timeout_s, self._niceness)
            started += 1
            with self._lock:
                if len(self._idle) < self._max_idle:
                    self._idle.append(worker)
                    continue
            worker.close()  # a request handed back enough workers meanwhile
            return started
        return started

    def _forget_if_forked(self) -> None:
        if self._pid != os.getpid():
            # A forked copy of this process: the workers belong to the parent.
            self._idle, self._pid = [], os.getpid()

    def _take(self) -> Worker | None:
        with self._lock:
            self._forget_if_forked()
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                worker.kill()
        return None

    def _give_back(self, worker: Worker) -> None:
        if worker.busy or not worker.alive:
            worker.kill()
            return
        with self._lock:
            if len(self._idle) < self._max_idle and worker.requests < self._requests_per_worker:
                self._idle.append(worker)
                return
        worker.close()

    def close(self) -> None:
        """End every idle worker."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()
