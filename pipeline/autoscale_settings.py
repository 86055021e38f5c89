"""How replica counts follow the load (``VIDX_AUTOSCALE__...``): part of ``pipeline.settings``."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class AutoscaleSettings(BaseModel):
    """Replica counts that follow the load (``VIDX_AUTOSCALE__...``).

    The IndexConsumer scales on the index queue's depth (``pipeline.serve.autoscale``), the Encoder on
    its ongoing requests (Ray's default policy). Off: ``serve.*_replicas`` are fixed counts.
    """

    enabled: bool = True
    #: Seconds between two reads of the queue depth from RabbitMQ's management API.
    poll_interval_s: float = Field(default=1.0, ge=0.1, le=60)
    #: Longest one read of the queue depth may take; a read that fails keeps the last known depth.
    poll_timeout_s: float = Field(default=2.0, gt=0, le=30)
    #: How long more replicas must be wanted before they are asked for. 0: at once — a backlog on
    #: a durable queue is real work, not a blip, and a replica takes seconds to start anyway.
    upscale_delay_s: float = Field(default=0.0, ge=0, le=3600)
    #: How long fewer replicas must be wanted before replicas are released (the most wanted during
    #: that time is kept): long enough to ride out the gap between two bursts, short enough to
    #: give idle capacity back soon after the queue drains.
    downscale_delay_s: float = Field(default=10.0, ge=0, le=3600)
    #: Longest a scale-down waits while replicas asked for are still starting (the downscale delay
    #: begins once they run): on busy cores a replica can take longer to start than a burst to drain,
    #: and one stopped half-built is work thrown away.
    starting_hold_s: float = Field(default=60.0, ge=0, le=3600)
    consumer_min_replicas: int = Field(default=1, ge=1)
    #: Each replica holds ``serve.consumer_concurrency`` tasks and, in the ``fused`` layout, a model: about
    #: one replica per core of a CPU node does the most (``python -m bench.e2e``, docs/benchmarks.md);
    #: raise it with the cluster's nodes.
    consumer_max_replicas: int = Field(default=2, ge=1)
    #: Tasks on the queue (ready + unacked) one consumer replica is meant to take. Unset:
    #: ``serve.consumer_concurrency``, what one replica holds at once (prefetch multiplier 1: its
    #: prefetch is its working set), so a replica is added as soon as tasks wait for a slot.
    consumer_target_per_replica: int | None = Field(default=None, ge=1)
    #: The TextConsumer (only while a text source is on), scaled on the text queue's depth the same way;
    #: its target per replica is ``serve.text_consumer_concurrency``.
    text_min_replicas: int = Field(default=1, ge=1)
    text_max_replicas: int = Field(default=2, ge=1)
    encoder_min_replicas: int = Field(default=1, ge=1)
    encoder_max_replicas: int = Field(default=2, ge=1)
    #: Calls (frame chunks and queries) in flight per Encoder replica that Ray aims for: enough
    #: for the batcher to fill its batches, not so many that callers queue behind full batches.
    encoder_target_ongoing_requests: float = Field(default=32.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSettings:
        """Raises ValueError when a deployment's min replicas exceed its max."""
        for name in ("consumer", "text", "encoder"):
            if getattr(self, f"{name}_min_replicas") > getattr(self, f"{name}_max_replicas"):
                raise ValueError(f"autoscale.{name}_min_replicas must not exceed autoscale.{name}_max_replicas")
        return self
