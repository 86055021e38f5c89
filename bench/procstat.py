"""CPU accounting from ``/proc``: every process's CPU time and the machine's busy time at an instant
(``snapshot``), each process's class by its command line or its nearest classified ancestor
(``classify``), and the CPU seconds each class spent between two snapshots (``cpu_usage``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

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
    """Every process at one instant, and the machine's busy and steal ticks; ``at_s`` is monotonic."""

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
    # GCS and raylet by their executable, first: the raylet's arguments name the dashboard agent's and
    # the default worker's scripts (the commands it starts), which the later rules look for.
    (re.compile(r"^(\S*/)?gcs_server(\s|$)"), "Ray GCS"),
    (re.compile(r"^(\S*/)?raylet(\s|$)"), "Ray raylet"),
    (re.compile(r"^ray::ServeController"), "Serve controller"),
    (re.compile(r"^ray::ProxyActor"), "Serve proxy"),
    (
        re.compile(r"^ray::(DashboardAgent|RuntimeEnvAgent)|dashboard/agent\.py|runtime_env/agent/main\.py"),
        "Ray agents",
    ),
    (re.compile(r"^ray::|ray/_private/workers/default_worker\.py"), "Ray workers (other)"),
    (re.compile(r"^ray-dashboard-|dashboard/dashboard\.py"), "Ray dashboard"),
    (re.compile(r"log_monitor\.py|autoscaler/_private/monitor\.py"), "Ray monitors"),
    (re.compile(r"^(\S*/)?minio\b"), "MinIO"),
    (re.compile(r"beam\.smp|erl_child_setup|(^|/)epmd\b|inet_gethost|rabbitmq"), "RabbitMQ"),
    (re.compile(r"^(\S*/)?(podman|conmon|slirp4netns|pasta|catatonit|crun|runc|netavark)"), "container plumbing"),
]


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
