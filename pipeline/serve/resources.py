"""What each deployment reserves on the cluster beyond the settings' plain numbers: GPU shares by
layout, and the consumer's room to drain when it stops; and the Ray settings of the nodes vidx starts."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
from collections.abc import Callable, Iterator, Set

from pipeline.settings import Settings

log = logging.getLogger(__name__)

#: GPU share of the Encoder and of each consumer replica in the ``fused`` layout when the cluster
#: has a GPU: the query Encoder and up to four consumers fit on one.
FUSED_GPU_SHARE = 0.2
#: Seconds a stopping consumer replica gets beyond its drain: Celery's warm shutdown (Ray's
#: ``stop_consumer`` waits 10 s for it) comes first.
SHUTDOWN_MARGIN_S = 15.0
#: Ray settings of the nodes the local stack and the test harness start, in their environment: no
#: task events (every Serve request and handle call is an actor task whose state changes each core
#: worker reports to the GCS every second: CPU per request in three processes, for the dashboard's
#: task view, which vidx does not use; the actor and node tables the harness reads stay).
RAY_NODE_ENV = {"RAY_task_events_report_interval_ms": "0"}


def cluster_has_gpu() -> bool:
    """Whether the Ray cluster this process is connected to has a GPU (False when not connected)."""
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def gpu_shares(settings: Settings, cluster_has_gpu: bool) -> tuple[float, float]:
    """GPUs the Encoder and each consumer replica reserve: the settings when set, else by layout
    (``split``: the Encoder takes a GPU; ``fused``: all share one, ``FUSED_GPU_SHARE`` each)."""
    s = settings.serve
    fused = s.resolved_layout(cluster_has_gpu) == "fused"
    default_encoder = (FUSED_GPU_SHARE if fused else 1.0) if cluster_has_gpu else 0.0
    default_consumer = FUSED_GPU_SHARE if fused and cluster_has_gpu else 0.0
    encoder = s.encoder_num_gpus if s.encoder_num_gpus is not None else default_encoder
    return encoder, s.consumer_num_gpus if s.consumer_num_gpus is not None else default_consumer


#: Passes of the restore over the process's threads: a thread still niced may start another meanwhile.
RESTORE_PASSES = 3
#: ``CAP_SYS_NICE``'s bit in /proc/self/status ``CapEff``.
CAP_SYS_NICE = 23


@contextlib.contextmanager
def niced_while_starting(increment: int) -> Iterator[None]:
    """Every thread of this process ``increment`` nicer inside the block, then back at the niceness it
    had (threads started inside too). A consumer replica starting (a process importing torch, PyAV,
    LanceDB and Celery) yields the CPU to the Api, Serve's proxy and the running replicas; once started
    it works at the same priority as the rest of the pipeline (docs/benchmarks.md says what each costs).

    Linux keeps a nice value per thread (``os.nice`` changes the caller's only), so every thread is
    set; threads started meanwhile inherit their creator's value. Going back to a lower niceness needs
    ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` allowing it: where neither is held, nothing is niced (a
    replica niced for good would index behind every other process).
    """
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if increment <= 0:
        yield
        return
    if not may_lower_niceness(base):
        log.info("consumer replica not niced while it starts: it could not go back to niceness %d", base)
        yield
        return
    changed = _set_all(lambda now: min(19, now + increment), f"lower its CPU priority by {increment}")
    try:
        yield
    finally:
        if changed:
            _restore(base)


def may_lower_niceness(to: int) -> bool:
    """Whether this process may set a thread's niceness back down to ``to``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - soft <= to:
        return True
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


def _restore(base: int) -> None:
    """Every thread back to ``base``, in passes until one finds no thread it has not set yet."""
    done: set[int] = set()
    for _ in range(RESTORE_PASSES):
        changed = _set_all(lambda _now: base, f"restore its CPU priority to {base} after starting", skip=done)
        if not changed:
            return
        done |= changed


def _set_all(value: Callable[[int], int], what: str, skip: Set[int] = frozenset()) -> set[int]:
    """Set every thread's (but ``skip``'s) niceness to ``value(its niceness)``; the threads set (a
    warning, and the ones set before it, when one is not allowed)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]  # no /proc: this thread at least
    changed: set[int] = set()
    for tid in tids:
        if tid in skip:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value(os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # not allowed here
            log.warning("this replica could not %s: %s", what, exc)
            break
        changed.add(tid)
    return changed
