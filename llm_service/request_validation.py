"""The checks a request passes before the engine queues it (``RequestRejected`` naming what is wrong):
its prompt against the model's limits and the KV pool, the token ids its sampling parameters name,
its media items' ranges, embeddings' shapes and M-RoPE grids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_service.errors import RequestRejected
from llm_service.kv_cache_manager import cdiv

if TYPE_CHECKING:
    from llm_service.config import EngineConfig
    from llm_service.kv_cache_manager import KVCacheManager
    from llm_service.models.qwen2 import TextConfig
    from llm_service.multimodal import MultiModalInput
    from llm_service.sampling_params import SamplingParams

MODALITIES = ("image", "video", "audio")


def validate_prompt(
    prompt: list[int], params: SamplingParams, c: EngineConfig, vocab_size: int, kv: KVCacheManager
) -> None:
    """The prompt is non-empty, within ``max_model_len`` and the vocabulary, and the pool can ever hold it
    with ``max_tokens`` more."""
    if not prompt:
        raise RequestRejected("prompt_too_long", "the prompt is empty")
    if len(prompt) > c.max_model_len:
        raise RequestRejected(
            "prompt_too_long",
            f"prompt has {len(prompt)} tokens, more than max_model_len={c.max_model_len}",
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected("bad_prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    # KV is needed for every token but the last sampled one.
    peak = min(len(prompt) + params.max_tokens - 1, c.max_model_len)
    if not kv.can_ever_fit(peak):
        raise RequestRejected(
            "too_many_blocks",
            f"prompt + max_tokens need {cdiv(peak, c.block_size)} KV blocks of {c.block_size} tokens; "
            f"the pool has {kv.num_total_blocks}",
        )


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """``logit_bias`` and ``stop_token_ids`` name tokens of this model's vocabulary."""
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", list(params.stop_token_ids)),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(
                "bad_sampling_params",
                f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                param=name,
            )


def validate_mm(
    num_tokens: int,
    items: list[MultiModalInput],
    mm_row_width: int,
    text_config: TextConfig,
    uses_mrope: bool,
) -> None:
    """Media items (sorted by offset) of known modality, of ``mm_row_width``-wide embedding rows where given,
    inside the prompt and not overlapping; for M-RoPE, of a ``grid_thw`` that gives their length."""
    prev_end, prev_name = 0, ""
    for i, m in enumerate(items):
        name = f"{m.modality} item {i} (mm_hash={m.mm_hash!r}, offset={m.offset})"
        if m.modality not in MODALITIES:
            raise RequestRejected("bad_mm_input", f"{name}: unknown modality {m.modality!r}")
        if m.embeddings is not None and (
            m.embeddings.dim() != 2 or tuple(m.embeddings.shape) != (m.length, mm_row_width)
        ):
            raise RequestRejected(
                "bad_mm_input",
                f"{name}: embeddings have shape {tuple(m.embeddings.shape)}, "
                f"expected [{m.length}, {mm_row_width}]",
            )
        if m.length == 0 or m.offset < 0 or m.end > num_tokens:
            raise RequestRejected(
                "bad_mm_input",
                f"{name}: range [{m.offset}, {m.end}) is empty or outside the prompt of {num_tokens}",
            )
        if m.offset < prev_end:
            raise RequestRejected("bad_mm_input", f"{name}: overlaps {prev_name}")
        prev_end, prev_name = m.end, name
        if uses_mrope:
            _validate_grid(name, m, text_config)


def _validate_grid(name: str, m: MultiModalInput, text_config: TextConfig) -> None:
    if m.modality == "audio":
        raise RequestRejected(
            "bad_mm_input", f"{name}: this model ({text_config.architecture}) takes no audio"
        )
    merge = text_config.spatial_merge_size
    if m.grid_thw is None or len(m.grid_thw) != 3:
        raise RequestRejected("bad_mm_input", f"{name}: grid_thw (t, h, w) is required for M-RoPE")
    t, h, w = m.grid_thw
    if h % merge or w % merge or t * h * w // merge**2 != m.length:
        raise RequestRejected(
            "bad_mm_input",
            f"{name}: grid_thw={m.grid_thw} gives {t * h * w // merge**2} embeddings, got {m.length}",
        )
