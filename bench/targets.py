"""The targets of the performance issues (revised by the flood issue) and of the words' relevance
(issue 22): metric name, comparison,
threshold, and which benchmark measures it. ``bench/report.py`` marks each pass / miss / not measured.
Figures reported beside them without a target (``event_delivery_ms_p50``, bench/stages/events.py's per-mode
delivery) are in each benchmark's section."""

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
    Target("decode_vs_ffmpeg_ratio", ">=", 3.2, "decode", "CPU vs ffmpeg fps filter, exact, 1080p, 1 fps, 2 s GOP"),
    Target("decode_x_realtime_per_core", ">=", 10, "decode", "video s / CPU s, exact sampling, 1080p, 1 fps, 2 s GOP"),
    Target("encode_serve_efficiency", ">=", 0.8, "encode", "Encoder deployment frames/s vs in-process, same batch"),
    Target("encode_cpu_fraction_of_gemm_peak", ">=", 0.5, "encode", "SigLIP-B/16 GFLOP/s vs a large fp32 matmul, CPU"),
    Target("encode_mfu_gpu", ">=", 0.40, "encode", "model FLOP utilisation on the GPU, bf16 (when lent one)"),
    Target("e2e_vs_slowest_stage_ratio", ">=", 0.8, "e2e", "pipeline vs its slowest stage alone (catalog included)"),
    Target("overhead_ms_per_video", "<=", 100, "e2e", "event receipt -> job end, minus fetch/decode/embed/frame write"),
    Target("freshness_p50_s", "<=", 0.5, "e2e", "upload -> returned by the search endpoint, 10 s 360p, tiny model"),
    Target("capacity_videos_per_s", ">=", 6, "e2e", "videos indexed per second, 10 s 640x360 clips, tiny model"),
    Target("catalog_commits_per_video_lone", "<=", 1, "e2e", "videos-table commits per video, one upload at a time"),
    Target("catalog_commits_per_video_batch", "<=", 0.05, "e2e", "videos-table commits per video, uploads at once"),
    Target("s3_requests_per_video", "<=", 6, "e2e", "S3 requests MinIO served per video in the batch, upload included"),
    Target(
        "capacity_vs_bare_work",
        ">=",
        0.6,
        "cpu",
        "vidx capacity vs the bare work (fetch-free decode, embed, thumbnails, frame write) in N plain processes, "
        "same clips, same run",
    ),
    Target("ack_p50_ms", "<=", 50, "ack", "POST /v1/index answer p50, 20 req/s open-loop 20 s bursts, median of 5"),
    Target("ack_p95_ms", "<=", 250, "ack", "POST /v1/index answer p95, same bursts, median of 5"),
    Target("ack_served_rps_32c", ">=", 200, "ack", "POST /v1/index answered per second, 32 connections, closed loop"),
    Target("search_p50_ms_1m", "<=", 20, "search", "search latency p50 at 1M frames (768-d), ANN"),
    Target("search_recall10_1m", ">=", 0.95, "search", "recall@10 vs exact search at 1M frames"),
    Target("search_speedup_vs_flat_1m", ">=", 10, "search", "ANN vs flat scan latency at 1M frames"),
    Target("search_p50_ms_10m", "<=", 20, "search_10m", "search latency p50 at 10M frames (768-d), ANN (--full)"),
    Target("search_recall10_10m", ">=", 0.95, "search_10m", "recall@10 vs exact search at 10M frames (--full)"),
    Target("subtitle_recall5", ">=", 0.95, "relevance", "right moment in the top 5, subtitle queries, GET /v1/search"),
    Target("ocr_recall5", ">=", 0.85, "relevance", "right moment in the top 5, on-screen text queries, GET /v1/search"),
    Target("speech_recall5", ">=", 0.6, "relevance", "right moment in the top 5, speech queries (PocketSphinx)"),
]
