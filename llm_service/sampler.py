"""Turn the last-token logits of each sampling request into a token (and logprobs).

Numerically safe for every parameter ``SamplingParams.validate`` accepts: temperatures below
``SAMPLING_EPS`` are greedy, the others scale logits already shifted so their maximum is 0 (no
overflow, at least one probability is 1 before normalising). A row the model filled with NaN or +inf
(or only -inf) has no meaningful token: ``NonFiniteLogits`` names those rows instead of sampling junk.
"""

from __future__ import annotations

import torch

from llm_service.outputs import TokenLogprob
from llm_service.sampling_params import SamplingParams


class NonFiniteLogits(RuntimeError):
    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"the model produced NaN or infinite logits in rows {rows}")
        self.rows = rows


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of a 1-D logits row."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # even when top_p rounds to 0 in float32 (a subnormal top_p)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits naming each row with a NaN, a +inf, or no finite value at all."""
    if bool(torch.isfinite(logits).all()):  # the common case: no NaN, no inf at all
        return
    bad = logits.isnan().any(-1) | ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        raise NonFiniteLogits(bad.nonzero().flatten().tolist())


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scaled = (row - row.max()) / p.temperature  # <= 0 everywhere, exactly 0 at the argmax
    probs = _filter(scaled, p.top_k, p.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(
    logits: torch.Tensor,  # [S, vocab], one row per sampling request
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[TokenLogprob | None]]:
    logits = logits.float()
    check_finite(logits)
    greedy = logits.argmax(-1).tolist()
    tokens = [
        greedy[i] if p.greedy else _sample_row(row, p, gen)
        for i, (row, p, gen) in enumerate(zip(logits, params, generators, strict=True))
    ]
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # Clamped so a -inf (a logit ~1e38 below the max) still serialises as a JSON number.
        lp = torch.log_softmax(logits[want], dim=-1).clamp_min(torch.finfo(torch.float32).min).cpu()
        for row, i in zip(lp, want, strict=True):
            n = params[i].logprobs or 0
            top = torch.topk(row, n) if n else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(row[tokens[i]]),
                top=[(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)] if top else [],
            )
    return tokens, logprobs
