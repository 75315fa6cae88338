"""A request's state as it moves through the engine (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llm_service.prefix_hash import MMItemSpan
from llm_service.sampling_params import SamplingParams
from llm_service.state_cache import StateAssignment


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its computation failed in a step; the step went on for the others
    HANDED_OFF = "handoff"  # a prefill replica's: first token sampled, its KV held for a decode replica

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.HANDED_OFF,
        )


@dataclass
class Request:
    """Tokens are ``prompt_token_ids + output_token_ids``; the first ``num_computed_tokens`` of them
    have KV in the cache. A request is due a new sample when ``num_computed_tokens == num_tokens``.

    ``mm_spans`` are the media items' ``(offset, length, mm_hash)``; ``cache_salt`` separates its cached
    prefix from other salts' (vLLM's semantics). Its tensors (embeddings, positions, RNG) are not
    here: the model runner keeps them by request id (``ModelRunner.states``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    mm_spans: list[MMItemSpan] = field(default_factory=list)
    cache_salt: str | None = None  # enters the first block's hash only (llm_service/prefix_hash.py)
    # (offset, length) of prompt tokens that attend each other both ways (Gemma 3's images): the
    # scheduler never ends a chunk inside one; set by the model runner.
    attention_spans: list[tuple[int, int]] = field(default_factory=list)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # the runner's TokenLogprob | None per output token (llm_service/outputs.py): passed through here
    output_logprobs: list[object] = field(default_factory=list)
    # prompt position -> the runner's TokenLogprob of that prompt token, when its params ask
    # (``prompt_logprobs``): filled as its prefill chunks run (a recomputed chunk rewrites the same)
    prompt_logprobs: dict[int, object] = field(default_factory=dict)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in (or taken from) the prefix cache
    # ``(offset, end)`` of the media items it holds no embeddings for yet, in prompt order: sent
    # without them because their span was prefix-cached at submit (fetched if it falls out), or
    # still being encoded (they arrive one by one). Its tokens are computed up to the first of them
    # not covered by its computed prefix (``ready_end``); past that it waits (Scheduler.parked).
    missing: list[tuple[int, int]] = field(default_factory=list)
    missing_reported: bool = False  # reported once by Scheduler.take_parked, for the owner to fetch
    # time.monotonic() when it entered the engine, was first admitted to the running batch, and got
    # its first token (0.0: not yet): its queue, prefill and decode times (RequestTiming)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    # Hybrid models: where its linear-attention states live while it runs (its state-cache slot, a
    # snapshot to restore, snapshots to take; llm_service/hybrid_kv_cache_manager.py). None: no slot.
    state: StateAssignment | None = None
    # A prefill replica's request (E/P/D): it leaves the engine with its first token, ``HANDED_OFF``,
    # its blocks held until a decode replica pulls them (llm_service/kv_handoff.py)
    handoff: bool = False
    # A decode replica's request (E/P/D), its prompt's KV imported. Preempted while it holds no
    # embeddings for an item, it cannot recompute its prompt here (the decode pool never fetches
    # media): its KV is swapped to host memory and back instead (``swapped``: out, waiting to resume)
    imported: bool = False
    swapped: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def ready_end(self, start: int) -> int:
        """How far its tokens from ``start`` can be computed: to the first item without embeddings
        that ends after ``start`` (``start`` itself when inside it), else to the end."""
        for offset, end in self.missing:
            if end > start:
                return max(offset, start)
        return self.num_tokens

    @property
    def blocked(self) -> bool:
        """Running, with its next token held up by an item whose embeddings have not arrived."""
        start = self.num_computed_tokens
        return start < self.num_tokens and self.ready_end(start) == start

    def append_output(self, token_id: int, logprob: object = None) -> None:
        """Record a sampled token and set a finished status if it ends the request."""
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if token_id in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif (
            len(self.output_token_ids) >= self.sampling_params.max_tokens
            or self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
        elif self.handoff:
            self.status = RequestStatus.HANDED_OFF
