"""bench.procstat's /proc reading, process classes and CPU accounting, on fake /proc data; bench.cpu's
choice of what to profile and its report."""

from __future__ import annotations

from pathlib import Path

from bench.cpu import top_python
from bench.procstat import Proc, Snapshot, classify, cpu_usage, machine_ticks, parse_stat, snapshot

BENCH = 100


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    # Fields 3.. of /proc/<pid>/stat; starttime (field 22) is 1000 + pid.
    rest = ["S", ppid, 1, 1, 0, -1, 4194560, 0, 0, 0, 0, utime, stime, cutime, cstime, 20, 0, 1, 0, 1000 + pid]
    return f"{pid} ({comm}) " + " ".join(str(x) for x in rest) + " 0 0\n"


def proc(pid: int, ppid: int, cmdline: str, ticks: int, child_ticks: int = 0, start: int | None = None) -> Proc:
    return Proc(
        pid, ppid, cmdline.split(" ")[0][-15:], cmdline, ticks, child_ticks, 1000 + pid if start is None else start
    )


def snap(*procs: Proc, busy: int = 0, at_s: float = 0.0) -> Snapshot:
    return Snapshot({p.pid: p for p in procs}, busy, 0, at_s)


def test_parse_stat_takes_comm_with_spaces_and_parentheses() -> None:
    p = parse_stat(7, stat_line(7, "a b) (c", 3, 11, 4, 5, 6), b"python\0-m\0bench.cpu\0")
    assert (p.comm, p.ppid, p.ticks, p.child_ticks, p.start) == ("a b) (c", 3, 15, 11, 1007)
    assert p.cmdline == "python -m bench.cpu"


def test_machine_ticks_busy_is_every_non_idle_tick_but_guest_counted_once() -> None:
    text = "cpu  100 5 30 900 40 2 3 7 50 0\ncpu0 1 1 1 1 1 1 1 1 1 1\nintr 1\n"
    assert machine_ticks(text) == (100 + 5 + 30 + 2 + 3 + 7, 7)


def test_snapshot_reads_a_proc_tree_and_skips_what_is_not_a_process(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  10 0 5 100 0 0 0 0 0 0\n")
    for pid, comm, cmd in [(1, "init", b"/sbin/init\0"), (42, "minio", b"minio\0server\0/data\0")]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat_line(pid, comm, 0 if pid == 1 else 1, 3, 2))
        (tmp_path / str(pid) / "cmdline").write_bytes(cmd)
    (tmp_path / "99").mkdir()  # ended while being read: no stat file
    (tmp_path / "self").mkdir()
    s = snapshot(tmp_path)
    assert sorted(s.procs) == [1, 42] and s.procs[42].cmdline == "minio server /data" and s.busy_ticks == 15


def test_classes_from_command_lines_and_parents() -> None:
    procs = {
        p.pid: p
        for p in [
            proc(1, 0, "/sbin/init", 0),
            proc(BENCH, 1, ".venv/bin/python -m bench.cpu", 0),
            proc(101, BENCH, "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --port=0", 0),
            proc(
                102,
                BENCH,
                "/venv/ray/core/src/ray/raylet/raylet --node_ip_address=127.0.0.1 --python_worker_command=/venv/bin/"
                "python /venv/ray/_private/workers/default_worker.py --agent_command=/venv/bin/python -u "
                "/venv/ray/dashboard/agent.py --node-ip-address=127.0.0.1",
                0,
            ),
            proc(103, 102, "ray::ServeReplica:vidx:IndexConsumer", 0),
            proc(104, 103, "/venv/bin/python -c import sys; sys.path[:0] = []; serve()", 0),
            proc(105, 102, "ray::ServeController", 0),
            proc(106, 102, "ray::ProxyActor", 0),
            proc(107, 102, "ray::IDLE", 0),
            proc(108, 102, "ray::DashboardAgent", 0),
            proc(118, 102, "/venv/bin/python -u /venv/ray/_private/runtime_env/agent/main.py --node-ip-address=1", 0),
            proc(109, BENCH, "/venv/bin/python /venv/ray/dashboard/dashboard.py --host=127.0.0.1", 0),
            proc(110, 1, "/usr/bin/conmon --api-version 1 -c abc", 0),
            proc(111, 110, "minio server /data", 0),
            proc(112, 110, "/usr/lib/erlang/erts-13/bin/beam.smp -W w -- -root /usr/lib/erlang", 0),
            proc(113, 112, "erl_child_setup 1024", 0),
            proc(114, BENCH, "/venv/bin/py-spy record --pid 103", 0),
            proc(115, 2, "", 0),
            proc(116, 1, "/usr/sbin/sshd -D", 0),
            proc(117, 102, "ray::ServeReplica:vidx:Encoder.handle_request", 0),
        ]
    }
    got = classify(procs, BENCH)
    assert got[BENCH] == "benchmark" and got[114] == "benchmark"
    assert (got[101], got[102]) == ("Ray GCS", "Ray raylet")
    assert (got[103], got[104], got[117]) == ("IndexConsumer", "IndexConsumer children", "Encoder")
    assert (got[105], got[106], got[107]) == ("Serve controller", "Serve proxy", "Ray workers (other)")
    assert (got[108], got[118], got[109]) == ("Ray agents", "Ray agents", "Ray dashboard")
    assert (got[110], got[111], got[112], got[113]) == ("container plumbing", "MinIO", "RabbitMQ", "RabbitMQ")
    assert (got[115], got[116], got[1]) == ("kernel", "other", "other")


def test_cpu_usage_counts_deltas_new_processes_from_zero_and_reaped_children() -> None:
    hz = 100
    before = snap(
        proc(BENCH, 1, "python -m bench.cpu", 1000),
        proc(103, 1, "ray::ServeReplica:vidx:IndexConsumer", 500, child_ticks=40),
        proc(104, 103, "python -c decode worker", 70),  # ends; reaped by 103
        proc(120, 1, "minio server /data", 300),
        proc(130, 999, "python orphan", 50),  # ends; its parent is not there: lost
        proc(140, 1, "ray::IDLE", 5),  # its pid is reused by a new process
        busy=10_000,
        at_s=1.0,
    )
    after = snap(
        proc(BENCH, 1, "python -m bench.cpu", 1100),
        proc(103, 1, "ray::ServeReplica:vidx:IndexConsumer", 800, child_ticks=40 + 70 + 30 + 25),
        proc(105, 103, "python -c decode worker", 60),  # new
        proc(120, 1, "minio server /data", 450),
        proc(140, 1, "ray::ServeController", 20, start=9999),
        busy=11_000,
        at_s=3.5,
    )
    u = cpu_usage(before, after, BENCH, hz)
    # 104 spent 30 more ticks before it ended, and an unseen child of 103 started and ended (25 ticks).
    assert u.by_class == {
        "benchmark": 1.0,
        "IndexConsumer": 3.0,
        "IndexConsumer children": 0.6 + 0.55,
        "MinIO": 1.5,
        "Serve controller": 0.2,
    }
    assert (u.started, u.ended, u.ended_unrecovered) == ({105, 140}, 3, 2)
    assert u.reaped == {"IndexConsumer children": 0.55} and u.busy_s == 10.0 and u.wall_s == 2.5


def test_top_python_skips_non_python_spenders() -> None:
    u = cpu_usage(snap(), snap(), BENCH, 100)
    u.by_class = {"MinIO": 9.0, "IndexConsumer": 5.0, "Ray raylet": 4.0, "Encoder": 3.0, "Api": 1.0}
    assert top_python(u) == [("IndexConsumer", "MinIO"), ("Encoder", "MinIO, Ray raylet")]


def test_report_lists_classes_biggest_first_and_links_the_flame_graphs() -> None:
    from bench.report import cpu_lines

    metrics = {
        "cpu_s_per_video": {"Api": 0.1, "IndexConsumer": 0.3, "MinIO": 0.2},
        "cpu_share": {"Api": 1 / 6, "IndexConsumer": 0.5, "MinIO": 1 / 3},
        "profiles": {"IndexConsumer": "docs/profiles/cpu-indexconsumer.svg"},
    }
    rows = [line.split(" | ")[0].strip("| ") for line in cpu_lines(metrics) if line.startswith("| ") and "0." in line]
    assert rows == ["IndexConsumer", "MinIO", "Api"]
    assert "[`docs/profiles/cpu-indexconsumer.svg`](profiles/cpu-indexconsumer.svg)" in "\n".join(cpu_lines(metrics))
