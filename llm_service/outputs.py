"""What the engine hands back: per-step outputs, offline results, stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_service.multimodal import MultiModalInput
from llm_service.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first; empty when logprobs == 0


@dataclass
class RequestOutput:
    """New tokens of one request from one ``step()``."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class GenerateRequest:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    mm_inputs: Sequence[MultiModalInput] = ()


@dataclass
class GenerateOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks held by requests (cached-but-free blocks count as free)
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
