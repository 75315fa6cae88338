"""What the engine hands back: per-step outputs, offline results, stats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_service.multimodal import MultiModalInput
from llm_service.sampling_params import SamplingParams
from mmcore.wire import pack, unpack


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first; empty when logprobs == 0


@dataclass(frozen=True)
class RequestTiming:
    """Where a finished request's time in the engine went, in seconds."""

    queue: float  # from entering the engine to its first admission to the running batch
    prefill: float  # from that admission to its first token (chunks, and preemptions, included)
    decode: float  # from its first token to its last


@dataclass
class RequestOutput:
    """New tokens of one request from one ``step()``."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # set iff finish_reason == "error": what failed (this request only)
    # on its first output, when its params asked: prompt tokens 1.. (the first has none), in order
    prompt_logprobs: list[TokenLogprob] | None = None
    # on a request's last output from its engine, for the replica's metrics; not sent over the wire
    timing: RequestTiming | None = None
    # a seeded request's first output on a prefill replica (``finish_reason="handoff"``): its
    # generator's state after that token (``torch.Generator.get_state``), which the decode replica
    # resumes from, so its later tokens are a colocated pool's (llm_service/kv_handoff.py)
    rng_state: bytes | None = None

    def __reduce__(self) -> tuple[Callable[[bytes], RequestOutput], tuple[bytes]]:
        return (_request_output_from_bytes, (self.to_wire(),))

    def to_wire(self) -> bytes:
        """Its versioned msgpack form (``from_wire`` reads it); ``timing`` stays behind."""
        logprobs = _logprobs_wire(self.new_logprobs)
        fields: dict[str, object] = {
            "request_id": self.request_id,
            "new_token_ids": list(self.new_token_ids),
            "new_logprobs": logprobs,
            "finished": self.finished,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "error": self.error,
            "prompt_logprobs": _logprobs_wire(self.prompt_logprobs),
        }
        if self.rng_state is not None:  # a hand-off's only: no key on the other outputs
            fields["rng_state"] = self.rng_state
        return pack("RequestOutput", fields)

    @staticmethod
    def from_wire(raw: bytes) -> RequestOutput:
        return _request_output_from_bytes(raw)


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
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


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
    # what an E/P/D import needs besides blocks, where the model has it (router.routing.decode_choice)
    num_free_window_blocks: int | None = None  # a sliding-window family's window group
    num_free_state_slots: int | None = None  # a hybrid family's linear-attention state slots

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def _logprobs_wire(logprobs: list[TokenLogprob] | None) -> list[list[object]] | None:
    if logprobs is None:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]


def _logprobs_from_wire(logprobs: list[Any] | None) -> list[TokenLogprob] | None:  # Any: msgpack's
    if logprobs is None:
        return None
    return [TokenLogprob(int(t), float(lp), [(int(a), float(b)) for a, b in top]) for t, lp, top in logprobs]


def _request_output_from_bytes(raw: bytes) -> RequestOutput:
    d = unpack("RequestOutput", raw)
    return RequestOutput(
        request_id=d["request_id"],
        new_token_ids=[int(t) for t in d["new_token_ids"]],
        new_logprobs=_logprobs_from_wire(d["new_logprobs"]),
        finished=bool(d["finished"]),
        finish_reason=d["finish_reason"],
        num_prompt_tokens=int(d["num_prompt_tokens"]),
        num_cached_tokens=int(d["num_cached_tokens"]),
        error=d.get("error"),
        prompt_logprobs=_logprobs_from_wire(d.get("prompt_logprobs")),
        rng_state=d.get("rng_state"),
    )
