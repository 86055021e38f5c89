"""What each deployment reserves on the cluster beyond the settings' plain numbers: GPU shares by
layout, and the consumer's room to drain when it stops."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from pipeline.settings import Settings

log = logging.getLogger(__name__)

#: GPU share of the Encoder and of each consumer replica in the ``fused`` layout when the cluster
#: has a GPU: the query Encoder and up to four consumers fit on one.
FUSED_GPU_SHARE = 0.2
#: Seconds a stopping consumer replica gets beyond its drain: Celery's warm shutdown (Ray's
#: ``stop_consumer`` waits 10 s for it) comes first.
SHUTDOWN_MARGIN_S = 15.0


def cluster_has_gpu() -> bool:
    """Whether the Ray cluster this process is connected to has a GPU (False when not connected)."""
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def gpu_shares(settings: Settings, cluster_has_gpu: bool) -> tuple[float, float]:
    """GPUs the Encoder and each consumer replica reserve: the settings when set, else by layout
    (``split``: the Encoder takes a GPU; ``fused``: all share one, ``FUSED_GPU_SHARE`` each)."""
    s = settings.serve
    fused = s.layout == "fused"
    default_encoder = (FUSED_GPU_SHARE if fused else 1.0) if cluster_has_gpu else 0.0
    default_consumer = FUSED_GPU_SHARE if fused and cluster_has_gpu else 0.0
    encoder = s.encoder_num_gpus if s.encoder_num_gpus is not None else default_encoder
    return encoder, s.consumer_num_gpus if s.consumer_num_gpus is not None else default_consumer


@contextlib.contextmanager
def niced_while_starting(increment: int) -> Iterator[None]:
    """Every thread of this process ``increment`` nicer inside the block, then back at the niceness it
    had (threads started inside too). A consumer replica starting (importing torch, PyAV, LanceDB and
    Celery: ~20 s of a core) yields the CPU to the Api, Serve's proxy and the running replicas; once
    started it works at the same priority as the rest of the pipeline (a replica niced for good lost
    ~30 % of the flood's throughput to everything else on saturated cores: docs/benchmarks.md).

    Linux keeps a nice value per thread (``os.nice`` changes the caller's only), so every thread is
    set; threads started meanwhile inherit their creator's value. Going back to a lower niceness needs
    ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` allowing it): without, the process stays niced, with a warning.
    """
    base = os.getpriority(os.PRIO_PROCESS, 0)
    niced = increment > 0 and _set_all(lambda now: min(19, now + increment), f"lower its CPU priority by {increment}")
    try:
        yield
    finally:
        if niced:
            _set_all(lambda _now: base, f"restore its CPU priority to {base} after starting")


def _set_all(value: Callable[[int], int], what: str) -> bool:
    """Set every thread's niceness to ``value(its niceness)``; False (and a warning) when not allowed."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: this thread at least
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value(os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # not allowed here
            log.warning("this replica could not %s: %s", what, exc)
            return False
    return True
