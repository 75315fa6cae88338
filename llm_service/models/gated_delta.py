"""Gated DeltaNet's sequence mixing, per sequence, carrying its two states across calls.

A linear-attention layer keeps, per sequence, a **conv state** (its last ``K - 1`` inputs to the
depthwise causal conv, ``[C, K-1]``) and a **recurrent state** ``S`` (``[H, d_k, d_v]``, float32).
Token ``t`` (after the conv, q and k L2-normalised, q scaled by ``d_k^-1/2``) does::

    S <- exp(g_t) * S                      decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   delta rule: write the correction only
    o_t = S^T q_t

``chunk_rule`` computes a prefill chunk in blocks of 64 tokens (the WY/UT form transformers'
``torch_chunk_gated_delta_rule`` uses, so prefill rounds as its prefill does); ``recurrent_step``
is one token for a batch of decodes (its ``torch_recurrent_gated_delta_rule``). Starting from a
zero state is a fresh sequence; from a saved one, the continuation of a chunked prefill or a decode.
"""

from __future__ import annotations

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
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk. ``q, k`` ``[H, L, d_k]`` (normalised, scaled), ``v`` ``[H, L, d_v]``,
    ``g, beta`` ``[H, L]``, ``state`` ``[H, d_k, d_v]``; all float32. Returns ``o`` ``[H, L, d_v]``
    and the state after the chunk."""
    h, n, dv = q.shape[0], q.shape[1], v.shape[2]
    pad = (-n) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(h, -1, CHUNK).cumsum(-1)  # log of the decay from the chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_v)
    for i in range(new_v.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_i
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(h, -1, dv)[:, :n], state


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
