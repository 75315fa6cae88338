"""``HitPathFamily``: a model family as the ingress's hit path uses it, from ``HitPathFacts`` and the
model's tokenizer alone (no HF processor, none of transformers' image stack).

It does what ``Preprocessor`` asks of a family before any item is processed: the placeholder ids,
the settings that go into an item's mm_hash, the size check of an image header, the templated
text rewritten as the processor writes it and each placeholder expanded to its item's run(s). The
encoder's adapters (``processors/``) do the same from the loaded processor; a test per family holds
the two to the same prompt ids (tests/unit/encoder_service/preprocess/test_hit_path_facts.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from encoder_service.preprocess.hit_path_facts import DRAFT_POLICY, HitPathFacts
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.types import Modality

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


class Tokenizer(Protocol):
    """A transformers tokenizer, as the hit path renders and tokenizes a prompt with it."""

    chat_template: str | None

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, object]], **kwargs: object
    ) -> object: ...

    def convert_tokens_to_ids(self, tokens: str) -> int: ...

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Mapping[str, list[int]]: ...


class HitPathFamily:
    """``processors.base.PromptFamily`` over the record; ``hf`` is the tokenizer (it renders the chat
    template where the encoder's processor does)."""

    sampling_rate: int | None
    frame_multiple: int

    def __init__(self, facts: HitPathFacts, tokenizer: Tokenizer, limits: MediaLimits) -> None:
        self.facts = facts
        self.hf = self.tokenizer = tokenizer
        self.limits = limits
        self.modalities = facts.modalities
        self.uses_mrope = facts.uses_mrope
        self.sampling_rate = facts.sampling_rate
        self.frame_multiple = facts.frame_multiple
        self.jpeg_draft = facts.jpeg_draft
        self.placeholder_token_ids: dict[Modality, int] = {
            m: int(tokenizer.convert_tokens_to_ids(t)) for m, t in facts.placeholder_tokens.items()
        }
        runs = facts.video_runs
        self._run_ids = (
            (int(tokenizer.convert_tokens_to_ids(runs.start)), int(tokenizer.convert_tokens_to_ids(runs.end)))
            if runs is not None
            else None
        )

    def decode_kwargs(self, modality: Modality) -> dict[str, object]:
        return {"mmserve_decode": DRAFT_POLICY} if modality == "image" and self.jpeg_draft else {}

    def log_kwargs(self, modality: Modality) -> dict[str, object]:
        out = dict(self.facts.log_kwargs.get(modality, {}))
        if modality == "video":
            out.update(fps=self.limits.video_fps, num_frames=self.limits.video_num_frames)
        return out

    def check_image_size(self, width: int, height: int) -> None:
        self.facts.check_image_size(width, height)

    def prompt_text(self, text: str) -> str:
        for marker, written in self.facts.prompt_rewrites:
            text = text.replace(marker, written)
        return text

    def expand_placeholder(
        self, modality: Modality, token_id: int, num_embeds: int, frame_times: list[float] | None
    ) -> list[int]:
        runs = self.facts.video_runs
        if modality != "video" or runs is None or self._run_ids is None:
            return [token_id] * num_embeds
        if not frame_times or num_embeds % len(frame_times):
            raise ValueError(f"a Qwen3-VL video of {num_embeds} embeddings needs its frame times")
        start, end = self._run_ids
        per_patch = num_embeds // len(frame_times)
        out: list[int] = []
        for t in frame_times:
            out += self.tokenizer(runs.timestamp.format(seconds=t), add_special_tokens=False)["input_ids"]
            out += [start, *([token_id] * per_patch), end]
        return out
