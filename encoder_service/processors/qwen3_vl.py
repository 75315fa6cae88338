"""Qwen3-VL: Qwen2-VL's image processor (patch 16, mean/std 0.5 in the released checkpoints) behind
the same adapter. Images only for now: its processor writes each video frame as its own
``<t seconds><|vision_start|>`` ... ``<|vision_end|>`` run, which needs per-frame placeholder runs
(not built yet), so videos are refused by the family's modalities.
"""

from __future__ import annotations

from encoder_service.processors.qwen2_vl import Qwen2VLFamily


class Qwen3VLFamily(Qwen2VLFamily):
    modalities = ("image",)
