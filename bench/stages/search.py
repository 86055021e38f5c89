"""``python -m bench.stages.search [--full]``: search latency and recall@10 at 100k and 1M frames (768-d), ANN
index vs exact scan, index build time, and queries/s through the HTTP API.

Data: synthetic frames shaped like video embeddings, not uniform noise (on which ANN means nothing):
one centre per "video" (500 frames each), 10 "shots" per video (centre + 0.6·N(0, 1) per dimension),
each frame a shot plus uniform noise of std 0.3, L2-normalised: tight groups of near-duplicate frames
inside looser videos. Queries are fresh frames of random shots. Ground truth is an exact numpy top-10.

The table lives in a local directory (the product's ``IndexStore`` with ``uri=``): 3 GB through a
MinIO container on a busy 2-core machine would measure the container, and LanceDB reads straight from
object storage are documented at hundreds of ms per query. The product's ``IndexMaintainer`` builds the
index exactly as in production (created at 100k rows, rebuilt when the table has grown to 1M).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import lancedb
import numpy as np
import pyarrow as pa
import uvicorn
from numpy.typing import NDArray

from bench.common import percentile, save_section
from events.jobs import IndexJob
from pipeline.api.app import create_app
from pipeline.query.search import SearchService
from pipeline.settings import LimitSettings, Settings
from pipeline.upkeep.maintenance import IndexMaintainer
from storage.config import IndexSettings
from storage.frames import FRAMES, frames_schema
from storage.tables import IndexStore

DIM = 768
FRAMES_PER_VIDEO = 500
SHOTS_PER_VIDEO = 10
BATCH_ROWS = 50_000
K = 10


class Corpus:
    """The generator of frames and queries (seeded: every run measures the same data)."""

    def __init__(self, videos: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        centres = rng.standard_normal((videos, DIM), dtype=np.float32)
        shots = np.repeat(centres, SHOTS_PER_VIDEO, axis=0)
        self.shots = shots + 0.6 * rng.standard_normal(shots.shape, dtype=np.float32)
        self._rng = rng

    def frames(self, n: int) -> NDArray[np.float32]:
        shot = self._rng.integers(0, len(self.shots), n)
        # Uniform noise of std 0.3 (half-width 0.3·√3): as good as Gaussian here, several times cheaper to draw.
        noise = self._rng.random((n, DIM), dtype=np.float32)
        noise -= 0.5
        noise *= 2 * 0.3 * np.sqrt(3, dtype=np.float32)
        vectors = self.shots[shot] + noise
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors


def batches(vectors: NDArray[np.float32], first_id: int) -> Iterator[pa.RecordBatch]:
    schema = frames_schema(DIM)
    for start in range(0, len(vectors), BATCH_ROWS):
        chunk = vectors[start : start + BATCH_ROWS]
        n, ids = len(chunk), range(first_id + start, first_id + start + len(chunk))
        video = [f"v{i // FRAMES_PER_VIDEO:07d}" for i in ids]
        yield pa.RecordBatch.from_arrays(
            [
                pa.array([f"f{i:08d}" for i in ids], pa.string()),
                pa.array(video, pa.string()),
                pa.array([f"s3://videos/{v}.mp4" for v in video], pa.string()),
                pa.array(["1"] * n, pa.string()),
                pa.array(["fp"] * n, pa.string()),
                pa.array([float(i % FRAMES_PER_VIDEO) for i in ids], pa.float64()),
                pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1), pa.float32()), DIM),
                pa.nulls(n, pa.binary()),
                pa.array(["bench"] * n, pa.string()),
            ],
            schema=schema,
        )


def exact_top_k(data: NDArray[np.float32], queries: NDArray[np.float32]) -> list[set[int]]:
    scores = queries @ data.T
    top = np.argpartition(-scores, K, axis=1)[:, :K]
    return [set(map(int, row)) for row in top]


def measure(
    store: IndexStore, tuning: IndexSettings, queries: NDArray[np.float32], *, exact: bool
) -> tuple[list[float], list[set[int]]]:
    """Latency (ms) and the returned row numbers of each query; two unmeasured queries warm the handle."""
    for q in queries[:2]:
        store.frames.search(q, K, tuning, exact=exact)
    latencies, found = [], []
    for q in queries:
        started = time.perf_counter()
        rows = store.frames.search(q, K, tuning, exact=exact)
        latencies.append((time.perf_counter() - started) * 1000)
        found.append({int(r["frame_id"][1:]) for r in rows})
    return latencies, found


def recall(found: list[set[int]], truth: list[set[int]]) -> float:
    return sum(len(f & t) for f, t in zip(found, truth, strict=True)) / (K * len(truth))


def scale(
    label: str,
    store: IndexStore,
    maintainer: IndexMaintainer,
    tuning: IndexSettings,
    data: NDArray[np.float32],
    queries: NDArray[np.float32],
    flat_queries: int,
    sweep: tuple[IndexSettings, ...] = (),
) -> dict[str, Any]:
    round_ = maintainer.run_once()
    truth = exact_top_k(data, queries)
    ann_ms, ann_found = measure(store, tuning, queries, exact=False)
    flat_ms, flat_found = measure(store, tuning, queries[:flat_queries], exact=True)
    ann_p50, flat_p50 = percentile(ann_ms, 50), percentile(flat_ms, 50)
    metrics = {
        f"search_index_build_s_{label}": round(round_.took_s, 1),
        f"search_p50_ms_{label}": round(ann_p50, 2),
        f"search_p99_ms_{label}": round(percentile(ann_ms, 99), 2),
        f"search_recall10_{label}": round(recall(ann_found, truth), 4),
        f"search_flat_p50_ms_{label}": round(flat_p50, 1),
        f"search_flat_p99_ms_{label}": round(percentile(flat_ms, 99), 1),
        f"search_flat_recall10_{label}": round(recall(flat_found, truth[:flat_queries]), 4),
        f"search_speedup_vs_flat_{label}": round(flat_p50 / ann_p50, 1),
    }
    # Other query settings on the same index (half the queries each): how latency trades against recall,
    # and what the old 1 s re-check interval saves against a manifest check per search (the default).
    for variant in sweep:
        name = f"np{variant.nprobes}_rf{variant.refine_factor or 0}_rc{variant.search_consistency_s:g}"
        ms, variant_found = measure(store, variant, queries[::2], exact=False)
        metrics[f"search_sweep_{name}_p50_ms_{label}"] = round(percentile(ms, 50), 2)
        metrics[f"search_sweep_{name}_recall10_{label}"] = round(recall(variant_found, truth[::2]), 4)
    print(f"{label}: {round_.action.value} in {round_.took_s:.1f}s; {metrics}", flush=True)
    return metrics


class StubEncoder:
    """Query 'text' is the index of a prepared query vector: the API does everything but run SigLIP."""

    def __init__(self, queries: NDArray[np.float32]) -> None:
        self._queries = queries

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        return self._queries[int(text) % len(self._queries)]

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        return self._queries[0]


class NoJobs:
    def submit(self, job: IndexJob) -> str:
        raise NotImplementedError


async def _no_stats() -> dict[str, Any]:
    return {}


def api_qps(store: IndexStore, settings: Settings, queries: NDArray[np.float32], seconds: float, clients: int) -> float:
    """Searches/s through ``/v1/search`` (k=10, so 200 candidate frames) under uvicorn on loopback."""
    app = create_app(settings, SearchService(settings, store, StubEncoder(queries)), store, NoJobs(), _no_stats)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started_by = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > started_by or not thread.is_alive():
            raise RuntimeError("the API server did not start within 30 s")
        time.sleep(0.05)

    async def drive() -> int:
        done = 0
        deadline = time.monotonic() + seconds

        async def client(n: int) -> None:
            nonlocal done
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                i = n
                while time.monotonic() < deadline:
                    response = await http.get("/v1/search", params={"q": str(i), "k": K})
                    response.raise_for_status()
                    done += 1
                    i += clients

        await asyncio.gather(*(client(n) for n in range(clients)))
        return done

    started = time.monotonic()
    done = asyncio.run(drive())
    elapsed = time.monotonic() - started
    server.should_exit = True
    thread.join(10)
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.search", description=__doc__)
    parser.add_argument("--full", action="store_true", help="exact-scan latency over all 200 queries at 1M")
    parser.add_argument("--small", action="store_true", help="10k/100k instead of 100k/1M (a quick look)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    small_n, big_n = (10_000, 100_000) if args.small else (100_000, 1_000_000)
    small_label, big_label = ("10k", "100k") if args.small else ("100k", "1m")
    n_queries = 200
    flat_small, flat_big = (200, 200) if args.full else (50, 5)
    api_seconds, api_clients = 15.0, 8
    tuning = IndexSettings()  # the defaults the app searches with
    # The API figure measures searches/s, not the per-caller rate limit (every client is one address).
    settings = Settings(index=tuning, limits=LimitSettings(search_rate_per_s=0))
    started = time.monotonic()
    corpus = Corpus(big_n // FRAMES_PER_VIDEO)
    queries = corpus.frames(n_queries)
    root = Path(tempfile.mkdtemp(prefix="vidx-bench-search-"))
    try:
        table = lancedb.connect(str(root)).create_table(FRAMES, schema=frames_schema(DIM))
        store = IndexStore(settings.s3, uri=str(root))
        # The threshold sits at the smaller scale: the first round creates the index, the second rebuilds it.
        maintainer = IndexMaintainer(store, tuning.model_copy(update={"ann_min_rows": small_n}))
        data = corpus.frames(big_n)
        with_load = time.monotonic()
        table.add(pa.RecordBatchReader.from_batches(frames_schema(DIM), batches(data[:small_n], 0)))
        small = scale(small_label, store, maintainer, tuning, data[:small_n], queries, flat_small)
        table.add(pa.RecordBatchReader.from_batches(frames_schema(DIM), batches(data[small_n:], small_n)))
        load_s = time.monotonic() - with_load
        sweep = tuple(
            tuning.model_copy(update=u)
            for u in (
                {"nprobes": 5},
                {"nprobes": 20},
                {"nprobes": 10, "refine_factor": None},
                {"nprobes": 40},
                {"search_consistency_s": 1.0},
            )
        )
        big = scale(big_label, store, maintainer, tuning, data, queries, flat_big, sweep)
        del data
        qps = api_qps(store, settings, queries, api_seconds, api_clients)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    metrics: dict[str, Any] = {
        **small,
        **big,
        f"search_api_qps_{big_label}": round(qps, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    notes = [
        f"{big_n:,} synthetic {DIM}-d frames: {big_n // FRAMES_PER_VIDEO} videos x {SHOTS_PER_VIDEO} shots, "
        "frames = shot + noise, L2-normalised; queries are fresh frames. Local-directory LanceDB.",
        f"Index: {tuning.index_type}, cosine, {tuning.rows_per_partition} rows per IVF partition; queries use "
        f"nprobes={tuning.nprobes}, refine_factor={tuning.refine_factor}, k={K}; search_consistency_s "
        f"{tuning.search_consistency_s:g} (0: each search sees every commit before it). Built by "
        f"IndexMaintainer (created at {small_n:,} rows, "
        f"rebuilt at {big_n:,}).",
        f"ANN latency over {n_queries} queries; exact scan over the first {flat_small} (small scale) and "
        f"{flat_big} (1M) queries (--full: 200 each). Recall@10 against a numpy exact top-10.",
        "search_sweep_npN_rfR_rcC: the 1M index queried with nprobes N, refine_factor R (0: none) and the handle "
        "re-checking the table version every C s (0: a check shared by the searches waiting at that moment, "
        "before they run), over every other query.",
        f"API: {api_clients} concurrent httpx clients for {api_seconds:g} s on /v1/search?k={K} (200 candidate "
        "frames, moment merge, presigned links), uvicorn on loopback, stub query encoder.",
        f"Load {load_s:.0f}s (rows written + first index + measurements at the small scale).",
    ]
    if not args.small:  # a quick look never stands in for the 1M figures
        save_section("search", metrics, notes)
    for key, value in metrics.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
