"""Gemma 4's encoders in one pool model: the vision tower (``gemma4_vision.py``) for images, the
conformer (``gemma4_audio.py``) for audio clips; a batch may mix them, each item goes to its tower."""

from __future__ import annotations

import torch

from encoder_service.encode.models.gemma4_audio import Gemma4AudioTower, subsample_mask
from encoder_service.encode.models.gemma4_vision import Gemma4VisionEncoder
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import TPContext
from encoder_service.types import EncoderInput


class Gemma4Encoder(Gemma4VisionEncoder):
    modalities = ("image", "audio")

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__(config, tp)
        self.audio = Gemma4AudioTower(config, self.hidden_size) if config.get("audio_config") else None

    def load_weights(self, reader: CheckpointReader) -> None:
        super().load_weights(reader)
        if self.audio is not None:
            self.audio.load(reader)

    def _audio(self, item: EncoderInput) -> tuple[torch.Tensor, torch.Tensor]:
        if self.audio is None:
            raise ValueError(f"this Gemma 4 checkpoint has no audio tower for item {item.mm_hash}")
        feats = torch.as_tensor(item.tensors["input_features"])
        mask = torch.as_tensor(item.tensors["input_features_mask"]).bool()
        # the log-mel bins the subsampling expects: 4x what its projection reads per channel
        width = 4 * (self.audio.input_proj.shape[1] // self.audio.layer1.conv.shape[0])
        if (
            feats.dim() != 3
            or feats.shape[0] != 1
            or feats.shape[2] != width
            or tuple(mask.shape) != feats.shape[:2]
        ):
            raise ValueError(
                f"item {item.mm_hash}: audio features {tuple(feats.shape)} / mask {tuple(mask.shape)} are not "
                f"one [1, frames, {width}] clip with its [1, frames] mask"
            )
        return feats[0], mask[0]

    def num_embeds(self, item: EncoderInput) -> int:
        if item.modality == "audio":
            return int(subsample_mask(self._audio(item)[1]).sum())
        return super().num_embeds(item)

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        images = [i for i, it in enumerate(items) if it.modality != "audio"]
        out: dict[int, torch.Tensor] = dict(
            zip(images, super().encode([items[i] for i in images]), strict=True)
        )
        dtype = self.input_proj.dtype
        for i, it in enumerate(items):
            if it.modality == "audio":
                feats, mask = self._audio(it)
                assert self.audio is not None
                out[i] = self.audio(feats.to(self.input_proj.device, dtype), mask.to(self.input_proj.device))
        return [out[i] for i in range(len(items))]
