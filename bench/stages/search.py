"""``python -m bench.stages.search [--full]``: search latency and recall at 100k frames (768-d; ``--full``: also
1M), ANN index vs exact scan, index build time, and searches/s through the HTTP API, on LanceDB on MinIO.

The table lives where the product keeps it: an ``IndexStore`` over the index bucket of a MinIO container
started here (``infra.harness.services.start_services``); the product's ``IndexMaintainer`` builds the index
(created at 100k rows, rebuilt at 1M). Every search asks the API's row limit for its default ``k`` (``LIMIT``),
and every timed query is a distinct one: a first pass on a fresh connection (the table opened by the first
search) is reported apart from the passes after it; nothing runs untimed. Data: synthetic frames shaped like
video embeddings (videos of shots of near-duplicate frames, L2-normalised; see docs/benchmarks.md), queries
fresh frames; ground truth an exact numpy top-``LIMIT``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import uvicorn
from numpy.typing import NDArray

from bench.common import percentile, save_section
from events.jobs import IndexJob
from pipeline.api.app import create_app
from pipeline.query.search import CANDIDATES_PER_MOMENT, SearchService
from pipeline.query.words import MAX_CANDIDATES
from pipeline.settings import LimitSettings, Settings
from pipeline.upkeep.maintenance import IndexMaintainer
from storage.config import IndexSettings, S3Settings
from storage.frames import FRAMES, frames_schema
from storage.tables import IndexStore

DIM = 768
FRAMES_PER_VIDEO = 500
SHOTS_PER_VIDEO = 10
BATCH_ROWS = 50_000
#: ``GET /v1/search``'s default ``k`` (moments answered); recall@K is taken on the top K rows of a search.
K = 10
#: Rows the API asks of the frames table for ``k=K`` (``SearchService``'s candidate frames).
LIMIT = min(K * CANDIDATES_PER_MOMENT, MAX_CANDIDATES)
#: Distinct queries per pass: the first pass on a fresh connection, the pass after it, each sweep variant.
FIRST_PASS_QUERIES = 100
STEADY_QUERIES = 200
SWEEP_QUERIES = 100
#: Distinct queries the API clients may ask (they stop at the deadline or when these run out).
API_QUERIES = 2000
#: Queries scored against the whole table at once for the ground truth (bounds its memory).
TRUTH_CHUNK = 32


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


class QueryPool:
    """Queries handed out in order, each once: no query is timed twice."""

    def __init__(self, vectors: NDArray[np.float32]) -> None:
        self._vectors = vectors
        self._next = 0

    def take(self, n: int) -> NDArray[np.float32]:
        """The next ``n`` queries.

        Raises:
            ValueError: fewer than ``n`` are left.
        """
        if self._next + n > len(self._vectors):
            raise ValueError(f"{n} queries asked, {len(self._vectors) - self._next} left")
        taken = self._vectors[self._next : self._next + n]
        self._next += n
        return taken


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


def exact_truth(data: NDArray[np.float32], queries: NDArray[np.float32]) -> tuple[list[set[int]], list[set[int]]]:
    """Each query's exact top-K and top-LIMIT row numbers (dot product: every vector is unit length)."""
    top_k: list[set[int]] = []
    top_limit: list[set[int]] = []
    for start in range(0, len(queries), TRUTH_CHUNK):
        scores = queries[start : start + TRUTH_CHUNK] @ data.T
        top = np.argpartition(-scores, LIMIT, axis=1)[:, :LIMIT]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        for row in np.take_along_axis(top, order, axis=1):
            top_k.append(set(map(int, row[:K])))
            top_limit.append(set(map(int, row)))
    return top_k, top_limit


def measure(
    store: IndexStore, tuning: IndexSettings, queries: NDArray[np.float32], *, exact: bool, limit: int = LIMIT
) -> tuple[list[float], list[list[int]]]:
    """Latency (ms) of each query, every one timed (none runs untimed first), and the row numbers it
    returned, best first."""
    latencies, found = [], []
    for q in queries:
        started = time.perf_counter()
        rows = store.frames.search(q, limit, tuning, exact=exact)
        latencies.append((time.perf_counter() - started) * 1000)
        found.append([int(r["frame_id"][1:]) for r in rows])
    return latencies, found


def recall(found: list[list[int]], truth: list[set[int]], k: int = K) -> float:
    """Recall@k: the share of each query's exact top ``k`` (``truth``) among the first ``k`` rows it returned."""
    return sum(len(set(f[:k]) & t) for f, t in zip(found, truth, strict=True)) / (k * len(truth))


def scale(
    label: str,
    s3: S3Settings,
    maintainer: IndexMaintainer,
    tuning: IndexSettings,
    data: NDArray[np.float32],
    pool: QueryPool,
    flat_queries: int,
    sweep: tuple[IndexSettings, ...] = (),
) -> tuple[dict[str, Any], IndexStore]:
    """One size: the index round, then every pass on a new connection; the metrics and that store."""
    round_ = maintainer.run_once()
    first, steady, flat = pool.take(FIRST_PASS_QUERIES), pool.take(STEADY_QUERIES), pool.take(flat_queries)
    ann_truth, ann_truth_limit = exact_truth(data, np.concatenate([first, steady]))
    flat_truth, _ = exact_truth(data, flat)
    searcher = IndexStore(s3)  # a new connection: nothing of the table opened or cached yet
    first_ms, first_found = measure(searcher, tuning, first, exact=False)
    ann_ms, ann_found = measure(searcher, tuning, steady, exact=False)
    flat_ms, flat_found = measure(searcher, tuning, flat, exact=True)
    ann_p50, flat_p50 = percentile(ann_ms, 50), percentile(flat_ms, 50)
    every_ann = first_found + ann_found
    metrics = {
        f"search_index_build_s_{label}": round(round_.took_s, 1),
        f"search_first_query_ms_{label}": round(first_ms[0], 1),
        f"search_first_pass_p50_ms_{label}": round(percentile(first_ms, 50), 2),
        f"search_first_pass_p99_ms_{label}": round(percentile(first_ms, 99), 2),
        f"search_p50_ms_{label}": round(ann_p50, 2),
        f"search_p99_ms_{label}": round(percentile(ann_ms, 99), 2),
        f"search_recall10_{label}": round(recall(every_ann, ann_truth), 4),
        f"search_recall{LIMIT}_{label}": round(recall(every_ann, ann_truth_limit, LIMIT), 4),
        f"search_flat_p50_ms_{label}": round(flat_p50, 1),
        f"search_flat_p99_ms_{label}": round(percentile(flat_ms, 99), 1),
        f"search_flat_recall10_{label}": round(recall(flat_found, flat_truth), 4),
        f"search_speedup_vs_flat_{label}": round(flat_p50 / ann_p50, 1),
    }
    # Other query settings on the same index, each on queries of its own: how latency trades against
    # recall, and what a 1 s re-check interval saves against a manifest check per search (the default).
    for variant in sweep:
        name = f"np{variant.nprobes}_rf{variant.refine_factor or 0}_rc{variant.search_consistency_s:g}"
        queries = pool.take(SWEEP_QUERIES)
        ms, variant_found = measure(searcher, variant, queries, exact=False)
        variant_truth, _ = exact_truth(data, queries)
        metrics[f"search_sweep_{name}_p50_ms_{label}"] = round(percentile(ms, 50), 2)
        metrics[f"search_sweep_{name}_recall10_{label}"] = round(recall(variant_found, variant_truth), 4)
    print(f"{label}: {round_.action.value} in {round_.took_s:.1f}s; {metrics}", flush=True)
    return metrics, searcher


class StubEncoder:
    """Query 'text' is the index of a prepared query vector: the API does everything but run SigLIP."""

    def __init__(self, queries: NDArray[np.float32]) -> None:
        self._queries = queries

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        return self._queries[int(text)]

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        return self._queries[0]


class NoJobs:
    def submit(self, job: IndexJob) -> str:
        raise NotImplementedError


async def _no_stats() -> dict[str, Any]:
    return {}


def api_qps(
    store: IndexStore, settings: Settings, queries: NDArray[np.float32], seconds: float, clients: int
) -> tuple[float, int]:
    """Searches/s through ``/v1/search?k=K`` under uvicorn on loopback, each request a query not asked
    before, and how many were answered (the clients stop at ``seconds`` or when ``queries`` run out)."""
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
        asked = 0
        deadline = time.monotonic() + seconds

        async def client() -> None:
            nonlocal asked
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                while time.monotonic() < deadline and asked < len(queries):
                    i, asked = asked, asked + 1
                    response = await http.get("/v1/search", params={"q": str(i), "k": K})
                    response.raise_for_status()

        await asyncio.gather(*(client() for _ in range(clients)))
        return asked

    started = time.monotonic()
    done = asyncio.run(drive())
    elapsed = time.monotonic() - started
    server.should_exit = True
    thread.join(10)
    return done / elapsed, done


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.search", description=__doc__)
    parser.add_argument("--full", action="store_true", help="also 1M frames (the index rebuilt there)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from infra.harness.services import start_services, unique_prefix

    small_n, big_n = 100_000, 1_000_000 if args.full else None
    flat_small, flat_big = 20, 5
    api_seconds, api_clients = 15.0, 8
    tuning = IndexSettings()  # the defaults the app searches with
    started = time.monotonic()
    corpus = Corpus((big_n or small_n) // FRAMES_PER_VIDEO)
    sweep = (
        tuple(
            tuning.model_copy(update=u)
            for u in (
                {"nprobes": 5},
                {"nprobes": 20},
                {"nprobes": 10, "refine_factor": None},
                {"nprobes": 40},
                {"search_consistency_s": 1.0},
            )
        )
        if big_n
        else ()
    )
    wanted = 2 * (FIRST_PASS_QUERIES + STEADY_QUERIES) + flat_small + flat_big + len(sweep) * SWEEP_QUERIES
    pool = QueryPool(corpus.frames(wanted))
    api_queries = corpus.frames(API_QUERIES)
    data = corpus.frames(big_n or small_n)
    with start_services() as services:
        prefix = unique_prefix()
        services.prepare_buckets(prefix)  # the upload and index buckets, as the product sets them up
        s3 = services.s3_settings(f"{prefix}-index", [f"{prefix}-videos"])
        # The API figure measures searches/s, not the per-caller rate limit (every client is one address).
        settings = Settings(s3=s3, index=tuning, limits=LimitSettings(search_rate_per_s=0))
        writer = IndexStore(s3)
        table = writer.db.create(FRAMES, frames_schema(DIM))
        # The threshold sits at the smaller scale: the first round creates the index, the second rebuilds it.
        maintainer = IndexMaintainer(writer, tuning.model_copy(update={"ann_min_rows": small_n}))
        write_started = time.monotonic()
        table.add(pa.RecordBatchReader.from_batches(frames_schema(DIM), batches(data[:small_n], 0)))
        write_s = [time.monotonic() - write_started]
        metrics, searcher = scale("100k", s3, maintainer, tuning, data[:small_n], pool, flat_small)
        label = "100k"
        if big_n:
            write_started = time.monotonic()
            table.add(pa.RecordBatchReader.from_batches(frames_schema(DIM), batches(data[small_n:], small_n)))
            write_s.append(time.monotonic() - write_started)
            big, searcher = scale("1m", s3, maintainer, tuning, data, pool, flat_big, sweep)
            metrics |= big
            label = "1m"
        del data
        qps, api_done = api_qps(searcher, settings, api_queries, api_seconds, api_clients)
    metrics |= {
        f"search_api_qps_{label}": round(qps, 1),
        f"search_api_queries_{label}": api_done,
        "wall_s": round(time.monotonic() - started, 1),
    }
    rows = f"{big_n or small_n:,}"
    notes = [
        f"{rows} synthetic {DIM}-d frames: {(big_n or small_n) // FRAMES_PER_VIDEO} videos x {SHOTS_PER_VIDEO} "
        "shots, frames = shot + noise, L2-normalised; queries are fresh frames, each timed once. LanceDB on a "
        "MinIO container (infra.harness.services.start_services, with its RabbitMQ), the product's IndexStore "
        f"over s3://<index bucket>/{s3.index_prefix}; rows written in {' then '.join(f'{s:.0f}s' for s in write_s)}.",
        f"Index: {tuning.index_type}, cosine, {tuning.rows_per_partition} rows per IVF partition, built by "
        f"IndexMaintainer (created at {small_n:,} rows" + (f", rebuilt at {big_n:,})." if big_n else ")."),
        f"Every search asks limit={LIMIT} rows (what /v1/search?k={K} asks the table: k x {CANDIDATES_PER_MOMENT}) "
        f"with nprobes={tuning.nprobes}, refine_factor={tuning.refine_factor}, search_consistency_s "
        f"{tuning.search_consistency_s:g} (0: one manifest check per search, shared by the searches waiting then).",
        "Per size, on a new IndexStore (connection) after the index round: first_pass = the first "
        f"{FIRST_PASS_QUERIES} queries (first_query: the very first, which opens the table), then p50/p99 over "
        f"the next {STEADY_QUERIES} distinct queries, then the exact scan (flat) over {flat_small} (100k)"
        + (f" and {flat_big} (1M)" if big_n else "")
        + " more; speedup_vs_flat = flat p50 / p50. No query runs untimed or twice.",
        f"recall10 / recall{LIMIT}: top 10 / all {LIMIT} rows returned vs a numpy exact top-10 / top-{LIMIT}, over "
        "the first-pass and following ANN queries together.",
        f"API: {api_clients} concurrent httpx clients for up to {api_seconds:g} s on /v1/search?k={K} ({LIMIT} "
        "candidate frames, catalog read, moment merge, presigned links), uvicorn on loopback, stub query encoder, "
        f"each request a query not asked before (api_queries answered), on the last size's searcher.",
    ]
    if big_n:
        notes.append(
            "search_sweep_npN_rfR_rcC: the 1M index queried with nprobes N, refine_factor R (0: none) and the "
            "handle re-checking the table version every C s (0: a check per search, shared by the searches "
            f"waiting then; 1: a handle of its own, opened by its first query), {SWEEP_QUERIES} new queries each."
        )
    save_section("search", metrics, notes)
    for key, value in metrics.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
