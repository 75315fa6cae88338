"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from llm_service.errors import RequestRejected

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature gives the argmax's one-hot distribution anyway, minus the numerical hazards.
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts: [lo, hi)


class SamplingParamsWire(TypedDict):
    """``SamplingParams`` as it travels in a request's msgpack (``stop_token_ids`` a list)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy. ``top_k`` of -1 or 0 is off.
    ``logprobs``: None returns none, 0 the sampled token's logprob only, N adds the top-N. Logprobs
    come from the model's raw distribution (log_softmax of the logits, before temperature/top-k/top-p).
    ``seed`` makes a request's samples reproducible regardless of what else is in the batch."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self) -> None:
        """Raise RequestRejected(code="bad_sampling_params") naming every bad field."""
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            problems.append(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if problems:
            raise RequestRejected("bad_sampling_params", "; ".join(problems))

    def to_wire(self) -> SamplingParamsWire:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_wire(cls, d: SamplingParamsWire) -> SamplingParams:
        return cls(
            max_tokens=int(d["max_tokens"]),
            temperature=float(d["temperature"]),
            top_p=float(d["top_p"]),
            top_k=int(d["top_k"]),
            seed=d["seed"],
            stop_token_ids=tuple(int(t) for t in d["stop_token_ids"]),
            ignore_eos=bool(d["ignore_eos"]),
            logprobs=d["logprobs"],
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
