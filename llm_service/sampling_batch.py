"""A step's sampling parameters as tensors and row lists, built once per distinct batch (vLLM's
``SamplingMetadata``): the sampler and the logits processors read them instead of walking
``SamplingParams`` each step.

Decode batches repeat: the same requests, with the same ``SamplingParams`` objects, step after step.
``SamplingBatch.reuse`` returns the previous batch when every row holds the very same parameter
object (an identity check, 32 ``is`` for 32 rows), else builds a new one. The batch keeps its rows'
parameter objects alive, so no id it compared can have been reused by another object.

Row lists are the batch's rows; the per-stage tensors are indexed as their stage's rows:
``temperature``, ``top_p`` and ``nucleus`` over ``random`` (rows that draw), the penalty
columns over ``penalized``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llm_service.sampling_params import SamplingParams


@dataclass(frozen=True)
class Floors:
    """``min_p`` and ``top_k`` on the random rows that ask for either (``rows`` index
    ``SamplingBatch.random``'s tensors): a token survives when its weight reaches the row's floor,
    ``min_p`` (the top weight is 1) or the k-th largest weight, whichever is higher."""

    rows: torch.Tensor  # [n] long
    min_p: torch.Tensor | None  # [n, 1], 0 where off; None: no row has a min_p
    k_index: torch.Tensor  # [n, 1] long: k - 1, or 0 where off
    has_k: torch.Tensor | None  # [n, 1] float: 1 where the row has a top_k; None: every row has one
    max_k: int  # 0: no row has a top_k


@dataclass(frozen=True)
class TopP:
    """Each random row's ``top_p`` (indexed as ``SamplingBatch.random``), ``inf`` where it is 1: a
    bound no token's heavier mass reaches."""

    scale: torch.Tensor  # [len(random)]


@dataclass(frozen=True)
class Penalties:
    """The penalty columns of the ``penalized`` rows (``None``: no row in the batch uses it)."""

    rows: torch.Tensor  # ``SamplingBatch.penalized`` as a tensor
    repetition: torch.Tensor | None  # [n, 1]
    frequency: torch.Tensor | None  # [n, 1]
    presence: torch.Tensor | None  # [n, 1]


@dataclass(frozen=True)
class LogitBias:
    """Every row's bias as one sparse accumulate: ``logits[rows, ids] += values``."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class SamplingBatch:
    params: tuple[SamplingParams, ...]
    device: torch.device
    vocab: int
    greedy: list[int]  # rows that take the argmax
    random: list[int]  # rows that draw
    greedy_index: torch.Tensor  # ``greedy`` as a tensor
    random_index: torch.Tensor  # ``random`` as a tensor
    temperature: torch.Tensor  # [len(random), 1]
    top_p: torch.Tensor | None  # [len(random)]; None: no random row has top_p < 1
    nucleus: TopP | None  # the rows that check a nucleus
    floors: Floors | None  # min_p and top_k; None: no random row has either
    bias: LogitBias | None
    min_tokens: list[int]  # rows with a min_tokens (whether it still holds is a per-step question)
    penalized: list[int]
    penalties: Penalties | None
    processed: bool  # some row has a processor (bias, min_tokens, penalties, a grammar)

    @classmethod
    def reuse(
        cls, last: SamplingBatch | None, params: Sequence[SamplingParams], vocab: int, device: torch.device
    ) -> SamplingBatch:
        """``last`` when it was built for these very parameter objects, else a new batch."""
        if (
            last is not None
            and last.vocab == vocab
            and last.device == device
            and len(last.params) == len(params)
            and all(a is b for a, b in zip(last.params, params, strict=True))
        ):
            return last
        return cls.build(params, vocab, device)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> SamplingBatch:
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        drawn = [params[i] for i in random]
        top_p = [p.top_p for p in drawn]
        nucleus = any(p < 1.0 for p in top_p)
        penalized = [i for i, p in enumerate(params) if p.penalized]
        return cls(
            params=tuple(params),
            device=device,
            vocab=vocab,
            greedy=greedy,
            random=random,
            greedy_index=torch.tensor(greedy, dtype=torch.long, device=device),
            random_index=torch.tensor(random, dtype=torch.long, device=device),
            temperature=_column([p.temperature for p in drawn], device),
            top_p=torch.tensor(top_p, device=device) if nucleus else None,
            nucleus=_nucleus(top_p, device) if nucleus else None,
            floors=_floors(drawn, vocab, device),
            bias=_bias(params, device),
            min_tokens=[i for i, p in enumerate(params) if p.min_tokens],
            penalized=penalized,
            penalties=_penalties(params, penalized, device),
            processed=any(p.processed for p in params),
        )


_TINY = float(torch.finfo(torch.float32).tiny)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _nucleus(top_p: list[float], device: torch.device) -> TopP:
    # At least float32's smallest normal: a top_p that would round to 0 still bounds above 0, so the
    # top token (nothing heavier) is always kept.
    scale = [max(p, _TINY) if p < 1.0 else float("inf") for p in top_p]
    return TopP(torch.tensor(scale, dtype=torch.float32, device=device))


def _floors(drawn: list[SamplingParams], vocab: int, device: torch.device) -> Floors | None:
    top_k = [p.top_k if 1 < p.top_k < vocab else 0 for p in drawn]
    rows = [j for j, p in enumerate(drawn) if p.min_p > 0 or top_k[j]]
    if not rows:
        return None
    min_p = [drawn[j].min_p for j in rows]
    return Floors(
        torch.tensor(rows, device=device),
        _column(min_p, device) if any(min_p) else None,
        torch.tensor([max(top_k[j] - 1, 0) for j in rows], device=device).unsqueeze(1),
        None if all(top_k[j] for j in rows) else _column([float(top_k[j] > 0) for j in rows], device),
        max(top_k),
    )


def _bias(params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not entries:
        return None
    rows, ids, values = zip(*entries, strict=True)
    return LogitBias(
        torch.tensor(rows, device=device),
        torch.tensor(ids, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _penalties(
    params: Sequence[SamplingParams], penalized: list[int], device: torch.device
) -> Penalties | None:
    if not penalized:
        return None
    rows = [params[i] for i in penalized]
    rep = [p.repetition_penalty for p in rows]
    freq = [p.frequency_penalty for p in rows]
    pres = [p.presence_penalty for p in rows]
    return Penalties(
        torch.tensor(penalized, device=device),
        _column(rep, device) if any(r != 1.0 for r in rep) else None,
        _column(freq, device) if any(freq) else None,
        _column(pres, device) if any(pres) else None,
    )
