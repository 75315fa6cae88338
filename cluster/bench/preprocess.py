"""Image preprocessing throughput, one core: decode, HF's processors, and mmserve's ``Preprocessor``.

    python -m cluster.bench.preprocess [--rounds 7] [--seconds 0.4] [--threads 1]

Rows per image kind (a 720p JPEG, a 12 MP JPEG photo, a 224 px PNG):
  decode only            PIL open + load (full size), RGB
  HF PIL processor       ``Qwen2VLImageProcessorPil`` on the decoded image (decode not included)
  HF torchvision proc.   ``Qwen2VLImageProcessor`` (torchvision backend) on the decoded image
  decode + HF tv proc.   both of the above: the best HF path from bytes
  decode + mmserve path  header checks, (draft) decode and mmserve's Qwen2-VL transform, in this thread
  mmserve preprocess     ``Preprocessor.preprocess``: data URL in, ``PreprocessedRequest`` out (base64,
                         mm_hash, header checks, decode, pixel values, chat template, tokens), processor
                         cache off, awaited on one long-lived event loop as the Serve replica does

The rows run round-robin (``--rounds`` rounds of ``--seconds`` CPU time each), so load from other
processes hits every row alike; a row's time is the median over rounds of its mean time per image.
Throughput is per core: images per CPU-second of this process (all its threads), the figure that
does not move when other processes share the machine; wall time per image is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from cluster.bench.media import make_image_bytes
from encoder_service.preprocess.media.image import decode_opened, image_header
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef

if TYPE_CHECKING:
    from encoder_service.preprocess.processors.base import ProcessedItem

KINDS: dict[str, tuple[str, int, int, str]] = {  # --kinds key: (label, width, height, format)
    "720p": ("720p JPEG", 1280, 720, "JPEG"),
    "12mp": ("12 MP JPEG", 4032, 3024, "JPEG"),
    "224png": ("224 px PNG", 224, 224, "PNG"),
}


def _decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def _image_path(pre: Preprocessor, data: bytes) -> ProcessedItem:
    """What ``Preprocessor`` does to a miss after fetching: header, (draft) decode, pixel values."""
    header = image_header(data, pre.limits)
    decoded = decode_opened(header, min_size=pre.processor.image_decode_size(*header.size))
    return pre.processor.process_image(decoded)


def _rows(model_dir: Path, data: bytes, fmt: str, runner: asyncio.Runner) -> dict[str, Callable[[], object]]:
    from transformers import AutoImageProcessor

    pil_proc = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    tv_proc = AutoImageProcessor.from_pretrained(str(model_dir), backend="torchvision")
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 1}, processor_cache_bytes=0)
    decoded = _decode(data)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    messages: list[dict[str, object]] = [
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", url=url)},
                {"type": "text", "text": "hi"},
            ],
        }
    ]

    async def preprocess_once() -> None:
        # Returns None: ``Runner.run`` formats its task's repr (result included) on the way out.
        await pre.preprocess(messages)

    return {
        "decode only": lambda: _decode(data),
        "HF PIL processor": lambda: pil_proc(images=[decoded], return_tensors="pt"),
        "HF torchvision processor": lambda: tv_proc(images=[decoded], return_tensors="pt"),
        "decode + HF torchvision": lambda: tv_proc(images=[_decode(data)], return_tensors="pt"),
        "decode + mmserve image path": lambda: _image_path(pre, data),
        "mmserve Preprocessor.preprocess": lambda: runner.run(preprocess_once()),
    }


def measure(
    rows: dict[str, Callable[[], object]], rounds: int, seconds: float
) -> dict[str, tuple[float, float]]:
    """Per row: (CPU seconds, wall seconds) per call, each the median over rounds of a round's mean.

    CPU time (``time.process_time``: every thread of this process) is what one image costs a core,
    whatever else the machine runs; wall time is what a client would wait on an idle core."""
    for fn in rows.values():
        fn()  # warm-up: lazy imports, first-call allocations
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    wall: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            n, c0, w0 = 0, time.process_time(), time.perf_counter()
            while time.process_time() - c0 < seconds:
                fn()
                n += 1
            cpu[name].append((time.process_time() - c0) / n)
            wall[name].append((time.perf_counter() - w0) / n)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-dir", type=Path, help="a Qwen2-VL model directory (default: generate the tiny one)"
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.4, help="CPU seconds per row per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), help="image kinds to run")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> None:
    from cluster.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, asyncio.Runner() as runner:
        model_dir = args.model_dir or make_tiny_model(Path(tmp) / "model", "qwen2-vl")
        print(
            f"torch threads: {args.threads}; {args.rounds} rounds x {args.seconds} s per row; model {model_dir.name}"
        )
        print(
            f"{'image':<12} {'path':<34} {'img/s/core':>10} {'CPU ms/img':>10} {'wall ms':>8} {'vs HF PIL':>9}"
        )
        for label, width, height, fmt in (KINDS[k] for k in args.kinds):
            data = make_image_bytes(width, height, fmt=fmt)
            result = measure(_rows(model_dir, data, fmt, runner), args.rounds, args.seconds)
            base = result["HF PIL processor"][0]
            for name, (cpu, wall) in result.items():
                print(
                    f"{label:<12} {name:<34} {1 / cpu:>10.1f} {cpu * 1e3:>10.2f} {wall * 1e3:>8.2f} "
                    f"{base / cpu:>8.2f}x"
                )


if __name__ == "__main__":
    main()
