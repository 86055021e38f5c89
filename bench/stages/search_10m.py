"""``python -m bench.stages.search_10m``: search latency, recall@10 and memory at 10M frames (768-d); part of
``python -m bench --full`` (~25 minutes and ~36 GiB of disk on 2 cores).

Same synthetic frames as ``bench.stages.search`` (videos of shots of near-duplicate frames), streamed: 10M
768-d float32 vectors are ~31 GB, more than this machine's memory, so they are generated, written and
scored against the queries one chunk at a time (the exact top-10 of every query is kept as it goes). The
index is built by the product's ``IndexMaintainer`` (IVF_SQ by default) with ``rows_per_partition``
from the command line (the default is 8192 here: the product's 4096 gives twice the partitions and
roughly four times the k-means work, about an hour on 2 cores). The index files are read once before the
queries (a search server keeps its index warm), then the queries run in a fresh process, whose peak
resident memory is the memory figure of a searcher at 10M. The table goes under ``TMPDIR`` (or
``--keep DIR``), which needs ~40 GiB free; the run stops at once where it isn't.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from bench.common import percentile, save_section
from bench.stages.search import DIM, FRAMES_PER_VIDEO, LIMIT, Corpus, K, batches, measure, recall
from pipeline.upkeep.maintenance import IndexMaintainer
from storage.config import IndexSettings, S3Settings
from storage.frames import FRAMES, frames_schema
from storage.tables import IndexStore

ROWS = 10_000_000
CHUNK_ROWS = 500_000
QUERIES = 200
#: Other (nprobes, refine_factor) tried on the same index (every other query each), beside the defaults.
SWEEP = ((3, 5), (5, 5), (5, None), (10, None), (20, 5))
#: Longest the query process may take (200 queries and the sweep take seconds when the index is warm).
QUERY_TIMEOUT_S = 1200.0
GIB = 1024**3
#: Disk per frame: the float32 vector and its row (~3.1 KB), the int8 codes (~0.8 KB), and some room.
BYTES_PER_ROW = 4_200


def write_and_score(root: Path, corpus: Corpus, queries: NDArray[np.float32], rows: int) -> list[set[int]]:
    """Write ``rows`` frames chunk by chunk and return each query's exact top-K row numbers."""
    table = lancedb.connect(str(root)).create_table(FRAMES, schema=frames_schema(DIM))
    best_scores = np.full((len(queries), K), -np.inf, dtype=np.float32)
    best_rows = np.zeros((len(queries), K), dtype=np.int64)
    for start in range(0, rows, CHUNK_ROWS):
        chunk = corpus.frames(min(CHUNK_ROWS, rows - start))
        table.add(pa.RecordBatchReader.from_batches(frames_schema(DIM), batches(chunk, start)))
        scores = queries @ chunk.T
        top = np.argpartition(-scores, K, axis=1)[:, :K]
        merged_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
        merged_rows = np.concatenate([best_rows, top + start], axis=1)
        keep = np.argpartition(-merged_scores, K, axis=1)[:, :K]
        best_scores = np.take_along_axis(merged_scores, keep, axis=1)
        best_rows = np.take_along_axis(merged_rows, keep, axis=1)
        if start // CHUNK_ROWS % 4 == 0:
            print(f"written {start + len(chunk):,} of {rows:,} rows", flush=True)
    return [set(map(int, row)) for row in best_rows]


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _warm(path: Path) -> None:
    """Read every file under ``path`` once (into the page cache)."""
    for f in path.rglob("*"):
        if f.is_file():
            with f.open("rb") as src:
                while src.read(1 << 24):
                    pass


def _max_rss_bytes() -> int:
    """This process's peak resident memory (``ru_maxrss``; Linux: KiB). A spawned child inherits its
    parent's figure through fork and exec, so the search process reads ``_hwm_bytes`` instead."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm_bytes() -> int:
    """Peak resident memory of this process's own address space (``VmHWM``: starts afresh at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def search_process(
    root: str, tuning: IndexSettings, queries: NDArray[np.float32], sweep: tuple[tuple[int, int | None], ...]
) -> dict[str, Any]:
    """In a fresh process: the product's search over the built table. A first pass over the first half of
    the queries (timed on its own: a searcher just started), then the measured pass over the other half,
    then the sweep (every other query of the measured pass again); peak memory."""
    before = _hwm_bytes()
    store = IndexStore(S3Settings(), uri=root)
    half = len(queries) // 2
    first_ms, _ = measure(store, tuning, queries[:half], exact=False)
    ms, found = measure(store, tuning, queries[half:], exact=False)
    variants = {}
    for nprobes, refine in sweep:
        variant = tuning.model_copy(update={"nprobes": nprobes, "refine_factor": refine})
        variants[(nprobes, refine)] = measure(store, variant, queries[half::2], exact=False)
    return {
        "first_ms": first_ms,
        "ms": ms,
        "found": found,
        "variants": variants,
        "rss_before": before,
        "rss_peak": _hwm_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.search_10m", description=__doc__)
    parser.add_argument("--full", action="store_true", help="accepted (python -m bench --full passes it)")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"frames in the table (default {ROWS:,})")
    parser.add_argument("--rows-per-partition", type=int, default=8192, help="IVF partition size (default 8192)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--keep", type=Path, help="build the table in this new (or empty) directory and keep it")
    where.add_argument("--reuse", type=Path, help="measure a table an earlier --keep built (no write, no build)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    if args.reuse:
        root = args.reuse
        built = json.loads((root / "built.json").read_text())
    else:
        if args.rows < IndexSettings().ann_min_rows:  # below it there is no index to measure
            parser.error(f"--rows must be at least {IndexSettings().ann_min_rows:,}")
        root = args.keep or Path(tempfile.mkdtemp(prefix="vidx-bench-search10m-"))
        root.mkdir(parents=True, exist_ok=root.exists() and not any(root.iterdir()))
        need = args.rows * BYTES_PER_ROW
        if shutil.disk_usage(root).free < need:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
            sys.exit(f"{root}: {need / GIB:.0f} GiB of free disk needed (TMPDIR or --keep chooses where)")
        built = {"rows": args.rows, "rows_per_partition": args.rows_per_partition}
    label = "10m" if built["rows"] == ROWS else f"{built['rows'] // 1000}k"
    tuning = IndexSettings().model_copy(update={"rows_per_partition": built["rows_per_partition"]})
    try:
        if not args.reuse:
            corpus = Corpus(args.rows // FRAMES_PER_VIDEO, seed=1)
            queries = corpus.frames(QUERIES)
            truth = write_and_score(root, corpus, queries, args.rows)
            del corpus
            built["write_and_exact_s"] = round(time.monotonic() - started, 1)
            round_ = IndexMaintainer(IndexStore(S3Settings(), uri=str(root)), tuning).run_once()
            print(f"index: {round_.action.value} in {round_.took_s:.0f}s", flush=True)
            built["index_build_s"] = round(round_.took_s, 1)
            built["build_process_peak_rss_gib"] = round(_max_rss_bytes() / GIB, 2)
            np.save(root / "queries.npy", queries)
            np.save(root / "truth.npy", np.array([sorted(t) for t in truth], dtype=np.int64))
            (root / "built.json").write_text(json.dumps(built))
        else:
            queries = np.load(root / "queries.npy")
            truth = [set(map(int, row)) for row in np.load(root / "truth.npy")]
        table_dir = root / f"{FRAMES}.lance"
        index_bytes, data_bytes = _bytes_under(table_dir / "_indices"), _bytes_under(table_dir / "data")
        warm_started = time.monotonic()
        _warm(table_dir / "_indices")
        warm_s = time.monotonic() - warm_started
        # A pool's exit terminates its process, so a search that overruns the timeout ends with it.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            got = pool.apply_async(search_process, (str(root), tuning, queries, SWEEP)).get(QUERY_TIMEOUT_S)
    finally:
        if not (args.keep or args.reuse):
            shutil.rmtree(root, ignore_errors=True)
    partitions = max(1, built["rows"] // built["rows_per_partition"])
    half = len(queries) // 2  # the first pass's queries; the measured pass has the rest
    metrics: dict[str, Any] = {
        f"search_p50_ms_{label}": round(percentile(got["ms"], 50), 2),
        f"search_p99_ms_{label}": round(percentile(got["ms"], 99), 2),
        f"search_recall10_{label}": round(recall(got["found"], truth[half:]), 4),
        f"search_first_pass_p50_ms_{label}": round(percentile(got["first_ms"], 50), 2),
        f"search_first_pass_p99_ms_{label}": round(percentile(got["first_ms"], 99), 2),
        f"search_index_build_s_{label}": built["index_build_s"],
        f"search_index_gib_{label}": round(index_bytes / GIB, 2),
        f"search_data_gib_{label}": round(data_bytes / GIB, 2),
        f"search_process_peak_rss_gib_{label}": round(got["rss_peak"] / GIB, 2),
        f"search_process_rss_before_gib_{label}": round(got["rss_before"] / GIB, 2),
        f"search_build_process_peak_rss_gib_{label}": built["build_process_peak_rss_gib"],
        f"search_partitions_{label}": partitions,
        "write_and_exact_s": built["write_and_exact_s"],
        "index_warm_s": round(warm_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    for (nprobes, refine), (v_ms, v_found) in got["variants"].items():
        name = f"np{nprobes}_rf{refine or 0}"
        metrics[f"search_sweep_{name}_p50_ms_{label}"] = round(percentile(v_ms, 50), 2)
        metrics[f"search_sweep_{name}_recall10_{label}"] = round(recall(v_found, truth[half::2]), 4)
    notes = [
        f"{built['rows']:,} synthetic {DIM}-d frames as in bench.stages.search ({built['rows'] // FRAMES_PER_VIDEO:,} "
        f"videos), generated, written and scored in chunks of {CHUNK_ROWS:,}; exact top-{K} kept per query as "
        "they go. Local-directory LanceDB.",
        f"Index: {tuning.index_type}, cosine, {partitions:,} partitions (rows_per_partition "
        f"{built['rows_per_partition']}), built by IndexMaintainer; queries: nprobes={tuning.nprobes}, "
        f"refine_factor={tuning.refine_factor}, limit={LIMIT} rows (what /v1/search?k={K} asks the table; recall@{K} "
        f"on the top {K}), {len(queries)} distinct queries, search_consistency_s 0.",
        "The index files were read once before the queries (page cache). The queries ran in a fresh process: "
        f"first_pass is its first {half} queries (a searcher just started: index partitions not yet in its cache, "
        f"vectors for the refine read from disk; none runs untimed before), then the measured pass over the other "
        f"{len(queries) - half}. "
        "process_peak_rss is that process's peak resident memory, rss_before what it held before opening the "
        "table. The vectors stay on disk (data_gib): the refine reads refine_factor x limit of them per query.",
        f"search_sweep_npN_rfR: nprobes N, refine_factor R (0: none) on the same index over every other query "
        f"of the measured pass, asked again after it. No exact-scan latency at this size (a scan reads "
        f"{data_bytes / GIB:.0f} GiB).",
    ]
    if label == "10m":
        save_section("search_10m", metrics, notes)
    for key, value in metrics.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
