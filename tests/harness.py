"""The in-process harness of the integration tier: real MinIO and RabbitMQ containers, the real
EventRouter on a thread, the real Indexer with the tiny SigLIP checkpoint. Jobs the router submits are
collected and run by the test one by one, so each step can be checked; the Ray Serve app with the
Celery task queue in between is covered by the e2e tier."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest

from events.jobs import IndexJob
from events.router import EventRouter
from infra.harness.services import Services, eventually, unique_prefix
from pipeline.embedding.siglip import SiglipEncoder
from pipeline.index.indexer import Indexer, JobResult
from pipeline.settings import Settings
from storage.tables import IndexStore

WAIT_S = 30.0


class QueueSink:
    """Collects the jobs the router submits, so the test runs them one by one."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[IndexJob] = queue.Queue()

    def submit(self, job: IndexJob) -> str:
        self.jobs.put(job)
        return f"local-{self.jobs.qsize()}"

    def take(self, n: int) -> list[IndexJob]:
        deadline = time.monotonic() + WAIT_S
        out: list[IndexJob] = []
        while len(out) < n:
            try:
                out.append(self.jobs.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"{len(out)} of {n} jobs arrived within {WAIT_S}s") from None
        return out


@dataclass
class Stack:
    settings: Settings
    services: Services
    sink: QueueSink
    router: EventRouter
    indexer: Indexer
    store: IndexStore
    encoder: SiglipEncoder

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    def upload(self, key: str, path: Path, content_type: str = "video/mp4") -> None:
        self.services.minio_client().fput_object(self.bucket, key, str(path), content_type=content_type)

    def run(self, job: IndexJob) -> JobResult:
        return self.indexer.run(job)


@contextmanager
def running_stack(services: Services, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """Buckets and queues of a fresh prefix, the settings in the environment, the router running."""
    prefix = unique_prefix()
    services.prepare_buckets(prefix)
    for key, value in services.env(prefix).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VIDX_MODEL__ID", str(tiny_model_dir))
    settings = Settings()
    store = IndexStore(settings.s3)
    sink = QueueSink()
    router = EventRouter(settings.amqp, settings.videos, sink, settings.s3.buckets)
    stop = threading.Event()
    thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
    thread.start()
    encoder = SiglipEncoder(settings.model)
    eventually(lambda: router.connected, "the router to connect", WAIT_S)
    yield Stack(settings, services, sink, router, Indexer(settings, encoder, store), store, encoder)
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def report_lines(config: pytest.Config, lines: list[str]) -> None:
    """Write summary lines to the terminal report, also under ``-q`` and without ``-s`` (pytest
    captures file descriptor 1 during a test, the reporter's own output included: step around it)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        for line in lines:
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(line)
            else:
                print(line)
