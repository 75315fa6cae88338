"""Qwen3.5 vision tower: Qwen3-VL's (learned position table interpolated per frame, LayerNorm +
GELU(tanh) blocks, 2-D rope, packed per-frame attention, the pre-shuffle-norm merger) without
DeepStack. transformers' ``Qwen3_5VisionModel`` is ``Qwen3VLVisionModel`` with
``deepstack_visual_indexes`` and ``deepstack_merger_list`` deleted, and its config has no
``deepstack_visual_indexes``, so an output row is the merger's alone: ``out_hidden_size`` wide.
"""

from __future__ import annotations

from encoder_service.encode.models.qwen3_vl_vision import Qwen3VLVisionEncoder
from encoder_service.encode.tp.parallel import TPContext


class Qwen35VisionEncoder(Qwen3VLVisionEncoder):
    family = "qwen3.5"
    label = "Qwen3.5"
    modalities = ("image", "video")

    def __init__(self, config: dict, tp: TPContext) -> None:
        vision = {**config["vision_config"], "deepstack_visual_indexes": []}
        super().__init__({**config, "vision_config": vision}, tp)
