"""Qwen2.5-VL vision tower: Qwen2-VL's patch embed and 2-D rope, RMSNorm + gated-MLP blocks that
attend inside windows, except the ``fullatt_block_indexes`` blocks that attend over whole frames.

Patches are reordered once, in 2x2 merge units, so that each window is contiguous::

    frame (merged 6x6, window 4x4 units):     window order of the units:
      a a a a b b                               [ a x16 | b x8 | c x8 | d x4 ]
      a a a a b b        ──window_order──▶       windows: 64, 32, 32, 16 patches
      a a a a b b
      a a a a b b
      c c c c d d
      c c c c d d

Frames stay contiguous and in order, so full-attention blocks use per-frame segments of the same
reordered sequence. After the merger each row goes back to the processor's order (the inverse
permutation), exactly as HF's ``Qwen2_5_VisionTransformerPretrainedModel`` does. Items never attend
to each other, so an item's embeddings do not depend on its batch.
"""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.encode.models.common import GatedParallelMLP, RMSNorm
from encoder_service.encode.models.qwen2_vl_vision import (
    PatchMerger,
    QwenVisionTower,
    VisionAttention,
    VisionRotary,
    embedded_patches,
    vision_positions,
)
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import TPContext
from encoder_service.types import EncoderInput

DEFAULT_FULLATT_BLOCKS = (7, 15, 23, 31)  # transformers' default (the released checkpoints')


def window_order(
    grids: list[tuple[int, int, int]], merge: int, window_units: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge units of all items in window order (a permutation), and each window's length in patches.

    Each frame's ``(h/merge) x (w/merge)`` units are cut into ``window_units``-square windows from the
    top-left corner; edge windows are smaller. Same order as HF's ``get_vision_window_index``.
    """
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % window_units, -gw % window_units
        nh, nw = (gh + pad_h) // window_units, (gw + pad_w) // window_units
        padded = nn.functional.pad(index, (0, pad_w, 0, pad_h), value=-1)
        padded = padded.reshape(t, nh, window_units, nw, window_units).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, window_units * window_units)
        valid = padded >= 0
        order.append(padded[valid] + base)
        lengths += [int(n) * merge * merge for n in valid.sum(-1).flatten().tolist()]
        base += t * gh * gw
    return torch.cat(order), lengths


class SegmentLayout:
    """A packed sequence cut into attention segments; all segments of one length attend in one call."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts.tolist(), lengths, strict=True):
            by_length.setdefault(length, []).append(start)
        self.groups = [
            (torch.tensor(s)[:, None] + torch.arange(n)).to(device) for n, s in sorted(by_length.items())
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v``: ``[N, heads, head_dim]``; each token attends only inside its segment."""
        out = torch.empty_like(q)
        for index in self.groups:  # [num_segments, length]

            def seg(x: torch.Tensor, ix: torch.Tensor = index) -> torch.Tensor:
                return x[ix].transpose(1, 2)  # [num_segments, heads, length, head_dim]

            o = nn.functional.scaled_dot_product_attention(seg(q), seg(k), seg(v))
            out[index.reshape(-1)] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
        return out


class WindowVisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, tp: TPContext) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads, tp)
        self.mlp = GatedParallelMLP(dim, mlp_hidden, act, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        self.norm1.load(reader, f"{name}.norm1")
        self.norm2.load(reader, f"{name}.norm2")
        self.attn.load(reader, f"{name}.attn")
        self.mlp.load(reader, f"{name}.mlp")

    def forward(
        self, x: torch.Tensor, layout: SegmentLayout, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        q, k, v = self.attn.qkv_rope(self.norm1(x), rope)
        x = x + self.attn.proj(layout.attend(q, k, v).reshape(x.shape[0], -1))
        return x + self.mlp(self.norm2(x))


class RMSPatchMerger(PatchMerger):
    """Qwen2-VL's merger with an RMSNorm in place of its LayerNorm."""

    def __init__(self, embed_dim: int, out_dim: int, merge: int, tp: TPContext) -> None:
        super().__init__(embed_dim, out_dim, merge, tp)
        self.ln_q = RMSNorm(embed_dim)  # type: ignore[assignment]

    def load(self, reader: CheckpointReader, name: str) -> None:
        self.ln_q.load(reader, f"{name}.ln_q")
        self.fc1.load(reader.get(f"{name}.mlp.0.weight"), reader.get(f"{name}.mlp.0.bias"), self.rows)
        self.fc2.load(reader.get(f"{name}.mlp.2.weight"), reader.get(f"{name}.mlp.2.bias"), self.rows)


class Qwen25VLVisionEncoder(QwenVisionTower):
    family = "qwen2.5-vl"
    label = "Qwen2.5-VL"
    modalities = ("image", "video")

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        vc = config["vision_config"]
        self.embed_dim, self.hidden_size = vc["hidden_size"], vc["out_hidden_size"]
        self.merge = vc.get("spatial_merge_size", 2)
        patch = vc.get("patch_size", 14)
        self.patch_dim = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * patch**2
        self.window_units = vc.get("window_size", 112) // self.merge // patch
        if self.window_units < 1:
            raise ValueError(f"vision window_size={vc.get('window_size')} is smaller than one merged patch")
        self.fullatt_blocks = frozenset(vc.get("fullatt_block_indexes", DEFAULT_FULLATT_BLOCKS))
        num_heads = vc["num_heads"]
        if self.embed_dim % num_heads:
            raise ValueError(f"vision hidden_size={self.embed_dim} not divisible by num_heads={num_heads}")
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(self.embed_dim // num_heads, theta)
        self.patch_embed = nn.Linear(self.patch_dim, self.embed_dim, bias=False)  # = Conv3d, stride = kernel
        act = vc.get("hidden_act", "silu")
        self.blocks = nn.ModuleList(
            WindowVisionBlock(self.embed_dim, num_heads, vc["intermediate_size"], act, tp)
            for _ in range(vc["depth"])
        )
        self.merger = RMSPatchMerger(self.embed_dim, self.hidden_size, self.merge, tp)

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        device = self.patch_embed.weight.device
        grids = self.grids(items)
        x = embedded_patches(items, grids, self.patch_dim, self.patch_embed)
        n, unit = x.shape[0], self.merge**2
        order, window_lengths = window_order(grids, self.merge, self.window_units)
        x = x.view(n // unit, unit, -1)[order.to(device)].reshape(n, -1)
        positions = vision_positions(grids, self.merge).view(n // unit, unit, 2)[order].reshape(n, 2)
        rope = self.rotary(positions, device)
        windows = SegmentLayout(window_lengths, device)
        frames = SegmentLayout([h * w for t, h, w in grids for _ in range(t)], device)
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.fullatt_blocks else windows, rope)
        merged = self.merger(x)[torch.argsort(order).to(device)]
        return list(merged.split([t * h * w // unit for t, h, w in grids]))
