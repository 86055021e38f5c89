"""The test apps' Ray stop (infra/harness/shutdown.py) on a real local Ray instance whose processes are
kept stopped (SIGSTOP, again and again, so SIGCONT alone can't free them): the shutdown gets stuck, the
stop lists the processes with their states, sends SIGCONT, then SIGKILL, and returns within its bound with
Ray down, instead of hanging the run as a CI run hung for 73 minutes in a module's teardown."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from infra.harness import shutdown
from infra.harness.shutdown import process_state, stop_ray

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_ray_stop_stuck_on_stopped_processes_ends_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(shutdown, "SHUTDOWN_TIMEOUT_S", 5.0)
    monkeypatch.setattr(shutdown, "REMEDY_WAIT_S", 10.0)
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
    node = ray._private.worker._global_node
    pids = [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]
    done = threading.Event()

    def keep_stopped() -> None:
        while not done.wait(0.05):
            shutdown.signal_all(pids, signal.SIGSTOP)

    stopper = threading.Thread(target=keep_stopped, daemon=True)
    stopper.start()
    started = time.monotonic()
    try:
        time.sleep(0.5)
        assert {process_state(pid) for pid in pids} == {"T"}
        started = time.monotonic()
        with pytest.warns(shutdown.RayStopRescued, match="Ray's shutdown is stuck: sent SIGCONT"):
            remedies = stop_ray(serve_first=False)
    finally:
        done.set()
        stopper.join()
        if ray.is_initialized():  # the stop never ran (the precondition failed): leave no stopped Ray behind
            shutdown.signal_all(pids, signal.SIGKILL)
            ray.shutdown()
    took = time.monotonic() - started
    print(f"ray stop: {took:.1f}s; " + "; ".join(line[:120] for line in remedies))
    assert remedies and "sent SIGCONT" in remedies[0] and " T " in remedies[0], remedies
    assert took < shutdown.SHUTDOWN_TIMEOUT_S + 2 * shutdown.REMEDY_WAIT_S + 10, took
    assert not ray.is_initialized()
    assert all(process_state(pid) in (None, "Z") for pid in pids), {pid: process_state(pid) for pid in pids}
