"""Encoder throughput at TP=1 vs TP=2 (weights, data) on gloo CPU processes; prints a table.

    python -m cluster.bench.encoder --preset small --num-images 8 --size 224

TP=1 runs in one process with ``--threads`` torch threads; each TP=2 rank gets ``--threads`` too,
so TP=2 uses twice the cores. Times are the median of ``--repeats`` encode calls after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from encoder_service.encode.runner import EncoderRunner
from encoder_service.encode.tp.launch import exit_spawned_rank, free_port, init_tp_process_group
from encoder_service.types import EncoderInput


def make_inputs(model_dir: Path, num_images: int, size: int) -> list[EncoderInput]:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(model_dir)).image_processor
    rng = np.random.default_rng(0)
    items = []
    for i in range(num_images):
        img = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
        out = proc(images=[img], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
        tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        items.append(EncoderInput(f"bench-{i}", "image", t * h * w // 4, (t, h, w), tensors))
    return items


def time_encode(runner: EncoderRunner, items: list[EncoderInput], repeats: int, sync: bool) -> float:
    runner.encode(items)  # warm-up
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        runner.encode(items)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank_main(
    rank: int, port: int, work: str, model_dir: str, mode: str, repeats: int, threads: int
) -> None:
    torch.set_num_threads(threads)
    init_tp_process_group(f"tcp://127.0.0.1:{port}", rank, 2, "gloo")
    items = torch.load(Path(work) / "inputs.pt", weights_only=False)
    runner = EncoderRunner(model_dir, device="cpu", tp_rank=rank, tp_size=2, tp_mode=mode)  # type: ignore[arg-type]
    seconds = time_encode(runner, items, repeats, sync=True)
    if rank == 0:
        (Path(work) / f"{mode}.txt").write_text(str(seconds))
    exit_spawned_rank()


def main() -> None:
    from cluster.tiny_model import PRESETS, make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--model-dir", type=Path, help="an existing model directory (default: generate --preset)")
    ap.add_argument("--num-images", type=int, default=8)
    ap.add_argument("--size", type=int, default=224, help="square image side in pixels")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or make_tiny_model(work / "model", "qwen2-vl", PRESETS[args.preset])
        items = make_inputs(model_dir, args.num_images, args.size)
        torch.save(items, work / "inputs.pt")
        embeds = sum(it.num_embeds for it in items)
        torch.set_num_threads(args.threads)
        rows = [("1", "-", time_encode(EncoderRunner(model_dir, device="cpu"), items, args.repeats, False))]
        for mode in ("weights", "data"):
            mp.spawn(
                _rank_main,
                args=(free_port(), str(work), str(model_dir), mode, args.repeats, args.threads),
                nprocs=2,
            )
            rows.append(("2", mode, float((work / f"{mode}.txt").read_text())))

    print(
        f"{args.num_images} images {args.size}x{args.size} ({embeds} embeddings), preset {args.preset}, "
        f"{args.threads} thread(s)/process, gloo CPU"
    )
    print(f"{'TP':>3} {'mode':>8} {'ms/batch':>10} {'embeds/s':>10}")
    for tp, mode, seconds in rows:
        print(f"{tp:>3} {mode:>8} {seconds * 1e3:>10.1f} {embeds / seconds:>10.0f}")


if __name__ == "__main__":
    main()
