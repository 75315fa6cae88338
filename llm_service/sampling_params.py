"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from llm_service.errors import RequestRejected
from llm_service.structured.spec import StructuredSpec

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature gives the argmax's one-hot distribution anyway, minus the numerical hazards.
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts: [lo, hi)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_STOP_TOKEN_IDS = 64


class SamplingParamsWire(TypedDict, total=False):
    """``SamplingParams`` as it travels in a request's msgpack (tuples as lists)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    min_p: float
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: list[list[float]]
    structured: list[str] | None
    prompt_logprobs: int | None


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy. ``top_k`` of -1 or 0 is off.
    ``logprobs``: None returns none, 0 the sampled token's logprob only, N adds the top-N. Logprobs
    come from the model's raw distribution (log_softmax of the logits, before any processing).
    ``seed`` makes a request's samples reproducible regardless of what else is in the batch.

    The logits processors, as vLLM defines them (and in its order: the grammar's mask, ``logit_bias``,
    ``min_tokens``, then the penalties, then temperature, ``min_p``, ``top_k``, ``top_p``):
    ``presence_penalty``/``frequency_penalty`` subtract per generated token (present / count);
    ``repetition_penalty`` divides positive (multiplies negative) logits of every token in the prompt
    or the output (transformers' ``RepetitionPenaltyLogitsProcessor``); ``min_tokens`` masks the stop
    tokens until that many were generated; ``min_p`` drops tokens whose probability is below
    ``min_p`` times the top one's; ``structured``: the output must match that grammar."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structured: StructuredSpec | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Raise RequestRejected(code="bad_sampling_params") naming every bad field."""
        problems = [*self._basic_problems(), *self._processor_problems()]
        if problems:
            raise RequestRejected("bad_sampling_params", "; ".join(problems))

    def _basic_problems(self) -> list[str]:
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            problems.append(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        return problems

    def _processor_problems(self) -> list[str]:
        problems = []
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                problems.append(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            problems.append(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            problems.append(f"logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
        lo, hi = LOGIT_BIAS_RANGE
        bad = [(t, b) for t, b in self.logit_bias if t < 0 or not (math.isfinite(b) and lo <= b <= hi)]
        if bad:
            problems.append(f"logit_bias entry {bad[0]}: ids must be >= 0 and biases in [{lo}, {hi}]")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, each >= 0")
        return problems

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
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [[t, b] for t, b in self.logit_bias],
            "structured": None if self.structured is None else self.structured.to_wire(),
            "prompt_logprobs": self.prompt_logprobs,
        }

    @classmethod
    def from_wire(cls, d: SamplingParamsWire) -> SamplingParams:
        structured = d.get("structured")
        return cls(
            max_tokens=int(d["max_tokens"]),
            temperature=float(d["temperature"]),
            top_p=float(d["top_p"]),
            top_k=int(d["top_k"]),
            seed=d["seed"],
            stop_token_ids=tuple(int(t) for t in d["stop_token_ids"]),
            ignore_eos=bool(d["ignore_eos"]),
            logprobs=d["logprobs"],
            min_p=float(d.get("min_p", 0.0)),
            min_tokens=int(d.get("min_tokens", 0)),
            presence_penalty=float(d.get("presence_penalty", 0.0)),
            frequency_penalty=float(d.get("frequency_penalty", 0.0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            logit_bias=tuple((int(t), float(b)) for t, b in d.get("logit_bias", ())),
            structured=None if structured is None else StructuredSpec.from_wire(structured),
            prompt_logprobs=d.get("prompt_logprobs"),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether any processor changes its logits before the greedy argmax (a grammar, bias,
        min_tokens or a penalty); a greedy request without one takes the raw argmax."""
        return bool(self.structured or self.logit_bias or self.min_tokens or self.penalized)
