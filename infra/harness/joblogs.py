"""Jobs' outcomes read from the index consumers' own log files, for benchmarks that must see a video
indexed without asking the app: a status poll is a request through the proxy and the Api and a
catalog read in MinIO, which a CPU budget would charge to the product. The consumers write one JSON
line per job whatever a benchmark does (``pipeline.index.joblog``, after the job's catalog commit), so
reading those files costs the app nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

#: Outcomes that end an index job's video as the benchmark wants it (an identical copy is indexed too).
DONE = frozenset({"indexed", "unchanged"})
#: The replicas whose logs carry index jobs' lines.
INDEX_LOGS = "replica_*IndexConsumer*.log"


def serve_log_dir() -> Path:
    """The Serve log folder of the Ray instance this process is connected to (not ``session_latest``,
    which may be another instance's on a shared machine)."""
    import ray._private.worker

    node = ray._private.worker._global_node
    if node is None:
        raise RuntimeError("not connected to a Ray instance started by this process")
    return Path(node.get_logs_dir_path()) / "serve"


class JobLogWatch:
    """Reads the new lines of every index replica's log file on each ``poll`` (files of replicas that
    start later included) and keeps each video's latest outcome."""

    def __init__(self, log_dir: Path, pattern: str = INDEX_LOGS) -> None:
        self._dir = log_dir
        self._pattern = pattern
        self._offsets: dict[Path, int] = {}
        self.outcomes: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def skip_existing(self) -> JobLogWatch:
        """Start after what the files hold now: earlier jobs' lines are not this watch's."""
        for path in self._dir.glob(self._pattern):
            self._offsets[path] = path.stat().st_size
        return self

    def poll(self) -> None:
        for path in sorted(self._dir.glob(self._pattern)):
            start = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = start + end
            self._read(data[:end].decode(errors="replace").splitlines())

    def _read(self, lines: Iterable[str]) -> None:
        for line in lines:
            if '"outcome"' not in line:  # not a job's last line: no need to parse it
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            vid, outcome = record.get("video_id"), record.get("outcome")
            if isinstance(vid, str) and isinstance(outcome, str):
                self.outcomes[vid] = outcome
                if outcome == "failed":
                    self.errors[vid] = str(record.get("message", ""))

    def wait(self, ids: list[str], timeout_s: float, poll_s: float = 0.05) -> float:
        """Wait until every video in ``ids`` is done; the monotonic time the last one was seen.

        Raises:
            TimeoutError: past ``timeout_s``. RuntimeError: a video failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            failed = [vid for vid in ids if self.outcomes.get(vid) == "failed"]
            if failed:
                raise RuntimeError(f"{failed[0]} failed: {self.errors.get(failed[0], '')[:300]}")
            missing = [vid for vid in ids if self.outcomes.get(vid) not in DONE]
            if not missing:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} of {len(ids)} videos not indexed after {timeout_s:.0f}s")
            time.sleep(poll_s)
