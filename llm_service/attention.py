"""Attention over the paged KV cache for a batch mixing prefill chunks and decodes.

The whole kernel sits behind ``PagedAttention.forward``; ``TorchPagedAttention`` is the portable
reference (scatter new K/V into their slots, gather each sequence's context, SDPA). A fused GPU
kernel can replace it without touching the models.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a
request lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class SeqAttention:
    """One sequence of the batch: query rows ``[q_start, q_start + q_len)`` attend its first
    ``context_slots.numel()`` tokens (the new ones included), causally."""

    q_start: int
    q_len: int
    context_slots: torch.Tensor  # [ctx_len] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when every query sees the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    seqs: list[SeqAttention]


class PagedAttention(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """``chunks``: per sequence ``(start, num_tokens, block_table)``, in batch order."""
    slot_parts, seqs, q_start = [], [], 0
    for start, n, table in chunks:
        end = start + n
        bt = torch.tensor(table, dtype=torch.long)
        pos = torch.arange(end, dtype=torch.long)
        slots = bt[pos // block_size] * block_size + pos % block_size
        slot_parts.append(slots[start:])
        mask = None
        if n > 1:
            q_pos = torch.arange(start, end, dtype=torch.long)
            mask = (pos[None, :] <= q_pos[:, None]).to(device)
        seqs.append(SeqAttention(q_start, n, slots.to(device), mask))
        q_start += n
    return AttentionMetadata(torch.cat(slot_parts).to(device), seqs)


class TorchPagedAttention:
    def forward(self, q, k, v, kv_cache, meta, scale):  # type: ignore[no-untyped-def]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for s in meta.seqs:
            qq = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]
            kk = k_flat[s.context_slots].transpose(0, 1)[None]
            vv = v_flat[s.context_slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=s.mask, scale=scale, enable_gqa=True)
            out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
        return out
