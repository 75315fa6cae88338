"""The logits processors a step applies before sampling, for the whole batch at once.

Definitions and order are vLLM's: the grammar's token bitmask, ``logit_bias``, ``min_tokens`` (stop
tokens masked until enough were generated), then the penalties: ``repetition_penalty`` over the
prompt and the output (transformers' ``RepetitionPenaltyLogitsProcessor``), ``frequency_penalty`` and
``presence_penalty`` over the output only (OpenAI's definition). Each processor touches only the rows
that ask for it; a batch that asks for none costs one pass over ``params``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from llm_service.sampling_params import SamplingParams


class RowTokens(Protocol):
    """What the penalties and ``min_tokens`` read of a sampling row's request (a ``Request`` is one)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def stop_token_ids(self) -> frozenset[int]: ...


@dataclass
class GrammarMasks:
    """Packed token bitmasks (xgrammar's layout: bit ``t % 32`` of int32 word ``t // 32`` allows
    token ``t``) for the rows in ``rows``; the other rows of ``bitmask`` are unused."""

    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32
    rows: list[int]


_BIT = None  # the 32 bit positions, built on first use


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (True: allowed)."""
    global _BIT
    if _BIT is None:
        _BIT = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)
    bits = (words.unsqueeze(-1) & _BIT.to(words.device)) != 0
    return bits.flatten(1)[:, :vocab_size]


def apply_grammar(logits: torch.Tensor, masks: GrammarMasks) -> None:
    rows = torch.tensor(masks.rows, device=logits.device)
    allowed = unpack_bitmask(masks.bitmask[rows].to(logits.device), logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, ids, vals = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            rows.append(i)
            ids.append(t)
            vals.append(b)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(
            index, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True
        )


def apply_min_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], ctx: Sequence[RowTokens]
) -> None:
    """Mask the stop tokens of rows below their ``min_tokens``, unless that leaves no token at all
    (a grammar that allows only a stop token: the grammar wins)."""
    for i, p in enumerate(params):
        if p.min_tokens and len(ctx[i].output_token_ids) < p.min_tokens and ctx[i].stop_token_ids:
            stops = torch.tensor(sorted(ctx[i].stop_token_ids), device=logits.device)
            row = logits[i].index_fill(0, stops, float("-inf"))
            if bool(torch.isfinite(row).any()):
                logits[i] = row


def _padded(lists: list[list[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), fill, dtype=torch.long)
    for r, x in enumerate(lists):
        if x:
            out[r, : len(x)] = torch.tensor(x, dtype=torch.long)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], ctx: Sequence[RowTokens]) -> None:
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    n, vocab, dev = len(rows), logits.shape[1], logits.device
    sub = logits[rows]
    out_ids = _padded([ctx[i].output_token_ids for i in rows], vocab, dev)
    counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(
        1, out_ids, torch.ones_like(out_ids, dtype=torch.float)
    )
    counts = counts[:, :vocab]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=sub.dtype, device=dev)
    if bool((rep != 1.0).any()):
        prompt_ids = _padded([ctx[i].prompt_token_ids for i in rows], vocab, dev)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev).scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        r = rep.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=sub.dtype, device=dev)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=sub.dtype, device=dev)
    sub = sub - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    ctx: Sequence[RowTokens] | None,
    grammar: GrammarMasks | None = None,
) -> torch.Tensor:
    """``logits`` (float32, a copy when anything applies) with every row's processors applied."""
    if grammar is None and not any(p.processed for p in params):
        return logits
    logits = logits.clone()
    if grammar is not None and grammar.rows:
        apply_grammar(logits, grammar)
    apply_logit_bias(logits, params)
    if ctx is not None:
        apply_min_tokens(logits, params, ctx)
        apply_penalties(logits, params, ctx)
    return logits
