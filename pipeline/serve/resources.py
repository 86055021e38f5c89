"""What each deployment reserves on the cluster beyond the settings' plain numbers: GPU shares by
layout, and the consumer's room to drain when it stops."""

from __future__ import annotations

import logging
import os

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


def yield_cpu(increment: int) -> None:
    """Raise this process's niceness by ``increment``: batch work (a consumer replica, its own process)
    yields the CPU to the Api and Serve's proxy when cores are short, and takes every idle cycle else.

    Linux keeps a nice value per thread (``os.nice`` changes the caller's only), so every thread of the
    process is set; threads started later inherit their creator's value."""
    if increment <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: this thread at least
    for tid in tids:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # not allowed here: run at the normal priority
            log.warning("could not lower this replica's CPU priority by %d: %s", increment, exc)
            return
