"""What every benchmark shares: the machine's description, timing helpers, and the results file.

Each benchmark writes its own section of ``bench/results/latest.json``:
``{"<name>": {"command", "finished_at", "metrics": {...}, "notes": [...]}}``; target values are plain
numbers inside ``metrics`` under the names ``bench/targets.py`` lists.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "latest.json"


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, GPU (if torch sees one), Python and key library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "gpu": gpu,
        "python": platform.python_version(),
        "os": platform.platform(terse=True),
    }


def load() -> dict[str, Any]:
    if RESULTS.exists():
        data: dict[str, Any] = json.loads(RESULTS.read_text())
        return data
    return {}


def _running_module(name: str) -> str:
    """The module ``python -m`` ran (``bench.stages.decode``), else ``bench.<name>``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else f"bench.{name}"


def save_section(name: str, metrics: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """Write one benchmark's results into latest.json (other sections are kept)."""
    data = load()
    data["machine"] = machine()
    section = {
        "command": " ".join(["python", "-m", _running_module(name), *sys.argv[1:]]),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
        "notes": notes or [],
    }
    data[name] = section
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return section


@contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    """``with stopwatch() as elapsed: ...; elapsed()`` — seconds since the block started."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return float(statistics.quantiles(sorted(values), n=100, method="inclusive")[max(0, min(98, round(q) - 1))])


def have_command(name: str) -> bool:
    try:
        subprocess.run([name, "-version"], capture_output=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return True


# -- what a batch of videos cost the stores -------------------------------------------------------------


def work_counts(host: Any, *, ending: bool = False) -> dict[str, Any]:
    """S3 requests MinIO has served (by API) and the catalog's version, now (``per_video`` takes two).
    The catalog read is itself S3 requests: made before the count, or after it when ``ending``, so
    none of the benchmark's own requests fall between two counts."""
    from infra.harness.services import s3_requests
    from storage.tables import IndexStore

    store = IndexStore(host.settings.s3)

    def catalog() -> int:
        return store.catalog.version()

    if ending:
        s3 = s3_requests(host.services.s3_endpoint)
        last = catalog()
        return {"s3": s3, "catalog": last, "store": store}
    version = catalog()
    return {"s3": s3_requests(host.services.s3_endpoint), "catalog": version}


#: Lance operations of the videos table that a job's write makes (a merge: ``Update``; an insert into a
#: new table: ``Append``); any other (``Rewrite``: compaction, ``CreateIndex``...) is upkeep's.
JOB_OPERATIONS = frozenset({"Update", "Append", "Delete", "Merge"})


def upkeep_commits(store: Any, first: int, last: int) -> int:
    """Versions of the catalog in ``(first, last]`` that no job's write made (compaction, index upkeep)."""
    from storage.catalog import VIDEOS

    table = store.db.open(VIDEOS)
    if table is None:
        return 0
    ds = table.to_lance()
    upkeep = 0
    for version in range(first + 1, last + 1):
        transaction = ds.read_transaction(version)
        operation = type(getattr(transaction, "operation", None)).__name__
        upkeep += operation not in JOB_OPERATIONS
    return upkeep


def per_video(before: dict[str, Any], after: dict[str, Any], videos: int) -> dict[str, Any]:
    """S3 requests and catalog commits per video between two ``work_counts`` (the second, ``ending``,
    taken once the batch's videos were done)."""
    by_api = {k: after["s3"][k] - before["s3"].get(k, 0.0) for k in after["s3"]}
    by_api = {k: round(v / videos, 2) for k, v in sorted(by_api.items(), key=lambda kv: -kv[1]) if v}
    upkeep = upkeep_commits(after["store"], before["catalog"], after["catalog"])
    return {
        "s3_requests_per_video": round(sum(by_api.values()), 2),
        "s3_requests_per_video_by_api": by_api,
        "catalog_commits_per_video": round((after["catalog"] - before["catalog"]) / videos, 3),
        "catalog_upkeep_commits_per_video": round(upkeep / videos, 3),
    }
