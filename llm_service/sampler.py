"""Turn the last-token logits of each sampling request into a token (and logprobs)."""

from __future__ import annotations

import torch

from llm_service.outputs import TokenLogprob
from llm_service.sampling_params import SamplingParams


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
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [S, vocab], one row per sampling request
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[TokenLogprob | None]]:
    logits = logits.float()
    tokens: list[int] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        filtered = _filter(row / p.temperature, p.top_k, p.top_p)
        probs = filtered.softmax(-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1).cpu()
        for row, i in zip(lp, want, strict=True):
            n = params[i].logprobs or 0
            top = torch.topk(row, n) if n else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(row[tokens[i]]),
                top=[(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)] if top else [],
            )
    return tokens, logprobs
