"""Qwen3-VL vision tower: Qwen2-VL's packed per-frame attention and 2-D rope, plus a learned position
table interpolated to each frame's grid, LayerNorm + GELU(tanh) blocks, and **DeepStack**: blocks at
``deepstack_visual_indexes`` also feed their own mergers, whose outputs the LLM adds to its hidden
states after its first layers.

Output (what the encoder cache and the wire carry, one tensor per item)::

    row i of an item = [ main embedding | DeepStack level 0 | ... | level k-1 ]   width (1 + k) * hidden

so DeepStack features share the item's mm_hash, cache entry, ObjectRef and budget with the main
embeddings; ``llm_service/deepstack.py`` splits them again. ``hidden_size`` is that row width.

Position table: ``num_position_embeddings`` = side x side learned rows, resampled bilinearly
(align_corners=True, as HF's ``get_vision_interpolation_indices_and_weights``) to the frame's
``h x w`` patches and laid out in the processor's merge-block order, the same for every frame.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encoder_service.encode.models.common import load_layer_norm
from encoder_service.encode.models.qwen2_vl_vision import (
    QwenVisionTower,
    VisionBlock,
    VisionRotary,
    embedded_patches,
    vision_positions,
)
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import ColumnParallelLinear, RowParallelLinear, TPContext, unit_rows
from encoder_service.types import EncoderInput


def bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``size`` target positions on an axis of a ``side``-long table: lower tap, upper tap, and
    the upper tap's weight (align_corners=True; float32 like HF)."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    lo_i = lo.long().clamp(0, side - 1)
    return lo_i, (lo_i + 1).clamp(max=side - 1), frac


def interpolated_positions(
    table: torch.Tensor, grids: list[tuple[int, int, int]], merge: int
) -> torch.Tensor:
    """Every patch's position embedding ``[sum(t*h*w), D]``, in merge-block order, repeated per frame."""
    side = math.isqrt(table.shape[0])
    grid = table.view(side, side, -1).float()
    out = []
    for t, h, w in grids:
        r0, r1, fr = bilinear_taps(h, side)
        c0, c1, fc = bilinear_taps(w, side)
        fr, fc = fr.to(table.device)[:, None, None], fc.to(table.device)[None, :, None]
        top = grid[r0][:, c0] * (1 - fc) + grid[r0][:, c1] * fc
        bottom = grid[r1][:, c0] * (1 - fc) + grid[r1][:, c1] * fc
        emb = top * (1 - fr) + bottom * fr  # [h, w, D]
        emb = emb.view(h // merge, merge, w // merge, merge, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
        out.append(emb.repeat(t, 1))
    return torch.cat(out).to(table.dtype)


class Qwen3VisionBlock(VisionBlock):
    MLP_NAMES = ("linear_fc1", "linear_fc2")


class Qwen3PatchMerger(nn.Module):
    """Each 2x2 block of patches as one row through fc1 → GELU → fc2; LayerNorm before the shuffle
    (the main merger) or after it (``postshuffle``: the DeepStack mergers)."""

    def __init__(self, embed_dim: int, out_dim: int, merge: int, tp: TPContext, postshuffle: bool) -> None:
        super().__init__()
        self.in_dim = embed_dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.in_dim if postshuffle else embed_dim, eps=1e-6)
        self.rows = unit_rows(self.in_dim, tp, "vision merger width")
        self.fc1 = ColumnParallelLinear(self.in_dim, len(self.rows))
        self.fc2 = RowParallelLinear(len(self.rows), out_dim, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        load_layer_norm(self.norm, reader, f"{name}.norm")
        self.fc1.load(
            reader.get(f"{name}.linear_fc1.weight"), reader.get(f"{name}.linear_fc1.bias"), self.rows
        )
        self.fc2.load(
            reader.get(f"{name}.linear_fc2.weight"), reader.get(f"{name}.linear_fc2.bias"), self.rows
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.in_dim)) if self.postshuffle else self.norm(x).view(-1, self.in_dim)
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Qwen3VLVisionEncoder(QwenVisionTower):
    family = "qwen3-vl"
    label = "Qwen3-VL"
    modalities = ("image", "video")

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        vc = config["vision_config"]
        self.embed_dim, self.out_dim = vc["hidden_size"], vc["out_hidden_size"]
        self.merge = vc.get("spatial_merge_size", 2)
        self.patch_dim = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc["patch_size"] ** 2
        num_heads = vc["num_heads"]
        if self.embed_dim % num_heads:
            raise ValueError(f"vision hidden_size={self.embed_dim} not divisible by num_heads={num_heads}")
        num_positions = int(vc.get("num_position_embeddings", 2304))
        if math.isqrt(num_positions) ** 2 != num_positions:
            raise ValueError(f"num_position_embeddings={num_positions} is not a square")
        self.deepstack_indexes = [int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24))]
        self.hidden_size = self.out_dim * (1 + len(self.deepstack_indexes))  # one output row's width
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(self.embed_dim // num_heads, theta)
        self.patch_embed = nn.Linear(self.patch_dim, self.embed_dim, bias=True)  # = Conv3d, stride = kernel
        self.pos_embed = nn.Parameter(torch.zeros(num_positions, self.embed_dim), requires_grad=False)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.blocks = nn.ModuleList(
            Qwen3VisionBlock(self.embed_dim, num_heads, vc["intermediate_size"], act, tp)
            for _ in range(vc["depth"])
        )
        self.merger = Qwen3PatchMerger(self.embed_dim, self.out_dim, self.merge, tp, postshuffle=False)
        self.deepstack_mergers = nn.ModuleList(
            Qwen3PatchMerger(self.embed_dim, self.out_dim, self.merge, tp, postshuffle=True)
            for _ in self.deepstack_indexes
        )

    def load_extra(self, reader: CheckpointReader, prefix: str) -> None:
        self.pos_embed.data = reader.get(f"{prefix}pos_embed.weight")
        for j, merger in enumerate(self.deepstack_mergers):
            merger.load(reader, f"{prefix}deepstack_merger_list.{j}")

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        device = self.patch_embed.weight.device
        grids = self.grids(items)
        x = embedded_patches(items, grids, self.patch_dim, self.patch_embed)
        x = x + interpolated_positions(self.pos_embed, grids, self.merge)
        rope = self.rotary(vision_positions(grids, self.merge), device)
        runs = [(t, h * w) for t, h, w in grids]
        levels: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, runs, rope)
            if i in self.deepstack_indexes:
                levels.append(self.deepstack_mergers[self.deepstack_indexes.index(i)](x))
        rows = torch.cat([self.merger(x), *levels], dim=-1)
        return list(rows.split([t * h * w // self.merge**2 for t, h, w in grids]))
