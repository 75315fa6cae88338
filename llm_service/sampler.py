"""Turn the last-token logits of each sampling request into a token (and logprobs), for the whole
step in tensor operations.

Numerically safe for every parameter ``SamplingParams.validate`` accepts: temperatures below
``SAMPLING_EPS`` are greedy, the others scale logits already shifted so their maximum is 0 (no
overflow, at least one probability is 1 before normalising). A row the model filled with NaN or +inf
(or only -inf) has no meaningful token: ``NonFiniteLogits`` names those rows instead of sampling junk.

Greedy rows without processors take the raw logits' argmax. Random rows draw by inverse CDF, one
uniform per row and round: a seeded request draws from its own generator, so its tokens do not depend
on the batch around it; the others share one generator. ``min_p`` and ``top_k`` mask the row first;
``top_p`` is a rejection loop rather than a sort: draw from the row, keep the token when the mass of
the tokens more likely than it is below ``top_p`` (it is in the nucleus), else draw again among the
tokens more likely than the one drawn (still a superset of the nucleus). Given acceptance the token is
distributed as the renormalised nucleus, whatever round accepts it; rows still drawing after
``TOP_P_ROUNDS`` take the sorted nucleus (``_top_p``) and one more draw. Tokens tied with a token at
the nucleus' edge are kept with it. Per step that is a few passes over the vocabulary, not a sort and
one exponential per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_service.logits_processors import GrammarMasks, RowTokens, process_logits
from llm_service.outputs import TokenLogprob
from llm_service.sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024  # top-p looks at this many tokens first (a partial sort), the rest only if it must
TOP_P_ROUNDS = 8  # rejection rounds before a row's nucleus is sorted


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
    if bool((logits * 0).sum() == 0):  # the common case: no NaN, no inf at all (each would give NaN)
        return
    bad = logits.isnan().any(-1) | ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        raise NonFiniteLogits(bad.nonzero().flatten().tolist())


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``min_p``, ``top_k``, ``top_p`` on temperature-scaled rows ``x`` (masked to -inf), each only
    where some row asks for it: the whole definition, sorted (the sampler draws top-p by rejection)."""
    x = _min_p_top_k(x, params)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=x.device)
    if bool((top_p < 1.0).any()):
        x = _top_p(x, top_p)
    return x


def _min_p_top_k(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = x.device
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p.unsqueeze(1), float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < x.shape[1] else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=dev)
        kth = torch.topk(x, max(top_k), dim=-1).values.gather(1, (k.clamp_min(1) - 1).unsqueeze(1))
        x = x.masked_fill((x < kth) & (k > 0).unsqueeze(1), float("-inf"))
    return x


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: a token is dropped when the mass of the tokens before it (by
    probability) already reaches ``top_p``; the first is always kept. The candidates are the top
    ``TOP_P_CANDIDATES`` (a partial sort); a row whose candidates hold less than ``top_p`` of the mass
    is sorted whole. Exact either way: every token past the candidates of a covered row has at least
    the candidates' mass before it."""
    k = min(x.shape[1], TOP_P_CANDIDATES)
    vals, order = torch.topk(x, k, dim=-1)  # sorted, largest first
    probs = (vals - torch.logsumexp(x, -1, keepdim=True)).exp()
    cum = probs.cumsum(-1)
    keep = (cum - probs) < top_p.unsqueeze(1)
    keep[:, 0] = True  # even when top_p rounds to 0 in float32 (a subnormal top_p)
    out = torch.full_like(x, float("-inf")).scatter(1, order, vals.masked_fill(~keep, float("-inf")))
    short = (cum[:, -1] < top_p) & (k < x.shape[1])
    if bool(short.any()):  # the nucleus reaches past the candidates: sort those rows whole
        rows = short.nonzero().flatten()
        sorted_x, full_order = torch.sort(x[rows], descending=True, dim=-1)
        p_sorted = sorted_x.softmax(-1)
        drop = (p_sorted.cumsum(-1) - p_sorted) >= top_p[rows].unsqueeze(1)
        drop[:, 0] = False
        out[rows] = x[rows].masked_fill(torch.zeros_like(drop).scatter(1, full_order, drop), float("-inf"))
    return out


def _uniforms(rows: list[int], generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw for each of ``rows`` from its generator; rows that share one (the unseeded
    ones) draw together, in row order."""
    groups: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        groups.setdefault(id(generators[r]), []).append(j)
    if len(groups) == 1:
        return torch.rand(len(rows), generator=generators[rows[0]], device=device)
    u = torch.empty(len(rows), device=device)
    for js in groups.values():
        u[js] = torch.rand(len(js), generator=generators[rows[js[0]]], device=device)
    return u


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token drawn from the weights ``w[i]`` (>= 0, not normalised) by the uniform ``u[i]``:
    the first token whose cumulative weight passes ``u * total``, so a zero weight is never drawn (a
    float edge past the last weight takes the row's largest)."""
    cdf = w.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    idx = idx.clamp_max(w.shape[1] - 1)
    edge = w.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    return torch.where(edge, w.argmax(-1), idx)


def _round(
    rows: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draw per row of ``rows`` (weights, zero outside the candidates) by the uniforms ``u``:
    the tokens, their weights, and whether each is in its row's nucleus (the tokens more likely than
    it hold less than ``top_p``; the most likely always is)."""
    idx = _inverse_cdf(rows, u)
    picked = rows.gather(1, idx.unsqueeze(1)).squeeze(1)
    above = rows.masked_fill(rows <= picked.unsqueeze(1), 0.0).sum(-1)
    return idx, picked, (top_p >= 1.0) | (above < top_p) | (above == 0)


def _draw(probs: torch.Tensor, top_p: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """A token per row of ``probs`` (normalised, after min-p and top-k) from its top-p nucleus, by
    rejection (the module's docstring). The first round runs on every row without gathering them."""
    n = probs.shape[0]
    u = _uniforms(list(range(n)), generators, probs.device)
    if bool((top_p >= 1.0).all()):  # no nucleus to check
        return _inverse_cdf(probs, u)
    out, floor, ok = _round(probs, top_p, u)
    active = (~ok).nonzero().flatten()
    for _ in range(TOP_P_ROUNDS - 1):
        if not len(active):
            return out
        # a draw again among the tokens more likely than the one rejected: still a superset of the nucleus
        rows = probs[active]
        rows = rows.masked_fill(rows <= floor[active].unsqueeze(1), 0.0)
        idx, picked, ok = _round(rows, top_p[active], _uniforms(active.tolist(), generators, probs.device))
        out[active[ok]] = idx[ok]
        floor[active[~ok]] = picked[~ok]
        active = active[~ok]
    if not len(active):
        return out
    nucleus = _top_p(probs[active].log(), top_p[active]).softmax(-1)
    out[active] = _inverse_cdf(nucleus, _uniforms(active.tolist(), generators, probs.device))
    return out


def _sample_random(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    # <= 0 everywhere, exactly 0 at each row's argmax
    scaled = (logits - logits.amax(-1, keepdim=True)) / temp.unsqueeze(1)
    probs = _min_p_top_k(scaled, params).softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    return _draw(probs, top_p, generators)


def sample(
    logits: torch.Tensor,  # [S, vocab], one row per sampling request
    params: list[SamplingParams],
    generators: list[torch.Generator],
    ctx: Sequence[RowTokens] | None = None,
    grammar: GrammarMasks | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """``ctx``: each row's tokens, for the penalties and ``min_tokens`` (needed when a row asks for
    them); ``grammar``: the bitmasks of rows with a structured output."""
    raw = logits.float()
    check_finite(raw)
    logits = process_logits(raw, params, ctx, grammar)
    if logits is not raw:
        dead = ~torch.isfinite(logits.amax(-1))
        if bool(dead.any()):
            raise NoAllowedToken(dead.nonzero().flatten().tolist())
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if len(rand) == len(params):  # no row to leave alone
        tokens = _sample_random(logits, params, generators)
    else:
        tokens = logits.argmax(-1)
    if rand and len(rand) < len(params):
        picked = _sample_random(logits[rand], [params[i] for i in rand], [generators[i] for i in rand])
        tokens[rand] = picked
    out = tokens.tolist()
    return out, _logprobs(raw, params, out)


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
