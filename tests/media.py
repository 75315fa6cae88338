"""Real media files generated on the fly; the generators live in ``cluster.bench.media`` (the benchmark
uses them too, and ``tests`` is not installed)."""

from __future__ import annotations

from cluster.bench.media import (
    make_audio_array,
    make_audio_bytes,
    make_image_array,
    make_image_bytes,
    make_video_bytes,
)

__all__ = ["make_audio_array", "make_audio_bytes", "make_image_array", "make_image_bytes", "make_video_bytes"]
