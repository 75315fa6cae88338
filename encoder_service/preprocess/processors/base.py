"""What the preprocessor needs from one model family: placeholders, hash kwargs, per-item processing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

from encoder_service.preprocess.media.decoded import MediaMetadata, MediaValue
from encoder_service.preprocess.media.image import DecodedImage
from encoder_service.types import Modality

if TYPE_CHECKING:
    import torch
    from transformers import ProcessorMixin


@dataclass
class ProcessedItem:
    """The HF processor's output for one item and how many embeddings it becomes."""

    tensors: dict[str, torch.Tensor]
    num_embeds: int
    grid_thw: tuple[int, int, int] | None


class ItemFacts(TypedDict, total=False):
    """What the LLM's positions need of one item beyond its grid (``FamilyProcessor.item_metadata``)."""

    second_per_grid_ts: float  # Qwen2.5-VL video: seconds per temporal patch
    frame_times: list[float]  # Qwen3-VL video: seconds of each temporal patch


class PromptFamily(Protocol):
    """What ``Preprocessor`` asks of a family before any item is processed: to hash, check, look up
    and render a prompt. An adapter over the loaded processor (``FamilyProcessor``) is one; the
    ingress's ``HitPathFamily`` (the model's tokenizer and its ``HitPathFacts``) is the other."""

    modalities: tuple[Modality, ...]
    placeholder_token_ids: dict[Modality, int]
    uses_mrope: bool
    sampling_rate: int | None
    frame_multiple: int
    hf: Any  # what renders the chat template: the HF processor, or the tokenizer on the hit path
    tokenizer: Any

    def decode_kwargs(self, modality: Modality) -> dict[str, object]: ...

    def log_kwargs(self, modality: Modality) -> dict[str, object]: ...

    def check_image_size(self, width: int, height: int) -> None: ...

    def prompt_text(self, text: str) -> str: ...

    def expand_placeholder(
        self, modality: Modality, token_id: int, num_embeds: int, frame_times: list[float] | None
    ) -> list[int]: ...


class FamilyProcessor(ABC):
    """One model family (Qwen2-VL, Qwen2-Audio) on top of its HF ``AutoProcessor``.

    Contract: ``process(modality, value)`` returns exactly what the HF processor produces for that one
    item, and ``num_embeds`` equals how many placeholder tokens the HF processor would insert for it.
    """

    modalities: tuple[Modality, ...]
    placeholder_tokens: ClassVar[dict[Modality, str]]
    uses_mrope: bool
    sampling_rate: int | None = None
    frame_multiple: int = 1  # sampled video frames are rounded up to a multiple of this

    def __init__(self, hf_processor: ProcessorMixin) -> None:
        self.hf = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.placeholder_token_ids: dict[Modality, int] = {
            m: int(self.tokenizer.convert_tokens_to_ids(t)) for m, t in self.placeholder_tokens.items()
        }

    def decode_kwargs(self, modality: Modality) -> dict[str, object]:
        """mmserve's own decode settings that change an item's encoding (they go into its mm_hash
        beside ``HitPathFacts.hash_kwargs``). The default: none."""
        return {}

    @abstractmethod
    def log_kwargs(self, modality: Modality) -> dict[str, object]:
        """The few settings worth a log line (a subset of what goes into the mm_hash)."""

    @abstractmethod
    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        """Run the HF processor on one decoded item."""

    def item_metadata(self, modality: Modality, media_metadata: MediaMetadata | None) -> ItemFacts:
        """Facts the LLM's positions need beyond the grid, from the decode's metadata (Qwen2.5-VL: a
        video's ``second_per_grid_ts``). The default: none."""
        return {}

    def prompt_text(self, text: str) -> str:
        """The templated prompt as the HF processor tokenizes it, one placeholder token per item
        (Gemma 3 widens each image marker into its start/soft/end tokens). The default: as is."""
        return text

    def expand_placeholder(
        self, modality: Modality, token_id: int, num_embeds: int, frame_times: list[float] | None
    ) -> list[int]:
        """The prompt ids one item's placeholder token becomes; its embeddings fill the runs of
        ``token_id`` in order. The default: ``num_embeds`` placeholders in one run."""
        return [token_id] * num_embeds

    def check_image_size(self, width: int, height: int) -> None:
        """Raise ``ValueError`` (a message a client can act on) for a size the processor refuses."""
        return None

    def image_decode_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The least (width, height) an image of this size needs to be decoded at for ``process_image``
        (a JPEG may then be decoded at reduced scale); None: decode at full size."""
        return None

    def process_image(self, image: DecodedImage) -> ProcessedItem:
        """``process("image", ...)`` for an image that may have been decoded at reduced scale: the
        output's grid is the one its ORIGINAL size gets. The default only takes full-size images."""
        if image.reduced:
            raise ValueError(f"{type(self).__name__} cannot process a reduced-scale decode")
        return self.process("image", image.image)
