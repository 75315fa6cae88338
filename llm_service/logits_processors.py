"""The logits processors a step applies before sampling, for the whole batch at once.

Definitions and order are vLLM's: the grammar's token bitmask, ``logit_bias``, ``min_tokens`` (stop
tokens masked until enough were generated), then the penalties: ``repetition_penalty`` over the
prompt and the output (transformers' ``RepetitionPenaltyLogitsProcessor``), ``frequency_penalty`` and
``presence_penalty`` over the output only (OpenAI's definition). Each processor touches only the rows
that ask for it, from the step's ``SamplingBatch`` (its tensors built once per distinct batch): bias
is one sparse accumulate, ``min_tokens`` one sparse fill, the penalties read token counts kept across
steps (``OutputCounts``). A batch that asks for none returns the logits untouched.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from llm_service.output_counts import OutputCounts, RowTokens
from llm_service.sampling_batch import SamplingBatch
from llm_service.sampling_params import SamplingParams


@dataclass
class GrammarMasks:
    """Packed token bitmasks (xgrammar's layout: bit ``t % 32`` of int32 word ``t // 32`` allows
    token ``t``) for the rows in ``rows``; the other rows of ``bitmask`` are unused."""

    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32
    rows: list[int]


# byte value -> its 8 bits as additive logits (0: allowed, -inf: not), least significant bit first
_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}


def bitmask_bias(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 packed bitmask -> [R, vocab_size] float: 0 where allowed, -inf where not. One
    table lookup per byte of the mask (little-endian: byte ``t // 8`` holds token ``t`` at bit
    ``t % 8``), several times cheaper on CPU than unpacking bits into a bool mask and filling."""
    table = _BYTE_BIAS.get(words.device)
    if table is None:
        bits = [[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)]
        table = _BYTE_BIAS[words.device] = torch.tensor(bits, device=words.device)
    as_bytes = words.contiguous().view(torch.uint8).long()
    return torch.nn.functional.embedding(as_bytes, table).view(words.shape[0], -1)[:, :vocab_size]


def apply_grammar(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Add each grammar row's bias (``bitmask_bias``): ``x + 0`` is ``x`` and ``x - inf`` is -inf."""
    vocab = logits.shape[1]
    if len(masks.rows) == logits.shape[0] == masks.bitmask.shape[0]:  # every row: no gather
        logits += bitmask_bias(masks.bitmask.to(logits.device), vocab)
        return
    rows = torch.tensor(masks.rows, device=logits.device)
    words = masks.bitmask.to(logits.device).index_select(0, rows)
    logits.index_copy_(0, rows, logits.index_select(0, rows) + bitmask_bias(words, vocab))


def apply_min_tokens(
    logits: torch.Tensor, batch: SamplingBatch, ctx: Sequence[RowTokens], grammar: bool
) -> None:
    """Mask the stop tokens of rows below their ``min_tokens``, unless that leaves a row no token at
    all (a ``grammar`` that allows only a stop token: the grammar wins; without one, finite logits
    always keep a token that is not a stop token)."""
    rows: list[int] = []
    ids: list[int] = []
    for i in batch.min_tokens:
        row = ctx[i]
        if len(row.output_token_ids) < batch.params[i].min_tokens and row.stop_token_ids:
            rows.extend([i] * len(row.stop_token_ids))
            ids.extend(row.stop_token_ids)
    if not rows:
        return
    index = torch.tensor([rows, ids], device=logits.device).unbind()
    saved = logits[index] if grammar else None
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
    if saved is None:
        return
    touched = sorted(set(rows))
    dead = ~torch.isfinite(logits[touched].amax(-1))
    if bool(dead.any()):
        dead_rows = {touched[j] for j in dead.nonzero().flatten().tolist()}
        back = torch.tensor([r in dead_rows for r in rows], device=logits.device)
        logits.index_put_((index[0][back], index[1][back]), saved[back])


def apply_penalties(
    logits: torch.Tensor,
    batch: SamplingBatch,
    ctx: Sequence[RowTokens],
    counts: OutputCounts | None,
    keys: Sequence[Hashable] | None,
) -> None:
    """The penalized rows' repetition, frequency and presence penalties, from ``counts`` (kept across
    steps under ``keys``, the rows' request ids) or, without it, from each row's whole output."""
    pen = batch.penalties
    if pen is None:
        return
    rows = batch.penalized
    row_keys: list[Hashable] = list(rows)
    if counts is None or keys is None:
        counts = OutputCounts(logits.shape[1], logits.device)
    else:
        row_keys = [keys[i] for i in rows]
    out, seen = counts.rows(row_keys, [ctx[i] for i in rows], pen.repetition is not None)
    sub = logits.index_select(0, pen.rows)
    if pen.repetition is not None:
        assert seen is not None
        # The divisor is the row's penalty where a token was seen, exactly 1 elsewhere; only one of
        # the two terms is nonzero, so each logit is transformers' x / r or x * r to the bit.
        d = torch.addcmul(1.0 - seen, seen, pen.repetition)
        sub = sub.clamp_min(0.0).div_(d).add_(sub.clamp_max(0.0).mul_(d))
    if pen.frequency is not None:
        sub = sub.addcmul_(out, pen.frequency, value=-1.0)
    if pen.presence is not None:
        sub = sub.addcmul_(out.sign(), pen.presence, value=-1.0)
    logits.index_copy_(0, pen.rows, sub)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    ctx: Sequence[RowTokens] | None,
    grammar: GrammarMasks | None = None,
    batch: SamplingBatch | None = None,
    counts: OutputCounts | None = None,
    keys: Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """``logits`` (float32, a copy when anything applies) with every row's processors applied;
    ``batch``: ``params`` as tensors (built here when not given)."""
    if batch is None:
        batch = SamplingBatch.build(params, logits.shape[1], logits.device)
    if grammar is None and not batch.processed:
        return logits
    logits = logits.clone()
    if grammar is not None and grammar.rows:
        apply_grammar(logits, grammar)
    if batch.bias is not None:
        logits.index_put_((batch.bias.rows, batch.bias.ids), batch.bias.values, accumulate=True)
    if ctx is not None:
        apply_min_tokens(logits, batch, ctx, grammar is not None)
        apply_penalties(logits, batch, ctx, counts, keys)
    return logits
