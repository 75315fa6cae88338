"""Attention over the paged KV cache for a batch mixing prefill chunks and decodes.

The whole kernel sits behind ``PagedAttention.forward``; ``TorchPagedAttention`` is the portable
reference (scatter new K/V into their slots, gather each sequence's context, SDPA). A fused GPU
kernel can replace it without touching the models.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a
request lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Which keys a query at position ``q`` sees (``k`` over the sequence's context)::

    causal            k <= q
    + spans           or (q and k in the same bidirectional span: Gemma 3's image soft tokens)
    + sliding window  and k > q - window      (local layers only; ``forward(..., sliding_window=W)``)

A layer may attend causally despite the spans (``forward(..., bidirectional=False)``: Gemma 4's full
layers), and may read another layer's cache without writing (``k = v = None``: Gemma 4's KV-shared
layers; the cache is the source layer's).

A bidirectional span must lie whole inside the context of any chunk that queries it (the scheduler
never ends a chunk inside one), so an image token sees every token of its image, as in transformers'
``token_type_ids`` masks. When the window layers keep their own blocks (``meta.windowed``), those
that fell out of the window are a null block in their table: the window mask never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from llm_service.linear_states import StepStates

Span = tuple[int, int]  # (offset, length) of tokens that attend each other in both directions


@dataclass
class SeqAttention:
    """One sequence of the batch: query rows ``[q_start, q_start + q_len)`` (positions ``[pos_start,
    pos_start + q_len)``) attend its first ``context_slots.numel()`` tokens (the new ones included),
    causally, and both ways inside each of ``spans``."""

    q_start: int
    q_len: int
    context_slots: torch.Tensor  # [ctx_len] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when every query sees the whole context
    pos_start: int = 0
    spans: tuple[Span, ...] = ()
    _window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)

    _causal_mask: torch.Tensor | None = field(default=None, repr=False)

    def mask_for(self, sliding_window: int | None, bidirectional: bool = True) -> torch.Tensor | None:
        """The full-attention mask, or the one of a local layer seeing ``sliding_window`` tokens;
        ``bidirectional=False``: causal even inside the spans."""
        if not bidirectional and self.spans:
            return self._causal_for(sliding_window)
        if sliding_window is None:
            return self.mask
        if sliding_window not in self._window_masks:
            ctx = self.context_slots.numel()
            if ctx <= sliding_window:  # the window covers the whole context
                self._window_masks[sliding_window] = self.mask
            else:
                near = self._near(sliding_window)
                self._window_masks[sliding_window] = near if self.mask is None else near & self.mask
        return self._window_masks[sliding_window]

    def _near(self, sliding_window: int) -> torch.Tensor:
        device = self.context_slots.device
        k_pos = torch.arange(self.context_slots.numel(), device=device)
        q_pos = torch.arange(self.pos_start, self.pos_start + self.q_len, device=device)
        return k_pos[None, :] > q_pos[:, None] - sliding_window

    def _causal_for(self, sliding_window: int | None) -> torch.Tensor:
        if self._causal_mask is None:
            device = self.context_slots.device
            k_pos = torch.arange(self.context_slots.numel(), device=device)
            q_pos = torch.arange(self.pos_start, self.pos_start + self.q_len, device=device)
            self._causal_mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is None:
            return self._causal_mask
        return self._causal_mask & self._near(sliding_window)


@dataclass
class DecodeGroup:
    """The batch's single-query sequences (decodes), attended in ONE padded SDPA call per layer
    instead of one call each: their contexts are gathered into ``[B, max_ctx]`` slots, padded with
    each row's first slot and masked out. A single query sees its whole context (causal, and any
    bidirectional span it belongs to lies whole before it), so only padding and windows are masked."""

    rows: torch.Tensor  # [B] long: their query rows in the batch
    slots: torch.Tensor  # [B, max_ctx] long
    valid: torch.Tensor  # [B, max_ctx] bool: inside the row's context
    lengths: torch.Tensor  # [B] long: context lengths
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, 1, max_ctx]``: a local layer's query at position ``L - 1`` sees keys ``>= L - W``."""
        if sliding_window not in self._masks:
            m = self.valid
            if sliding_window is not None:
                k_pos = torch.arange(m.shape[1], device=m.device)
                m = m & (k_pos[None, :] >= (self.lengths[:, None] - sliding_window))
            self._masks[sliding_window] = m[:, None, None, :]
        return self._masks[sliding_window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    seqs: list[SeqAttention]  # attended one by one (prefill chunks; a lone decode)
    decode: DecodeGroup | None = None  # two or more decodes, attended together
    states: StepStates | None = None  # hybrid models: the state-cache slots the step's sequences use
    # the sliding-window layers' metadata when they keep their own blocks (``WindowKVCacheManager``):
    # the same rows over their block tables, whose entries out of every window are a null block
    windowed: AttentionMetadata | None = None


MIN_DECODE_GROUP = 2  # one decode alone gains nothing from padding


class PagedAttention(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: read kv_cache, write nothing
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # a local layer: each query sees its last W positions
        bidirectional: bool = True,  # False: causal inside the bidirectional spans too
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]


def build_metadata(
    chunks: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    spans: list[list[Span]] | None = None,
) -> AttentionMetadata:
    """``chunks``: per sequence ``(start, num_tokens, block_table)``, in batch order; ``spans``: per
    sequence, its bidirectional spans (None: causal everywhere).

    Single-token chunks (decodes) go into one ``DecodeGroup`` when there are two or more: their slots
    are computed for all of them at once, not per sequence (per-step Python cost stays flat in B)."""
    group = sum(1 for _, n, _ in chunks if n == 1) >= MIN_DECODE_GROUP
    slots_out: list[torch.Tensor | list[int]] = []  # new tokens' slots, in batch order
    seqs: list[SeqAttention] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    q_start = 0
    for i, (start, n, table) in enumerate(chunks):
        if n == 1 and group:
            slot = table[start // block_size] * block_size + start % block_size
            if slots_out and isinstance(slots_out[-1], list):
                slots_out[-1].append(slot)
            else:
                slots_out.append([slot])
            dec_rows.append(q_start)
            dec_tables.append(table)
            dec_lens.append(start + 1)
            q_start += 1
            continue
        end = start + n
        bt = torch.tensor(table, dtype=torch.long)
        pos = torch.arange(end, dtype=torch.long)
        slots = bt[pos // block_size] * block_size + pos % block_size
        slots_out.append(slots[start:])
        live = tuple((o, ln) for o, ln in (spans[i] if spans else ()) if o < end and o + ln > start)
        mask = None
        if n > 1:
            q_pos = torch.arange(start, end, dtype=torch.long)
            mask = pos[None, :] <= q_pos[:, None]
            for o, ln in live:
                assert o + ln <= end, f"chunk [{start}, {end}) ends inside bidirectional span [{o}, {o + ln})"
                both = (q_pos[:, None] >= o) & (q_pos[:, None] < o + ln) & (pos[None, :] >= o)
                mask |= both & (pos[None, :] < o + ln)
            mask = mask.to(device)
        seqs.append(SeqAttention(q_start, n, slots.to(device), mask, start, live))
        q_start += n
    slot_mapping = torch.cat(
        [p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long) for p in slots_out]
    )
    decode = _decode_group(dec_rows, dec_tables, dec_lens, block_size, device) if dec_rows else None
    return AttentionMetadata(slot_mapping.to(device), seqs, decode)


def _decode_group(
    rows: list[int], tables: list[list[int]], lengths: list[int], block_size: int, device: torch.device
) -> DecodeGroup:
    """Every decode's context slots at once: block tables padded (with each row's first block) to a
    ``[B, max_blocks]`` matrix, expanded to ``[B, max_ctx]`` slots."""
    width = max(lengths)
    max_blocks = -(-width // block_size)
    bt = torch.tensor([t[:max_blocks] + [t[0]] * (max_blocks - len(t[:max_blocks])) for t in tables])
    pos = torch.arange(width, dtype=torch.long)
    slots = bt[:, pos // block_size] * block_size + pos % block_size
    lens = torch.tensor(lengths, dtype=torch.long)
    valid = pos[None, :] < lens[:, None]
    return DecodeGroup(
        torch.tensor(rows, dtype=torch.long, device=device),
        slots.to(device),
        valid.to(device),
        lens.to(device),
    )


class TorchPagedAttention:
    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None, bidirectional=True):  # type: ignore[no-untyped-def]
        if sliding_window is not None and meta.windowed is not None:
            meta = meta.windowed  # a window layer's cache is indexed by the window group's blocks
        num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        if k is not None:  # None: a KV-shared layer, reading its source layer's cache
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for s in meta.seqs:
            qq = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]
            kk = k_flat.index_select(0, s.context_slots).transpose(0, 1)[None]  # a gather, as [slots]
            vv = v_flat.index_select(0, s.context_slots).transpose(0, 1)[None]
            mask = s.mask_for(sliding_window, bidirectional)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
        if (g := meta.decode) is not None:
            qq = q[g.rows][:, :, None, :]  # [B, heads, 1, dim]
            flat, shape = g.slots.flatten(), (*g.slots.shape, num_kv_heads, head_dim)
            kk = k_flat.index_select(0, flat).view(shape).transpose(1, 2)  # [B, kv_heads, max_ctx, dim]
            vv = v_flat.index_select(0, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=g.mask_for(sliding_window), scale=scale, enable_gqa=True
            )
            out[g.rows] = o[:, :, 0, :]
        return out
