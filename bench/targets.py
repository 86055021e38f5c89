"""The targets of the performance issue: metric name, comparison, threshold, and which benchmark
measures it. ``bench/report.py`` marks each pass / miss / not measured."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    metric: str
    op: str  # ">=" or "<="
    threshold: float
    bench: str
    what: str

    def passes(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


TARGETS = [
    Target("decode_vs_ffmpeg_ratio", ">=", 5, "decode", "sampled decode vs ffmpeg fps filter, 1080p H.264, 1 fps"),
    Target("decode_x_realtime_per_core", ">=", 20, "decode", "video seconds decoded per wall second per core, 1080p"),
    Target("encode_batched_vs_unbatched_ratio", ">=", 4, "encode", "Encoder images/s, batched vs one by one, CPU"),
    Target("encode_mfu_gpu", ">=", 0.40, "encode", "model FLOP utilisation on the GPU, bf16 (when lent one)"),
    Target("e2e_vs_slowest_stage_ratio", ">=", 0.8, "e2e", "pipeline throughput vs its slowest stage alone"),
    Target("freshness_p50_s", "<=", 3, "e2e", "upload -> searchable, 10 s 360p clip, tiny model (p50)"),
    Target("search_p50_ms_1m", "<=", 20, "search", "search latency p50 at 1M frames (768-d), ANN"),
    Target("search_recall10_1m", ">=", 0.95, "search", "recall@10 vs exact search at 1M frames"),
    Target("search_speedup_vs_flat_1m", ">=", 10, "search", "ANN vs flat scan latency at 1M frames"),
    Target("overhead_ms_per_video", "<=", 100, "e2e", "queue hops and status writes per video"),
]
