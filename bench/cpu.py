"""A CPU budget per video: every process's CPU time (``/proc``) over a batch of N 10 s 640x360 clips
indexed by the real app (fleet pinned at its maximum), by process class (deployments, Serve, Ray,
MinIO, RabbitMQ, ...) against the machine's busy time; then, app and services stopped, the same
clips' bare work (decode, embed, thumbnails, frame write to a local LanceDB) in P plain processes
(``capacity_vs_bare_work``: vidx's videos/s over theirs); py-spy flame graphs of the two Python
classes that spent the most, during a second, untimed batch.

``python -m bench.cpu [--full] [--videos N] [--processes P]``; needs the container engine (``make bench``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, per_video, save_section, work_counts
from bench.procstat import Usage, cpu_usage, snapshot

DEFAULT_VIDEOS, FULL_VIDEOS = 40, 120
INDEX_TIMEOUT_S = 900.0
#: Longest a bare worker may take to load the model and run its warm-up clip, and the bare run itself.
BARE_START_TIMEOUT_S = 300.0
BARE_RUN_TIMEOUT_S = 1800.0
#: py-spy records the untimed batch for about the timed batch's wall time, within these bounds.
PROFILE_MIN_S, PROFILE_MAX_S = 10, 120
PROFILES = ROOT / "docs" / "profiles"
#: Processes listed by name after the run (the busiest).
TOP_PROCESSES = 15

#: The class of the benchmark's own process and the processes it started that nothing else names.
BENCHMARK = "benchmark"

# -- profiling -------------------------------------------------------------------------------------

#: Classes whose processes don't run Python (py-spy can't profile them); the rest do.
NATIVE_CLASSES = {"Ray GCS", "Ray raylet", "MinIO", "RabbitMQ", "container plumbing", "kernel", "other"}


def top_python(usage: Usage, n: int = 2) -> list[tuple[str, str | None]]:
    """The ``n`` biggest Python spenders, each with the non-Python classes it was chosen over (or None)."""
    ranked = sorted(usage.by_class, key=lambda c: -usage.by_class[c])
    picked = [c for c in ranked if c not in NATIVE_CLASSES][:n]
    return [(c, ", ".join(r for r in ranked[: ranked.index(c)] if r in NATIVE_CLASSES) or None) for c in picked]


def table(rows: dict[str, float], videos: int, total_s: float) -> list[str]:
    """Readable lines: class, CPU-s per video, share of ``total_s``; biggest first."""
    lines = [f"{'class':<28} {'cpu_s/video':>12} {'share':>7}"]
    for name, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<28} {seconds / videos:>12.4f} {seconds / total_s if total_s else 0:>7.1%}")
    return lines


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# -- the app run -------------------------------------------------------------------------------------


def _upload_wait(host: Any, client: Any, keys: list[str], paths: list[Path]) -> None:
    """Upload, then wait until every video is indexed, as the index replicas' own log lines say
    (``infra.harness.joblogs``): no request to the app, so the wait costs it nothing."""
    from infra.harness.joblogs import JobLogWatch, serve_log_dir
    from storage.ids import video_id

    watch = JobLogWatch(serve_log_dir()).skip_existing()
    for key, path in zip(keys, paths, strict=True):
        client.fput_object(host.bucket, key, str(path), content_type="video/mp4")
    watch.wait([video_id(host.bucket, k) for k in keys], INDEX_TIMEOUT_S)


def _profiled_batch(host: Any, client: Any, paths: list[Path], usage: Usage, notes: list[str]) -> dict[str, str]:
    """The same clips again under new keys, py-spy on the busiest process of each of the two biggest
    Python classes; {class: svg path}."""
    from bench.pyspy import PY_SPY_WRITE_S, finish_py_spy, start_py_spy

    seconds = int(min(PROFILE_MAX_S, max(PROFILE_MIN_S, usage.wall_s + 5)))
    spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    PROFILES.mkdir(parents=True, exist_ok=True)
    for old in PROFILES.glob("cpu-*.svg"):  # an older run's graphs must not pass for this one's
        old.unlink()
    for name, skipped in top_python(usage):
        alive = [pid for pid, c in usage.classes.items() if c == name and Path(f"/proc/{pid}").exists()]
        if not alive:
            notes.append(f"no live process of {name} to profile")
            continue
        pid = max(alive, key=lambda p: usage.by_pid.get(p, 0.0))
        out = PROFILES / f"cpu-{slug(name)}.svg"
        spies[name] = (start_py_spy(pid, seconds, out, nonblocking=True, quiet=False), out)
        if skipped:
            notes.append(f"profiled {name} in place of the bigger non-Python {skipped} (py-spy profiles Python)")
    _upload_wait(host, client, [f"profiled/v{i:03d}.mp4" for i in range(len(paths))], paths)
    done: dict[str, str] = {}
    for name, (spy, out) in spies.items():
        status = finish_py_spy(spy, seconds + PY_SPY_WRITE_S)
        if status == 0 and out.exists():
            done[name] = str(out.relative_to(ROOT))
        else:
            notes.append(f"py-spy on {name} failed (exit {status})")
    return done


# -- the bare work -----------------------------------------------------------------------------------


#: What a bare work process holds (set by ``_bare_init`` in that process).
_BARE: dict[str, Any] = {}


def _bare_init(settings: Any, paths: list[Path], db_dir: Path, ready: Any) -> None:
    """A bare work process: load the model, open its own frames table, do clip 0 as a warm-up, then
    wait for the others (``ready``, a barrier)."""
    import torch

    from pipeline.embedding.siglip import SiglipEncoder
    from storage.db import IndexDatabase
    from storage.frames import FrameTable

    if settings.model.cpu_threads == 1:
        torch.set_num_threads(1)
    table = FrameTable(IndexDatabase(settings.s3, str(db_dir)), f"frames_{os.getpid()}")
    _BARE.update(settings=settings, paths=paths, encoder=SiglipEncoder(settings.model), table=table)
    _bare_clip(0, "warm-up")
    ready.wait(BARE_START_TIMEOUT_S)


def _bare_clip(i: int, name: str = "bare") -> None:
    """Clip ``i``'s own work: decode (in this process), embed, thumbnails, one frame write."""
    from pipeline.media.decode import sample_frames
    from pipeline.media.frames import thumbnail_jpeg
    from storage.frames import FrameRow, VideoFrames
    from storage.ids import frame_id

    settings, path, vid = _BARE["settings"], _BARE["paths"][i], f"{name}-{os.getpid()}-{i}"
    sampling = settings.sampling
    how: dict[str, Any] = {"strategy": sampling.decode_strategy, "threads": sampling.decode_threads, "isolated": False}
    frames = list(sample_frames(path, sampling.spec, settings.limits, sampling.decode_max_side, **how))
    vectors = _BARE["encoder"].embed_images([f.rgb for f in frames])
    rows = [
        FrameRow(frame_id(vid, f.index), f.ts_s, vectors[j], thumbnail_jpeg(f.rgb, sampling.thumbnail_max_side))
        for j, f in enumerate(frames)
    ]
    _BARE["table"].replace(VideoFrames(vid, f"file://{path}", "1", "fp", "tiny", rows))


def bare_run(settings: Any, paths: list[Path], processes: int, db_dir: Path) -> Usage:
    """The clips' bare work in a pool of ``processes`` spawned processes (one clip at a time each);
    CPU and wall time once every process is warm. ``by_class["bare workers"]``: the pool's CPU.

    Raises:
        threading.BrokenBarrierError: the pool was not warm within ``BARE_START_TIMEOUT_S``.
        multiprocessing.TimeoutError: past ``BARE_RUN_TIMEOUT_S``; or what a clip raised."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(processes + 1)
    with ctx.Pool(processes, _bare_init, (settings, paths, db_dir, ready)) as pool:
        ready.wait(BARE_START_TIMEOUT_S)
        before = snapshot()
        pool.map_async(_bare_clip, range(len(paths)), chunksize=1).get(BARE_RUN_TIMEOUT_S)
        after = snapshot()
    usage = cpu_usage(before, after, os.getpid(), os.sysconf("SC_CLK_TCK"))
    mine = [pid for pid, p in usage.procs.items() if p.ppid == os.getpid()]
    usage.by_class["bare workers"] = sum(usage.by_pid.get(pid, 0.0) for pid in mine)
    return usage


# -- main --------------------------------------------------------------------------------------------


def _app_run(
    paths: list[Path], model_dir: Path, tmp: Path, profile: bool, notes: list[str]
) -> tuple[Usage, Any, dict[str, str], dict[str, Any]]:
    """Index ``paths`` with the app (after a warm-up clip per consumer replica), /proc snapshots
    around it; then the profiled batch. (usage, the app's settings, {class: flame graph}, S3 requests
    and catalog commits per video)."""
    from infra.harness.faults import start_app
    from infra.harness.services import start_services, unique_prefix
    from pipeline.settings import Settings

    settings = Settings()
    fleet = settings.autoscale.consumer_max_replicas
    # Enough warm-up clips at once for every decode slot of the fleet (decode workers start on demand).
    slots = fleet * (settings.serve.consumer_cpu_slots or settings.serve.consumer_concurrency)
    env = {"VIDX_AUTOSCALE__CONSUMER_MIN_REPLICAS": str(fleet)}
    with (
        start_services() as services,
        start_app(services, unique_prefix(), model_dir, tmp / "state", env=env, metrics_push_ms=None) as host,
    ):
        client = services.minio_client()
        warm = [paths[i % len(paths)] for i in range(slots)]
        _upload_wait(host, client, [f"warmup/w{i}.mp4" for i in range(slots)], warm)
        counts = work_counts(host)
        before = snapshot()
        _upload_wait(host, client, [f"batch/v{i:03d}.mp4" for i in range(len(paths))], paths)
        usage = cpu_usage(before, snapshot(), os.getpid(), os.sysconf("SC_CLK_TCK"))
        work = per_video(counts, work_counts(host, ending=True), len(paths))
        print(f"indexed {len(paths)} videos in {usage.wall_s:.1f}s", flush=True)
        notes.append(
            f"the consumer fleet is pinned at its maximum, {fleet} replicas; {slots} warm-up clips at once (one "
            "per decode slot of the fleet: decode workers start on demand) before the timed batch"
        )
        profiles: dict[str, str] = {}
        if profile:
            try:
                profiles = _profiled_batch(host, client, paths, usage, notes)
            except (TimeoutError, RuntimeError, OSError) as exc:  # the timed figures stand without it
                notes.append(f"the profiled batch failed: {type(exc).__name__}: {exc}")
        return usage, host.settings, profiles, work


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"{FULL_VIDEOS} videos")
    parser.add_argument("--videos", type=int, help=f"videos in the batch (default {DEFAULT_VIDEOS})")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="bare work processes")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    args = parser.parse_args()
    n, workers = args.videos or (FULL_VIDEOS if args.full else DEFAULT_VIDEOS), args.processes

    from bench.e2e import FPS, SIZE, VIDEO_S, generate_videos
    from infra.dev.tinymodel import build_tiny_siglip

    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vidx-bench-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"generating {n} videos ({VIDEO_S:g}s {SIZE[0]}x{SIZE[1]} {FPS} fps)", flush=True)
        (tmp / "batch").mkdir()
        paths = generate_videos(tmp / "batch", n, 1000)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        app, settings, profiles, work = _app_run(paths, model_dir, tmp, args.profile, notes)
        model = settings.model.model_copy(update={"id": str(model_dir), "cpu_threads": 1 if workers > 1 else 0})
        bare = bare_run(settings.model_copy(update={"model": model}), paths, workers, tmp / "bare-db")

    # The benchmark's own process (uploads, /proc reads, the log watch) is no part of the product's budget.
    benchmark = app.by_class.pop(BENCHMARK, 0.0)
    attributed, bare_cpu = sum(app.by_class.values()), bare.by_class["bare workers"]
    capacity, bare_capacity = n / app.wall_s, n / bare.wall_s
    ranked = sorted(app.by_class, key=lambda c: -app.by_class[c])
    metrics: dict[str, Any] = {
        "videos": n,
        "wall_s": round(app.wall_s, 2),
        "cpu_capacity_videos_per_s": round(capacity, 3),
        "bare_processes": workers,
        "bare_wall_s": round(bare.wall_s, 2),
        "bare_capacity_videos_per_s": round(bare_capacity, 3),
        "capacity_vs_bare_work": round(capacity / bare_capacity, 3),
        "cpu_s_per_video": {c: round(app.by_class[c] / n, 4) for c in ranked},
        "cpu_share": {c: round(app.by_class[c] / attributed, 4) for c in ranked},
        "attributed_cpu_s_per_video": round(attributed / n, 4),
        "machine_busy_cpu_s_per_video": round(app.busy_s / n, 4),
        "benchmark_cpu_s_per_video": round(benchmark / n, 4),
        "unattributed_cpu_s_per_video": round((app.busy_s - attributed - benchmark) / n, 4),
        "machine_busy_fraction": round(app.busy_s / (app.wall_s * (os.cpu_count() or 1)), 3),
        "steal_cpu_s_per_video": round(app.steal_s / n, 4),
        "bare_cpu_s_per_video": round(bare_cpu / n, 4),
        "cpu_vs_bare_cpu": round(attributed / bare_cpu, 3) if bare_cpu else "not measured",
        "processes_started": len(app.started),
        "processes_ended": app.ended,
        "profiles": profiles,
        **work,
    }
    started = ", ".join(sorted({app.classes[p] for p in app.started})) or "none"
    reaped = ", ".join(f"{k} {v:.2f}" for k, v in sorted(app.reaped.items(), key=lambda kv: -kv[1])) or "none"
    notes += [
        "cpu_s_per_video: utime + stime of every process (/proc/<pid>/stat) over the timed batch, by the class its "
        "command line says (a Serve replica's: its deployment); a process nothing names takes its parent's class "
        f"(a replica's children, its decode workers: '<Deployment> children'). {len(app.started)} processes started "
        f"during the batch ({started}): counted from 0. {app.ended} ended: counted where a surviving parent reaped "
        f"them (its cutime + cstime, with children never seen: {reaped} CPU-s); {app.ended_unrecovered} had no "
        "surviving parent: their CPU is lost.",
        "machine_busy: every non-idle tick of /proc/stat (steal included: a process's own time includes what the "
        "hypervisor stole while it ran) over the same interval; unattributed = busy - the processes' sum.",
        "completion: each video's 'done' line in the index replicas' own log files (read by the benchmark "
        "from disk, infra/harness/joblogs.py; no request to the app); the benchmark's own CPU "
        "(benchmark_cpu_s_per_video: uploads, /proc and log reads) is left out of the classes' sum.",
        "s3_requests_per_video: MinIO's minio_api_requests_total (type s3) over the timed batch, the uploads "
        "included (one PutObject each); catalog_commits_per_video: versions the videos table gained.",
        f"bare work: after the app and services stopped, {workers} spawned processes (torch threads "
        f"{1 if workers > 1 else 'default'}), each warm (model loaded, one clip done), took clips one at a time: "
        "read from local disk, decode in-process (sample_frames isolated=False, the app's strategy and threads; "
        "vidx decodes in a worker process), embed a clip's frames in one call, thumbnails, one frame write per clip "
        "(FrameTable.replace, the merge vidx uses) into a local LanceDB, a table per process (no commit conflicts). "
        "bare_cpu_s_per_video: those processes' utime + stime.",
    ]
    save_section("cpu", metrics, notes)
    print(f"\nvidx {capacity:.3f} videos/s, bare work {bare_capacity:.3f} videos/s ({workers} processes): ", end="")
    print(f"capacity_vs_bare_work {capacity / bare_capacity:.3f}")
    print("\n".join(table(app.by_class, n, attributed)))
    for name, seconds in [("sum of processes", attributed), ("machine busy", app.busy_s), ("bare work", bare_cpu)]:
        print(f"{name:<28} {seconds / n:>12.4f}")
    print("\nbusiest processes (CPU-s over the batch):")
    for pid in sorted(app.by_pid, key=lambda p: -app.by_pid[p])[:TOP_PROCESSES]:
        print(f"{app.by_pid[pid]:7.2f} {pid:>7} {app.classes[pid]:<24} {app.procs[pid].cmdline[:90]}")
    print("\n".join(f"- {line}" for line in notes))


if __name__ == "__main__":
    main()
