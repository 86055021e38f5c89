"""``python -m bench.stages.encode [--full]``: how much of the machine the Encoder gets, on CPU (and GPU if lent).

A randomly initialised SigLIP-B/16 at 224 px (the real vision architecture: 12 layers, width 768,
MLP 3072, 12 heads, 196 patches; speed does not depend on the weights) is built offline. Measured in
one run, on the same frames:

- in-process: ``SiglipEncoder.embed_images`` called directly in batches of ``--batch`` (the model
  alone, no Serve); its GFLOP/s (~35.4 GFLOP per image) against a large fp32 torch matmul's GFLOP/s
  with the same threads is ``encode_cpu_fraction_of_gemm_peak``;
- served: the product's ``Encoder`` deployment (``max_batch_size`` = ``--batch``) on a local Ray
  instance, called by concurrent callers through ``HandleEmbedder`` (the consumer's client); its
  frames/s over the in-process rate is ``encode_serve_efficiency``;
- on a CUDA device (bf16), served, the model FLOP utilisation against the H200's 989 TFLOP/s dense
  bf16 peak (``encode_mfu_gpu``; "not measured" without a GPU).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from bench.common import save_section

#: Forward cost of SigLIP-B/16 at 224 px, per image (vision tower).
GFLOP_PER_IMAGE = 35.4
#: H200 dense bf16 peak.
PEAK_BF16_FLOPS = 989e12
#: Frame size handed to the encoder, as the decoder produces it (longest side 384).
FRAME_HW = (216, 384)


def build_siglip_b16(path: Path, *, seed: int = 0) -> Path:
    """A random-weight SigLIP base/16 checkpoint at 224 px with a fixed-size processor. The vision
    tower is the published one; the text tower (not used here) has the base width, one layer and the
    offline tokenizer's small vocabulary, which keeps building and loading short."""
    import torch
    from transformers import SiglipConfig, SiglipModel, SiglipTextConfig, SiglipVisionConfig
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from infra.dev.tinymodel import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    base: dict[str, Any] = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    }
    text = SiglipTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        **(base | {"num_hidden_layers": 1}),
    )
    vision = SiglipVisionConfig(image_size=224, patch_size=16, **base)
    config = SiglipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SiglipModel(config)
    model.save_pretrained(path)
    processor = SiglipImageProcessorPil(
        size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def frames(n: int, seed: int = 0) -> list[NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*FRAME_HW, 3), dtype=np.uint8) for _ in range(n)]


def run_through_encoder(
    model_dir: Path,
    pool: list[NDArray[np.uint8]],
    *,
    batch: int,
    callers: int,
    device: Literal["cpu", "cuda"],
    budget_s: float,
    least: int,
) -> tuple[float, float, int]:
    """Deploy the Encoder with ``max_batch_size=batch``, warm it up, then send the first n frames of
    ``pool`` from ``callers`` threads at once; n (a multiple of ``batch``, ``least`` to ``len(pool)``)
    is what the warm-up rate says fits in ``budget_s``. Returns (images/s, seconds, n)."""
    from ray import serve

    from pipeline.embedding.encoders import HandleEmbedder
    from pipeline.serve.encoder import Encoder
    from pipeline.settings import ModelSettings

    model = ModelSettings(
        id=str(model_dir),
        device=device,
        max_batch_size=batch,
        batch_wait_timeout_s=0.05 if batch > 1 else 0.0,
        cpu_threads=0 if device == "cuda" else (os.cpu_count() or 1),
        embed_timeout_s=1800.0,
    )
    app = Encoder.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0, "num_gpus": 1 if device == "cuda" else 0}
    ).bind(model)
    handle = serve.run(app, name=f"encode-b{batch}", route_prefix=None)
    embedder = HandleEmbedder(handle, model.id, timeout_s=model.embed_timeout_s)
    warm = max(batch, callers)
    started = time.perf_counter()
    embedder.embed_images(pool[:warm])  # first calls: lazy initialisation
    rate = warm / (time.perf_counter() - started)
    unit = max(batch, callers)
    n = min(len(pool), max(least, int(rate * budget_s) // unit * unit))
    images = pool[:n]
    shares = [images[i::callers] for i in range(callers)]
    errors: list[BaseException] = []

    def call(share: list[NDArray[np.uint8]]) -> None:
        try:
            vectors = embedder.embed_images(share)
            assert vectors.shape[0] == len(share)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(s,)) for s in shares]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    serve.delete(f"encode-b{batch}")
    if errors:
        raise errors[0]
    return n / seconds, seconds, n


def run_in_process(
    model_dir: Path, pool: list[NDArray[np.uint8]], *, batch: int, budget_s: float, least: int
) -> tuple[float, float, int]:
    """``SiglipEncoder.embed_images`` in this process, ``batch`` frames a call, on the first n frames
    of ``pool`` (a multiple of ``batch``, sized by a warm-up batch to fit ``budget_s``). Returns
    (images/s, seconds, n)."""
    from pipeline.embedding.siglip import SiglipEncoder
    from pipeline.settings import ModelSettings

    encoder = SiglipEncoder(
        ModelSettings(id=str(model_dir), device="cpu", max_batch_size=batch, cpu_threads=os.cpu_count() or 1)
    )
    started = time.perf_counter()
    encoder.embed_images(pool[:batch])
    rate = batch / (time.perf_counter() - started)
    n = min(len(pool) // batch * batch, max(least, int(rate * budget_s) // batch * batch))
    started = time.perf_counter()
    for i in range(0, n, batch):
        vectors = encoder.embed_images(pool[i : i + batch])
        assert vectors.shape[0] == batch
    seconds = time.perf_counter() - started
    return n / seconds, seconds, n


def gemm_gflops(*, size: int = 4096, budget_s: float = 4.0) -> float:
    """fp32 GFLOP/s of ``size``x``size`` matmuls in torch with its current threads: the machine's
    practical dense peak, measured next to the model."""
    import torch

    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    torch.matmul(a, b)  # warm-up: thread pool, packing buffers
    runs = 0
    started = time.perf_counter()
    while runs < 2 or time.perf_counter() - started < budget_s:
        torch.matmul(a, b)
        runs += 1
    return 2 * size**3 * runs / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.encode", description=__doc__)
    parser.add_argument("--full", action="store_true", help="more images per run")
    parser.add_argument("--batch", type=int, default=16, help="batch size, in process and max_batch_size served")
    parser.add_argument("--budget-s", type=float, help="timed seconds per run (default 30, --full 120)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import ray
    import torch
    from ray import serve

    cuda = torch.cuda.is_available()
    # B/16 runs at a few images/s on 2 cores, less when they are shared; each run's warm-up rate
    # sizes it to its budget (~2.5 minutes in all by default).
    budget_s = args.budget_s or (120.0 if args.full else 30.0)
    most = 256 if args.full else 96
    callers = 4
    threads = os.cpu_count() or 1
    metrics: dict[str, Any] = {}
    notes = [
        f"SigLIP-B/16 at 224 px, random weights, {GFLOP_PER_IMAGE} GFLOP/image; frames {FRAME_HW[1]}x{FRAME_HW[0]} "
        f"RGB resized on the encoder's device; batch {args.batch}; torch on {threads} threads in both runs. "
        "The same frames in every run (a prefix for the shorter); a warm-up before each, whose rate sizes it.",
        f"served: {callers} concurrent callers through HandleEmbedder (the consumer's Encoder client), "
        "the Encoder replica alone on the machine (num_cpus 0, no other deployment).",
        "gemm: 4096x4096 fp32 torch.matmul, repeated for ~4 s, 2n^3 FLOP each, same threads.",
    ]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vidx-b16-") as tmp:
        model_dir = build_siglip_b16(Path(tmp) / "siglip-b16")
        metrics["build_s"] = round(time.monotonic() - started, 1)
        pool = frames(most)
        torch.set_num_threads(threads)
        peak = gemm_gflops()
        local_ips, local_s, n_local = run_in_process(
            model_dir, pool, batch=args.batch, budget_s=budget_s, least=2 * args.batch
        )
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        try:
            served_ips, served_s, n_served = run_through_encoder(
                model_dir,
                pool,
                batch=args.batch,
                callers=callers,
                device="cpu",
                budget_s=budget_s,
                least=2 * args.batch,
            )
            metrics |= {
                "encode_cpu_in_process_images_per_s": round(local_ips, 3),
                "encode_cpu_served_images_per_s": round(served_ips, 3),
                "encode_serve_efficiency": round(served_ips / local_ips, 3),
                "encode_cpu_gflops": round(local_ips * GFLOP_PER_IMAGE, 1),
                "encode_cpu_served_gflops": round(served_ips * GFLOP_PER_IMAGE, 1),
                "gemm_fp32_gflops": round(peak, 1),
                "encode_cpu_fraction_of_gemm_peak": round(local_ips * GFLOP_PER_IMAGE / peak, 3),
                "encode_cpu_batch_size": args.batch,
                "encode_cpu_images": f"{n_local} in process, {n_served} served",
            }
            notes.append(
                f"CPU: {n_local} images in process in {local_s:.1f}s, {n_served} served in {served_s:.1f}s; "
                f"gemm {peak:.0f} GFLOP/s."
            )
            if cuda:
                gpu_pool = frames(4096 if args.full else 1024, seed=1)
                gpu_ips, gpu_s, n_gpu = run_through_encoder(
                    model_dir, gpu_pool, batch=64, callers=16, device="cuda", budget_s=budget_s, least=256
                )
                metrics["encode_gpu_images_per_s"] = round(gpu_ips, 1)
                metrics["encode_mfu_gpu"] = round(gpu_ips * GFLOP_PER_IMAGE * 1e9 / PEAK_BF16_FLOPS, 4)
                notes.append(f"GPU {torch.cuda.get_device_name(0)}, bf16, batch 64: {n_gpu} in {gpu_s:.1f}s.")
            else:
                metrics["encode_mfu_gpu"] = "not measured"
                notes.append("No CUDA device on this machine: GPU throughput and MFU not measured.")
        finally:
            serve.shutdown()
            ray.shutdown()
    metrics["wall_s"] = round(time.monotonic() - started, 1)
    save_section("encode", metrics, notes)
    for key, value in metrics.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
