"""Gated DeltaNet's sequence mixing, per sequence, carrying its two states across calls.

A linear-attention layer keeps, per sequence, a **conv state** (its last ``K - 1`` inputs to the
depthwise causal conv, ``[C, K-1]``) and a **recurrent state** ``S`` (``[H, d_k, d_v]``, float32).
Token ``t`` (after the conv, q and k L2-normalised, q scaled by ``d_k^-1/2``) does::

    S <- exp(g_t) * S                      decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   delta rule: write the correction only
    o_t = S^T q_t

``chunk_rule`` computes a prefill chunk in blocks of 64 tokens (the WY/UT form transformers'
``torch_chunk_gated_delta_rule`` uses, so prefill rounds as its prefill does; a chunk shorter than
64 is one block of its own length, not padded), and reads the states at snapshot points inside
its blocks instead of cutting the chunk there (a call costs ~60 small ops); ``recurrent_step``
is one token for a batch of decodes (its ``torch_recurrent_gated_delta_rule``). Starting from a
zero state is a fresh sequence; from a saved one, the continuation of a chunked prefill or a decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[L, C]`` after ``state`` ``[C, K-1]``: SiLU(depthwise conv) ``[L, C]`` and the conv's
    whole input ``[C, K-1+L]``, whose columns ``[j, j + K-1)`` are the state after ``j`` tokens."""
    full = torch.cat([state, x.t().to(state.dtype)], dim=1)
    n, taps = x.shape[0], weight.shape[1]
    src = full.to(weight.dtype)
    out = src[:, :n] * weight[:, :1]
    for j in range(1, taps):  # a depthwise conv of a few taps: cheaper as taps than as a conv call
        out = out + src[:, j : j + n] * weight[:, j : j + 1]
    return F.silu(out).t().to(x.dtype), full


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` ``[B, C]``, ``state`` ``[B, C, K-1]``."""
    full = torch.cat([state, x[:, :, None].to(state.dtype)], dim=2)  # [B, C, K]
    out = (full.to(weight.dtype) * weight[None]).sum(-1)
    return F.silu(out).to(x.dtype), full[:, :, 1:]


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cuts: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's chunk. ``q, k`` ``[H, L, d_k]`` (normalised, scaled), ``v`` ``[H, L, d_v]``,
    ``g, beta`` ``[H, L]``, ``state`` ``[H, d_k, d_v]``; all float32. Returns ``o`` ``[H, L, d_v]``,
    the state after the chunk and the state after each of ``cuts`` tokens (``0 < cut < L``), read
    inside the chunk's blocks rather than by cutting the chunk there."""
    h, n, dv = q.shape[0], q.shape[1], v.shape[2]
    if n == 0:
        return v.new_zeros(h, 0, dv), state, []
    if n <= CHUNK:  # one block of its own length: the same rows, unpadded
        return _one_block(q, k, v, g, beta, state, cuts)
    size = CHUNK
    if pad := (-n) % size:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, -1, size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(h, -1, size).cumsum(-1)  # log of the decay from the chunk's start
    grow = cum.exp()[..., None]
    pair = (cum[..., :, None] - cum[..., None, :]).exp().tril()  # decay from column to row (0 above)
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    # one triangular solve for both right-hand sides: the corrected values and the keys' state reads
    solved = torch.linalg.solve_triangular(
        ut, torch.cat([v_beta, k_beta * grow], -1), upper=False, unitriangular=True
    )
    new_v, k_cum = solved[..., :dv], solved[..., dv:]
    q = q * grow
    k_in = k
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    blocks = []
    at: dict[int, list[int]] = {}
    for cut in cuts:
        at.setdefault((cut - 1) // size, []).append(cut)
    cut_states: dict[int, torch.Tensor] = {}
    for i in range(new_v.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ state
        blocks.append(q[:, i] @ state + intra[:, i] @ v_i)
        for cut in at.get(i, ()):
            cut_states[cut] = _state_after(state, k_in[:, i], cum[:, i], v_i, cut - i * size)
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return torch.cat(blocks, dim=1)[:, :n], state, [cut_states[c] for c in cuts]


def _state_after(
    state: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, v_new: torch.Tensor, r: int
) -> torch.Tensor:
    """The state after the first ``r`` tokens of a block that started from ``state``: the decayed
    state plus those tokens' writes (``k``, ``cum``, ``v_new``: the block's keys, cumulative log
    decays and corrected values)."""
    c = cum[:, :r]
    k_r = k[:, :r] * (c[:, -1:] - c).exp()[..., None]
    return state * c[:, -1, None, None].exp() + k_r.transpose(-1, -2) @ v_new[:, :r]


def _one_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cuts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunk_rule`` for ``L <= CHUNK`` tokens: the same block algebra without the block axis (a
    prefill chunk's tail or a next turn's new tokens are mostly this: about half the ops)."""
    dv = v.shape[2]
    k_beta = k * beta[..., None]
    cum = g.cumsum(-1)  # [H, L]
    grow = cum.exp()[..., None]
    pair = (cum[:, :, None] - cum[:, None, :]).exp().tril()
    kt = k.transpose(-1, -2)
    ut = (k_beta @ kt) * pair
    intra = (q @ kt) * pair
    rhs = torch.cat([v * beta[..., None], k_beta * grow], -1)
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    v_new = solved[..., :dv] - solved[..., dv:] @ state
    out = (q * grow) @ state + intra @ v_new
    at = [_state_after(state, k, cum, v_new, r) for r in (*cuts, q.shape[1])]
    return out, at[-1], at[:-1]


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``q, k`` ``[B, H, d_k]``, ``v`` ``[B, H, d_v]``, ``g, beta`` ``[B, H]``,
    ``state`` ``[B, H, d_k, d_v]``; float32."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state
