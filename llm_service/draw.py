"""The tokens of the rows that draw (temperature > 0), for a whole step in tensor operations.

Each row's weights are its unnormalised probabilities at its temperature, ``exp((x - max) / T)``:
the most likely token weighs exactly 1, so nothing overflows and no softmax is needed. ``min_p`` and
``top_k`` become one floor per row (``min_p`` itself, since the top weight is 1, or the k-th largest
weight), applied to only the rows that ask. A row then draws by inverse CDF, one uniform per row and
round: a seeded request from its own generator, so its tokens do not depend on the batch around it;
the others share one generator.

``top_p`` is a rejection loop rather than a sort: keep the token drawn when the tokens heavier than it
weigh less than ``top_p`` of the row (it is in the nucleus), else draw again among the tokens heavier
than the one drawn (still a superset of the nucleus). A round
keeps the heavier-only weights it checked for the next (no recomputation). Given acceptance the token is distributed as the
renormalised nucleus, whatever round accepts it; rows still drawing after ``TOP_P_ROUNDS`` take the
sorted nucleus (``top_p_mask``) and one more draw. Tokens tied with a token at the nucleus' edge are
kept with it. The weight above the top token is 0, below any bound (``TopP.scale`` is at least
float32's smallest normal), so the top token is accepted even when ``top_p`` rounds to 0.

At 32 rows of a small vocabulary each tensor operation costs its dispatch (~5 us on CPU) more than its
arithmetic, so the step is written for fewer operations: in-place where it can, a comparison multiplied
in rather than turned into arithmetic, no row gather when every row takes part.
"""

from __future__ import annotations

import torch

from llm_service.sampling_batch import Floors, SamplingBatch, TopP

TOP_P_CANDIDATES = 1024  # top-p looks at this many tokens first (a partial sort), the rest only if it must
TOP_P_ROUNDS = 8  # rejection rounds before a row's nucleus is sorted
U_MAX = 1.0 - 2.0**-22  # the largest uniform the inverse CDF uses (below 1 by more than float32's rounding)


def draw(x: torch.Tensor, batch: SamplingBatch, generators: list[torch.Generator]) -> list[int]:
    """The tokens of ``batch.random`` (in that order) from the processed logits ``x`` (all rows)."""
    rows = x if len(batch.random) == x.shape[0] else x.index_select(0, batch.random_index)
    w = weights(rows, batch.temperature)
    if batch.floors is not None:
        apply_floors(w, batch.floors)
    gens = [generators[i] for i in batch.random]
    idx, total = _inverse_cdf(w, _uniforms(gens, w.device))
    tokens = idx.tolist()
    if batch.nucleus is not None:
        _nucleus(w, batch.nucleus, gens, idx, total, tokens)
    return tokens


def weights(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Each row's unnormalised probabilities at its temperature; the top one is exactly 1."""
    return (x - x.amax(-1, keepdim=True)).div_(temperature).exp_()


def apply_floors(w: torch.Tensor, floors: Floors) -> None:
    """Zero, in place, the weights under each floored row's floor (ties with it are kept)."""
    every = floors.rows.shape[0] == w.shape[0]  # the floored rows are 0..n-1 (``SamplingBatch``)
    rows = w if every else w.index_select(0, floors.rows)
    floor = floors.min_p
    if floors.max_k:
        kth = torch.topk(rows, floors.max_k, dim=-1, sorted=True).values.gather(1, floors.k_index)
        if floors.has_k is not None:
            kth = kth.mul_(floors.has_k)
        floor = kth if floor is None else torch.maximum(floor, kth)
    assert floor is not None, "a floored row has a min_p or a top_k"
    rows.mul_(rows >= floor)
    if not every:
        w.index_copy_(0, floors.rows, rows)


def _heavier_only(w: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """``w`` with only the tokens heavier than each row's ``picked`` token (an index column) kept."""
    return w * (w > w.gather(1, picked.unsqueeze(1)))


def _uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row from its generator: a generator serving several rows (the unseeded
    ones share the engine's) draws for them together, in row order; each seeded row takes exactly one
    draw from its own, so its stream does not depend on the rows around it."""
    first = generators[0]
    if all(g is first for g in generators):
        return torch.rand(len(generators), generator=first, device=device)
    groups: dict[int, list[int]] = {}
    for j, g in enumerate(generators):
        groups.setdefault(id(g), []).append(j)
    draws = [torch.rand(len(js), generator=generators[js[0]], device=device) for js in groups.values()]
    order = [j for js in groups.values() for j in js]  # the row of each drawn value
    joined = torch.cat(draws)
    if order == list(range(len(order))):
        return joined
    return torch.empty_like(joined).index_copy_(0, torch.tensor(order, device=device), joined)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``'s token drawn from the weights ``w[i]`` (>= 0, not normalised) by the uniform
    ``u[i]``, and the row's total weight: the first token whose cumulative weight passes ``u * total``.
    The uniform is held at most ``U_MAX``, so the float32 target stays below the total (a product of
    ``u < 1`` may round up to it; ``U_MAX * total`` cannot): the token found always weighs more than 0."""
    cdf = w.cumsum(-1)
    total = cdf[:, -1:]
    target = u.unsqueeze(1).clamp_max_(U_MAX).mul_(total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1), total.squeeze(1)


def _nucleus(
    w: torch.Tensor,
    nucleus: TopP,
    generators: list[torch.Generator],
    idx: torch.Tensor,
    total: torch.Tensor,
    tokens: list[int],
) -> None:
    """Replace in ``tokens`` each first draw (``idx``) of a top-p row that fell outside its nucleus
    by one inside it (the module's docstring). The first check runs on every drawing row (a row
    without top-p has an infinite bound: gathering the top-p rows first costs more operations than
    checking the others); the later rounds only on the rows still drawing."""
    bound = nucleus.scale * total  # the mass a kept token's heavier ones stay under (> 0: ``TopP``)
    heavier = _heavier_only(w, idx)
    ok = (heavier.sum(-1) < bound).tolist()
    active = [k for k, good in enumerate(ok) if not good]
    if not active:
        return
    at = torch.tensor(active, device=w.device)
    heavier, bound, top_p, whole = (t.index_select(0, at) for t in (heavier, bound, nucleus.scale, w))
    for _ in range(TOP_P_ROUNDS - 1):
        picked, _ = _inverse_cdf(heavier, _uniforms([generators[k] for k in active], w.device))
        for k, tok in zip(active, picked.tolist(), strict=True):
            tokens[k] = tok
        heavier = _heavier_only(heavier, picked)
        ok = (heavier.sum(-1) < bound).tolist()
        if all(ok):
            return
        if any(ok):
            again = [i for i, good in enumerate(ok) if not good]
            active = [active[i] for i in again]
            at = torch.tensor(again, device=w.device)
            heavier, bound, top_p, whole = (t.index_select(0, at) for t in (heavier, bound, top_p, whole))
    kept = top_p_mask(whole.log(), top_p).exp_()
    picked, _ = _inverse_cdf(kept, _uniforms([generators[k] for k in active], w.device))
    for k, tok in zip(active, picked.tolist(), strict=True):
        tokens[k] = tok


def top_p_mask(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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
