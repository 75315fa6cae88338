"""Turn the last-token logits of each sampling request into a token (and logprobs), for the whole
step in tensor operations.

Numerically safe for every parameter ``SamplingParams.validate`` accepts: temperatures below
``SAMPLING_EPS`` are greedy, the others scale logits already shifted so their maximum is 0 (no
overflow, the top token weighs exactly 1). A row the model filled with NaN or +inf (or only -inf) has
no meaningful token: ``NonFiniteLogits`` names those rows instead of sampling junk.

The step's parameters are read as tensors from a ``SamplingBatch`` (reused while the batch's requests
stay the same); the processors (``logits_processors``) touch only the rows that ask for them; greedy
rows take the argmax of their (processed) logits, the others draw (``draw``: temperature, min-p,
top-k, top-p by rejection, one uniform per row and round from the row's generator).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from llm_service.draw import apply_floors, draw, top_p_mask, weights
from llm_service.logits_processors import GrammarMasks, RowTokens, process_logits
from llm_service.output_counts import OutputCounts
from llm_service.outputs import TokenLogprob
from llm_service.sampling_batch import SamplingBatch
from llm_service.sampling_params import SamplingParams


class SamplerState:
    """What the sampler keeps from step to step for one engine: the last step's ``SamplingBatch``
    (reused while the batch's parameter objects stay the same) and the penalties' ``OutputCounts``
    by request id. ``release`` a request when it leaves."""

    def __init__(self) -> None:
        self.batch: SamplingBatch | None = None
        self.counts: OutputCounts | None = None

    def release(self, key: Hashable) -> None:
        if self.counts is not None:
            self.counts.release(key)


class NonFiniteLogits(RuntimeError):
    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"the model produced NaN or infinite logits in rows {rows}")
        self.rows = rows


class NoAllowedToken(RuntimeError):
    """Rows whose processors (a grammar's mask, above all) left no token to sample."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"no token is allowed in rows {rows}")
        self.rows = rows


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits naming each row with a NaN, a +inf, or no finite value at all."""
    if math.isfinite(float(logits.sum())):  # the common case in one pass (a NaN or inf sums to one)
        return
    bad = logits.isnan().any(-1) | ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        raise NonFiniteLogits(bad.nonzero().flatten().tolist())


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``min_p``, ``top_k``, ``top_p`` on temperature-scaled rows ``x`` (every row one that draws),
    masked to -inf: the sampler's own floors, and top-p's whole definition (``top_p_mask``; the
    sampler draws it by rejection)."""
    batch = SamplingBatch.build(params, x.shape[1], x.device)
    assert len(batch.random) == len(params), "_filter takes rows that draw"
    w = weights(x, torch.ones(1))
    floored = w.clone()
    if batch.floors is not None:
        apply_floors(floored, batch.floors)
    x = x.masked_fill((floored == 0) & (w > 0), float("-inf"))
    return x if batch.top_p is None else top_p_mask(x, batch.top_p)


def sample(
    logits: torch.Tensor,  # [S, vocab], one row per sampling request
    params: list[SamplingParams],
    generators: list[torch.Generator],
    ctx: Sequence[RowTokens] | None = None,
    grammar: GrammarMasks | None = None,
    state: SamplerState | None = None,
    keys: Sequence[Hashable] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """``ctx``: each row's tokens, for the penalties and ``min_tokens`` (needed when a row asks for
    them); ``grammar``: the bitmasks of rows with a structured output; ``state`` and ``keys`` (the
    rows' request ids): what an engine keeps between steps (without them it is built for this call)."""
    raw = logits.float()
    check_finite(raw)
    batch = SamplingBatch.reuse(state.batch if state else None, params, raw.shape[1], raw.device)
    counts = None
    if state is not None:
        state.batch = batch
        if batch.penalties is not None and keys is not None:
            if state.counts is None:
                state.counts = OutputCounts(raw.shape[1], raw.device)
            counts = state.counts
    x = process_logits(raw, params, ctx, grammar, batch, counts, keys)
    if x is not raw and not math.isfinite(float(x.amax(-1).min())):
        dead = ~torch.isfinite(x.amax(-1))
        raise NoAllowedToken(dead.nonzero().flatten().tolist())
    if not batch.random:
        out = argmax(x)
    elif not batch.greedy:
        out = draw(x, batch, generators)
    else:
        out = [0] * len(params)
        greedy = argmax(x, batch.greedy_index, batch.greedy)
        for i, t in zip(batch.greedy, greedy, strict=True):
            out[i] = t
        for i, t in zip(batch.random, draw(x, batch, generators), strict=True):
            out[i] = t
    return out, _logprobs(raw, params, out)


def argmax(x: torch.Tensor, index: torch.Tensor | None = None, rows: list[int] | None = None) -> list[int]:
    """The index of the first largest value of each row of ``x`` (of ``rows``, ``index`` as a tensor,
    when given). On CPU through numpy, whose argmax is vectorised where torch's CPU kernel is not
    (~4 vs ~50 us at 32 x 1,024 here); the same index either way."""
    if x.device.type == "cpu":
        a = x.detach().numpy()
        return (a if rows is None else a[rows]).argmax(-1).tolist()  # type: ignore[no-any-return]
    return (x if index is None else x.index_select(0, index)).argmax(-1).tolist()  # type: ignore[no-any-return]


def _logprobs(
    raw: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprob | None]:
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # Clamped so a -inf (a logit ~1e38 below the max) still serialises as a JSON number.
        lp = torch.log_softmax(raw[want], dim=-1).clamp_min(torch.finfo(torch.float32).min).cpu()
        for row, i in zip(lp, want, strict=True):
            n = params[i].logprobs or 0
            top = torch.topk(row, n) if n else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(row[tokens[i]]),
                top=[(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)] if top else [],
            )
    return logprobs


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` scores ``targets[i]`` (the prompt's next token): its logprob and the
    top-``k``, from the raw distribution as a sampled token's are."""
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_min(torch.finfo(torch.float32).min)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    top = torch.topk(lp, k, dim=-1) if k else None
    values, indices = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    return [
        TokenLogprob(t, float(v), list(zip(indices[i], values[i], strict=True)) if top is not None else [])
        for i, (t, v) in enumerate(zip(targets, chosen, strict=True))
    ]
