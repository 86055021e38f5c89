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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, save_section

DEFAULT_VIDEOS, FULL_VIDEOS = 40, 120
INDEX_TIMEOUT_S = 900.0
#: Longest a bare worker may take to load the model and run its warm-up clip, and the bare run itself.
BARE_START_TIMEOUT_S = 300.0
BARE_RUN_TIMEOUT_S = 1800.0
#: py-spy records the untimed batch for about the timed batch's wall time, within these bounds.
PROFILE_MIN_S, PROFILE_MAX_S = 10, 120
PROFILES = ROOT / "docs" / "profiles"
#: Status poll period while a batch is indexed: it bounds the error of the wall time, and each poll
#: costs the Api, the proxy and MinIO (a catalog read) CPU that counts in the batch.
POLL_S = 0.2
#: Processes listed by name after the run (the busiest).
TOP_PROCESSES = 15

# -- /proc -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proc:
    """One process as ``/proc`` shows it; CPU in clock ticks."""

    pid: int
    ppid: int
    comm: str
    cmdline: str
    ticks: int  # utime + stime
    child_ticks: int  # cutime + cstime: children it has waited for
    start: int  # starttime (ticks since boot): tells a reused pid apart


@dataclass(frozen=True, slots=True)
class Snapshot:
    procs: dict[int, Proc]
    busy_ticks: int
    steal_ticks: int
    at_s: float


def parse_stat(pid: int, stat: str, cmdline: bytes) -> Proc:
    """A ``Proc`` from the text of ``/proc/<pid>/stat`` and the bytes of ``/proc/<pid>/cmdline``."""
    head, _, tail = stat.rpartition(")")  # comm may hold spaces and parentheses
    fields = tail.split()  # fields[0] is field 3 (state)
    args = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    ticks, child_ticks = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
    return Proc(pid, int(fields[1]), head.partition("(")[2], args, ticks, child_ticks, int(fields[19]))


def machine_ticks(proc_stat: str) -> tuple[int, int]:
    """(busy, steal) ticks of all CPUs from ``/proc/stat``: busy is every non-idle tick, user + nice +
    system + irq + softirq + steal (guest time is inside user already; idle and iowait are idle)."""
    cpu = next(line for line in proc_stat.splitlines() if line.startswith("cpu "))
    v = [int(x) for x in cpu.split()[1:]] + [0] * 10
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], v[7]


def snapshot(proc_root: Path = Path("/proc")) -> Snapshot:
    """Every process's CPU time and the machine's; processes that end while being read are skipped."""
    procs: dict[int, Proc] = {}
    for entry in proc_root.iterdir():
        try:
            if entry.name.isdigit():
                pid = int(entry.name)
                procs[pid] = parse_stat(pid, (entry / "stat").read_text(), (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    busy, steal = machine_ticks((proc_root / "stat").read_text())
    return Snapshot(procs, busy, steal, time.monotonic())


# -- classes -----------------------------------------------------------------------------------------

REPLICA = re.compile(r"^ray::ServeReplica:[^:\s]+:([\w-]+)")
#: (pattern on the command line, class), first match wins; see ``classify_one``.
RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^ray::ServeController"), "Serve controller"),
    (re.compile(r"^ray::ProxyActor"), "Serve proxy"),
    (
        re.compile(r"^ray::(DashboardAgent|RuntimeEnvAgent)|dashboard/agent\.py|runtime_env/agent/main\.py"),
        "Ray agents",
    ),
    (re.compile(r"^ray::|ray/_private/workers/default_worker\.py"), "Ray workers (other)"),
    (re.compile(r"(^|/)gcs_server\b"), "Ray GCS"),
    (re.compile(r"(^|/)raylet\b"), "Ray raylet"),
    (re.compile(r"^ray-dashboard-|dashboard/dashboard\.py"), "Ray dashboard"),
    (re.compile(r"log_monitor\.py|autoscaler/_private/monitor\.py"), "Ray monitors"),
    (re.compile(r"^(\S*/)?minio\b"), "MinIO"),
    (re.compile(r"beam\.smp|erl_child_setup|(^|/)epmd\b|inet_gethost|rabbitmq"), "RabbitMQ"),
    (re.compile(r"^(\S*/)?(podman|conmon|slirp4netns|pasta|catatonit|crun|runc|netavark)"), "container plumbing"),
]
#: Classes whose processes don't run Python (py-spy can't profile them); the rest do.
NATIVE_CLASSES = {"Ray GCS", "Ray raylet", "MinIO", "RabbitMQ", "container plumbing", "kernel", "other"}


def classify_one(proc: Proc) -> str | None:
    """The class a process's own command line says, or None (then its parent's decides)."""
    if proc.pid == 2 or proc.ppid == 2:
        return "kernel"
    if m := REPLICA.match(proc.cmdline):
        return m[1]
    return next((name for pattern, name in RULES if pattern.search(proc.cmdline)), None)


def classify(procs: dict[int, Proc], bench_pid: int) -> dict[int, str]:
    """Each pid's class: its own command line's, else the nearest classified ancestor's (a replica's
    children, e.g. decode workers, are ``<Deployment> children``); the benchmark and the processes it
    started are ``benchmark``; ``other`` when nothing says."""
    own = {pid: "benchmark" if pid == bench_pid else classify_one(p) for pid, p in procs.items()}
    out: dict[int, str] = {}
    for pid in procs:
        cls, seen, at = own[pid], set(), pid
        while cls is None and at in procs and at not in seen:
            seen.add(at)
            at = procs[at].ppid
            parent = own.get(at)
            if parent is not None:
                cls = f"{parent} children" if REPLICA.match(procs[at].cmdline) else parent
        out[pid] = cls or "other"
    return out


@dataclass
class Usage:
    """CPU seconds by class and by pid over an interval, what it lost, and the machine's busy time."""

    by_class: dict[str, float]
    by_pid: dict[int, float]
    procs: dict[int, Proc]  # both snapshots' processes (the later one's where a pid is in both)
    classes: dict[int, str]
    started: set[int]
    ended: int
    ended_unrecovered: int
    reaped: dict[str, float]  # by class
    busy_s: float
    steal_s: float
    wall_s: float


def cpu_usage(before: Snapshot, after: Snapshot, bench_pid: int, hz: int) -> Usage:
    """CPU seconds each class spent between two snapshots. A process that started in between counts
    from 0; one that ended is recovered from its surviving parent's child times (``cutime + cstime``
    grow when the parent reaps it) less what it had spent before, else lost (``ended_unrecovered``)."""
    procs = before.procs | after.procs
    classes = classify(procs, bench_pid)
    old = {pid: p for pid, p in before.procs.items() if pid in after.procs and after.procs[pid].start == p.start}
    gone = [p for pid, p in before.procs.items() if pid not in old]
    by_pid = {pid: (p.ticks - (old[pid].ticks if pid in old else 0)) / hz for pid, p in after.procs.items()}
    by_class: dict[str, float] = {}
    for pid, seconds in by_pid.items():
        by_class[classes[pid]] = by_class.get(classes[pid], 0.0) + seconds
    reaped: dict[str, float] = {}
    for pid, p in after.procs.items():
        mine = [g for g in gone if g.ppid == pid] if pid in old else []
        ticks = p.child_ticks - (old[pid].child_ticks if pid in old else 0) - sum(g.ticks + g.child_ticks for g in mine)
        if ticks > 0:
            cls = classes[mine[0].pid] if mine else classes[pid]
            reaped[cls] = reaped.get(cls, 0.0) + ticks / hz
            by_class[cls] = by_class.get(cls, 0.0) + ticks / hz
    return Usage(
        by_class=by_class,
        by_pid=by_pid,
        procs=procs,
        classes=classes,
        started=set(after.procs) - set(old),
        ended=len(gone),
        ended_unrecovered=sum(1 for g in gone if g.ppid not in old),
        reaped=reaped,
        busy_s=(after.busy_ticks - before.busy_ticks) / hz,
        steal_s=(after.steal_ticks - before.steal_ticks) / hz,
        wall_s=after.at_s - before.at_s,
    )


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
    """Upload, then wait until every video is indexed (bench.e2e's one-request-per-poll wait)."""
    from bench.e2e import _wait_indexed
    from storage.ids import video_id

    for key, path in zip(keys, paths, strict=True):
        client.fput_object(host.bucket, key, str(path), content_type="video/mp4")
    _wait_indexed(host, [video_id(host.bucket, k) for k in keys], INDEX_TIMEOUT_S, POLL_S)


def _profiled_batch(host: Any, client: Any, paths: list[Path], usage: Usage, notes: list[str]) -> dict[str, str]:
    """The same clips again under new keys, py-spy on the busiest process of each of the two biggest
    Python classes; {class: svg path}."""
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
        spy = Path(sys.executable).parent / "py-spy"
        cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50", "--nonblocking"]
        spies[name] = (subprocess.Popen([*cmd, "--output", str(out)], stdout=subprocess.DEVNULL), out)
        if skipped:
            notes.append(f"profiled {name} in place of the bigger non-Python {skipped} (py-spy profiles Python)")
    _upload_wait(host, client, [f"profiled/v{i:03d}.mp4" for i in range(len(paths))], paths)
    done: dict[str, str] = {}
    for name, (spy_proc, out) in spies.items():
        try:
            spy_proc.wait(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            spy_proc.wait(timeout=10)
        if spy_proc.returncode == 0 and out.exists():
            done[name] = str(out.relative_to(ROOT))
        else:
            notes.append(f"py-spy on {name} failed (exit {spy_proc.returncode})")
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
) -> tuple[Usage, Any, dict[str, str]]:
    """Index ``paths`` with the app (after a warm-up clip per consumer replica), /proc snapshots
    around it; then the profiled batch. (usage, the app's settings, {class: flame graph})."""
    from pipeline.settings import Settings
    from tests.faults.harness import start_app
    from tests.services import start_services, unique_prefix

    settings = Settings()
    fleet = settings.autoscale.consumer_max_replicas
    # Enough warm-up clips at once for every decode slot of the fleet (decode workers start on demand).
    slots = fleet * (settings.serve.consumer_cpu_slots or settings.serve.consumer_concurrency)
    env = {"VIDX_AUTOSCALE__CONSUMER_MIN_REPLICAS": str(fleet)}
    with start_services() as services, start_app(services, unique_prefix(), model_dir, tmp / "state", env=env) as host:
        client = services.minio_client()
        warm = [paths[i % len(paths)] for i in range(slots)]
        _upload_wait(host, client, [f"warmup/w{i}.mp4" for i in range(slots)], warm)
        before = snapshot()
        _upload_wait(host, client, [f"batch/v{i:03d}.mp4" for i in range(len(paths))], paths)
        usage = cpu_usage(before, snapshot(), os.getpid(), os.sysconf("SC_CLK_TCK"))
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
        return usage, host.settings, profiles


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"{FULL_VIDEOS} videos")
    parser.add_argument("--videos", type=int, help=f"videos in the batch (default {DEFAULT_VIDEOS})")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="bare work processes")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    args = parser.parse_args()
    n, workers = args.videos or (FULL_VIDEOS if args.full else DEFAULT_VIDEOS), args.processes

    from bench.e2e import FPS, SIZE, VIDEO_S, _videos
    from infra.dev.tinymodel import build_tiny_siglip

    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vidx-bench-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"generating {n} videos ({VIDEO_S:g}s {SIZE[0]}x{SIZE[1]} {FPS} fps)", flush=True)
        (tmp / "batch").mkdir()
        paths = _videos(tmp / "batch", n, 1000)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        app, settings, profiles = _app_run(paths, model_dir, tmp, args.profile, notes)
        model = settings.model.model_copy(update={"id": str(model_dir), "cpu_threads": 1 if workers > 1 else 0})
        bare = bare_run(settings.model_copy(update={"model": model}), paths, workers, tmp / "bare-db")

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
        "unattributed_cpu_s_per_video": round((app.busy_s - attributed) / n, 4),
        "machine_busy_fraction": round(app.busy_s / (app.wall_s * (os.cpu_count() or 1)), 3),
        "steal_cpu_s_per_video": round(app.steal_s / n, 4),
        "bare_cpu_s_per_video": round(bare_cpu / n, 4),
        "cpu_vs_bare_cpu": round(attributed / bare_cpu, 3) if bare_cpu else "not measured",
        "processes_started": len(app.started),
        "processes_ended": app.ended,
        "profiles": profiles,
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
        f"status poll during the batches: GET /v1/videos/<id> of the first video not yet indexed every "
        f"{POLL_S * 1000:.0f} ms (one request, a catalog read, per poll: in the benchmark, Api, Serve proxy and MinIO "
        "classes; the wall time is late by up to one period).",
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
