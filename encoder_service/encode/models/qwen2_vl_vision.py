"""Qwen2-VL vision tower: patch embed → blocks with 2-D rotary attention over packed items → 2x2 merger.

Items (images, and videos frame by frame) are packed into one sequence of patches::

    patches: [ img0 (h0*w0) | vid1 f0 (h1*w1) | vid1 f1 (h1*w1) | img2 (h2*w2) ]
    cu_seqlens = [0, a, b, c, d]   one attention segment per image / per video frame

Attention never crosses a segment boundary, exactly like HF's ``cu_seqlens`` path, so an item's
embeddings do not depend on what it was batched with. Patches arrive in the processor's order:
2x2 merge blocks are contiguous, so the merger just views 4 consecutive patches as one row.
"""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.encode.models.common import EncoderModel, ParallelMLP, load_layer_norm
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    head_rows,
    unit_rows,
)
from encoder_service.types import EncoderInput

_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(h, w) of every patch, in the processor's merge-block-major order, repeated per frame: [N, 2]."""
    out = []
    for t, h, w in grids:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(out)


def item_grid(item: EncoderInput, merge: int, tower: str) -> tuple[int, int, int]:
    """The item's patch grid ``(t, h, w)`` from its tensors, checked against the spatial merge."""
    if item.modality not in _KEYS:
        raise ValueError(f"{tower}'s vision tower cannot encode {item.modality!r} item {item.mm_hash}")
    grid = item.tensors[_KEYS[item.modality][1]]
    t, h, w = (int(v) for v in torch.as_tensor(grid).reshape(-1, 3)[0].tolist())
    if h % merge or w % merge:
        raise ValueError(f"item {item.mm_hash}: grid {t}x{h}x{w} is not a multiple of the merge size")
    return t, h, w


def packed_pixels(
    items: list[EncoderInput], grids: list[tuple[int, int, int]], patch_dim: int
) -> torch.Tensor:
    """Every item's flattened patches, concatenated in order: ``[sum(t*h*w), patch_dim]``."""
    pixels = []
    for it, (t, h, w) in zip(items, grids, strict=True):
        pv = torch.as_tensor(it.tensors[_KEYS[it.modality][0]])
        if pv.shape != (t * h * w, patch_dim):
            raise ValueError(
                f"item {it.mm_hash}: pixel tensor {tuple(pv.shape)} does not match grid "
                f"{t}x{h}x{w} with {patch_dim} values per patch"
            )
        pixels.append(pv)
    return pixels[0] if len(pixels) == 1 else torch.cat(pixels)  # read only: no copy for one item


def embedded_patches(
    items: list[EncoderInput],
    grids: list[tuple[int, int, int]],
    patch_dim: int,
    patch_embed: nn.Linear,
) -> torch.Tensor:
    """``patch_embed`` of every item's patches, concatenated in order: ``[sum(t*h*w), embed_dim]``.

    Each item is embedded on its own and the embeddings are concatenated, not the pixels: a patch
    row is ``patch_dim`` values (1176 for Qwen2-VL) and its embedding ``embed_dim``, so the copy is
    the smaller one on every tiny model (a 16-image step's patch embedding, one thread: 1.8-2.2 ->
    1.3-1.5 ms). The linear is row-wise, but not bit-equal to one batched GEMM (2.4e-6 apart)."""
    device, dtype = patch_embed.weight.device, patch_embed.weight.dtype
    pixels = [
        packed_pixels([it], [grid], patch_dim).to(device=device, dtype=dtype)
        for it, grid in zip(items, grids, strict=True)
    ]
    if len(pixels) == 1:
        return patch_embed(pixels[0])
    return torch.cat([patch_embed(pv) for pv in pixels])


class VisionRotary(nn.Module):
    """Axial rope: head_dim/4 frequencies for h and the same for w, concatenated, then doubled."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def forward(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(device)[..., None].float() * self.inv_freq.to(device)  # [N, 2, hd/4]
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1)  # [N, hd]
        return emb.cos()[:, None, :], emb.sin()[:, None, :]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, tp: TPContext) -> None:
        super().__init__()
        self.dim, self.head_dim = dim, dim // num_heads
        heads = head_rows(num_heads, self.head_dim, tp, "vision num_heads")
        self.local_heads = len(heads) // self.head_dim
        # qkv rows are laid out (3, num_heads, head_dim): take this rank's heads of q, k and v.
        self.qkv_rows = torch.cat([heads + j * dim for j in range(3)])
        self.proj_cols = heads
        self.qkv = ColumnParallelLinear(dim, len(self.qkv_rows))
        self.proj = RowParallelLinear(len(heads), dim, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        self.qkv.load(reader.get(f"{name}.qkv.weight"), reader.get(f"{name}.qkv.bias"), self.qkv_rows)
        self.proj.load(reader.get(f"{name}.proj.weight"), reader.get(f"{name}.proj.bias"), self.proj_cols)

    def qkv_rope(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads of q, k (rotated, in float32 then cast back, as HF does) and v: ``[N, h, d]``."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.local_heads, self.head_dim).unbind(1)
        cos, sin = rope
        dtype = q.dtype
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(dtype)
        return q, k, v

    def forward(
        self, x: torch.Tensor, runs: list[tuple[int, int]], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_rope(x, rope)
        out = torch.empty_like(q)
        start = 0
        for num_segments, seg_len in runs:  # equal-length segments of a run attend in one batched call
            end = start + num_segments * seg_len

            def seg(t: torch.Tensor, s: int = start, e: int = end, ln: int = seg_len) -> torch.Tensor:
                return t[s:e].view(-1, ln, self.local_heads, self.head_dim).transpose(1, 2)

            o = nn.functional.scaled_dot_product_attention(seg(q), seg(k), seg(v))
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.local_heads, self.head_dim)
            start = end
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    MLP_NAMES = ("fc1", "fc2")  # the checkpoint's names of the MLP's two layers

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, tp: TPContext) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads, tp)
        self.mlp = ParallelMLP(dim, mlp_hidden, act, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        load_layer_norm(self.norm1, reader, f"{name}.norm1")
        load_layer_norm(self.norm2, reader, f"{name}.norm2")
        self.attn.load(reader, f"{name}.attn")
        fc1, fc2 = self.MLP_NAMES
        self.mlp.load(reader, f"{name}.mlp.{fc1}", f"{name}.mlp.{fc2}")

    def forward(
        self, x: torch.Tensor, runs: list[tuple[int, int]], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), runs, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each 2x2 block of patches as one row through a 2-layer GELU MLP to the LLM width."""

    def __init__(self, embed_dim: int, out_dim: int, merge: int, tp: TPContext) -> None:
        super().__init__()
        self.in_dim = embed_dim * merge * merge
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.rows = unit_rows(self.in_dim, tp, "vision merger width")
        self.fc1 = ColumnParallelLinear(self.in_dim, len(self.rows))
        self.fc2 = RowParallelLinear(len(self.rows), out_dim, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        load_layer_norm(self.ln_q, reader, f"{name}.ln_q")
        self.fc1.load(reader.get(f"{name}.mlp.0.weight"), reader.get(f"{name}.mlp.0.bias"), self.rows)
        self.fc2.load(reader.get(f"{name}.mlp.2.weight"), reader.get(f"{name}.mlp.2.bias"), self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.in_dim)
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class QwenVisionTower(EncoderModel):
    """What the Qwen-VL towers share: the Conv3d patch embedding as a Linear (stride = kernel), blocks,
    a merger, checkpoint names under ``model.visual.`` / ``visual.``, and the item's grid check.
    A family adds its extra weights in ``load_extra`` and its own ``encode``."""

    label: str  # the family in messages ("Qwen2-VL")
    embed_dim: int
    merge: int
    patch_embed: nn.Linear
    blocks: nn.ModuleList
    merger: nn.Module

    def load_weights(self, reader: CheckpointReader) -> None:
        p = reader.resolve_prefix("model.visual.", "visual.")
        self.patch_embed.weight.data = reader.get(f"{p}patch_embed.proj.weight").reshape(self.embed_dim, -1)
        if self.patch_embed.bias is not None:
            self.patch_embed.bias.data = reader.get(f"{p}patch_embed.proj.bias")
        for i, block in enumerate(self.blocks):
            block.load(reader, f"{p}blocks.{i}")
        self.merger.load(reader, f"{p}merger")
        self.load_extra(reader, p)

    def load_extra(self, reader: CheckpointReader, prefix: str) -> None:
        """Weights beyond patch embedding, blocks and merger (``prefix``: the tower's, e.g. ``model.visual.``)."""

    def grids(self, items: list[EncoderInput]) -> list[tuple[int, int, int]]:
        return [item_grid(it, self.merge, self.label) for it in items]

    def num_embeds(self, item: EncoderInput) -> int:
        t, h, w = item_grid(item, self.merge, self.label)
        return t * h * w // self.merge**2


class Qwen2VLVisionEncoder(QwenVisionTower):
    family = "qwen2-vl"
    label = "Qwen2-VL"
    modalities = ("image", "video")

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        vc = config["vision_config"]
        self.embed_dim, self.hidden_size = vc["embed_dim"], vc["hidden_size"]
        self.merge = vc.get("spatial_merge_size", 2)
        self.patch_dim = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc["patch_size"] ** 2
        num_heads = vc["num_heads"]
        if self.embed_dim % num_heads:
            raise ValueError(f"vision embed_dim={self.embed_dim} not divisible by num_heads={num_heads}")
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(self.embed_dim // num_heads, theta)
        self.patch_embed = nn.Linear(self.patch_dim, self.embed_dim, bias=False)  # = Conv3d, stride = kernel
        mlp_hidden = int(self.embed_dim * vc.get("mlp_ratio", 4))
        act = vc.get("hidden_act", "quick_gelu")
        self.blocks = nn.ModuleList(
            VisionBlock(self.embed_dim, num_heads, mlp_hidden, act, tp) for _ in range(vc["depth"])
        )
        self.merger = PatchMerger(self.embed_dim, self.hidden_size, self.merge, tp)

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        grids = self.grids(items)
        x = embedded_patches(items, grids, self.patch_dim, self.patch_embed)
        rope = self.rotary(vision_positions(grids, self.merge), self.patch_embed.weight.device)
        runs = [(t, h * w) for t, h, w in grids]
        for block in self.blocks:
            x = block(x, runs, rope)
        merged = self.merger(x)
        return list(merged.split([t * h * w // self.merge**2 for t, h, w in grids]))
