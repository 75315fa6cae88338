"""Qwen2-Audio audio tower (Whisper-style encoder) and its projector to the LLM width.

Per clip (mel features padded to 30 s = 3000 frames)::

    [128, 3000] ─conv1(k3)+gelu─▶ ─conv2(k3,s2)+gelu─▶ [1500, d] + learned positions
      ─▶ layers (pre-LN attention, keys past the clip's real length masked; pre-LN MLP)
      ─▶ avg-pool 2 ─▶ [750, d] ─▶ LayerNorm ─▶ projector ─▶ first ``num_embeds`` rows kept

``num_embeds`` follows from ``feature_attention_mask`` exactly as in HF's
``Qwen2AudioEncoder._get_feat_extract_output_lengths``.
"""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.encode.models.common import EncoderModel, ParallelMLP, load_layer_norm
from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import ColumnParallelLinear, RowParallelLinear, TPContext, head_rows
from encoder_service.types import EncoderInput


def audio_output_lengths(num_frames: int) -> tuple[int, int]:
    """(length after conv2, number of embeddings after pooling) for a clip of ``num_frames`` mel frames."""
    after_conv = (num_frames - 1) // 2 + 1
    return after_conv, (after_conv - 2) // 2 + 1


class AudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, tp: TPContext) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.rows = head_rows(num_heads, self.head_dim, tp, "audio encoder_attention_heads")
        self.local_heads = len(self.rows) // self.head_dim
        self.q_proj = ColumnParallelLinear(dim, len(self.rows))
        self.k_proj = ColumnParallelLinear(dim, len(self.rows), bias=False)
        self.v_proj = ColumnParallelLinear(dim, len(self.rows))
        self.out_proj = RowParallelLinear(len(self.rows), dim, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            w, b = reader.get(f"{name}.{proj}.weight"), reader.get_optional(f"{name}.{proj}.bias")
            getattr(self, proj).load(w, b, self.rows)
        self.out_proj.load(
            reader.get(f"{name}.out_proj.weight"), reader.get(f"{name}.out_proj.bias"), self.rows
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.local_heads, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(x) * self.scaling)  # scaled before the product, as Whisper does
        o = nn.functional.scaled_dot_product_attention(
            q, heads(self.k_proj(x)), heads(self.v_proj(x)), attn_mask=key_mask, scale=1.0
        )
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn: int, act: str, tp: TPContext) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = AudioAttention(dim, num_heads, tp)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.mlp = ParallelMLP(dim, ffn, act, tp)

    def load(self, reader: CheckpointReader, name: str) -> None:
        load_layer_norm(self.self_attn_layer_norm, reader, f"{name}.self_attn_layer_norm")
        load_layer_norm(self.final_layer_norm, reader, f"{name}.final_layer_norm")
        self.self_attn.load(reader, f"{name}.self_attn")
        self.mlp.load(reader, f"{name}.fc1", f"{name}.fc2")

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        x = x + self.mlp(self.final_layer_norm(x))
        if x.dtype == torch.float16:
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class Qwen2AudioEncoder(EncoderModel):
    family = "qwen2-audio"
    modalities = ("audio",)

    def __init__(self, config: dict, tp: TPContext) -> None:
        super().__init__()
        ac = config["audio_config"]
        d = ac["d_model"]
        self.num_mel_bins, self.max_source_positions = ac["num_mel_bins"], ac["max_source_positions"]
        self.num_frames = self.max_source_positions * 2  # conv1 stride 1, conv2 stride 2
        self.hidden_size = config["text_config"]["hidden_size"]
        if ac.get("scale_embedding"):
            raise ValueError("scale_embedding=True audio towers are not supported")
        self.conv1 = nn.Conv1d(self.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Parameter(torch.empty(self.max_source_positions, d), requires_grad=False)
        act = ac.get("activation_function", "gelu")
        self.layers = nn.ModuleList(
            AudioEncoderLayer(d, ac["encoder_attention_heads"], ac["encoder_ffn_dim"], act, tp)
            for _ in range(ac["encoder_layers"])
        )
        self.layer_norm = nn.LayerNorm(d)
        self.projector = nn.Linear(d, self.hidden_size)

    def load_weights(self, reader: CheckpointReader) -> None:
        p = reader.resolve_prefix("model.audio_tower.", "audio_tower.")
        proj = reader.resolve_prefix("model.multi_modal_projector.", "multi_modal_projector.")
        for conv in ("conv1", "conv2"):
            getattr(self, conv).weight.data = reader.get(f"{p}{conv}.weight")
            getattr(self, conv).bias.data = reader.get(f"{p}{conv}.bias")
        self.embed_positions.data = reader.get(f"{p}embed_positions.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"{p}layers.{i}")
        load_layer_norm(self.layer_norm, reader, f"{p}layer_norm")
        self.projector.weight.data = reader.get(f"{proj}linear.weight")
        self.projector.bias.data = reader.get(f"{proj}linear.bias")

    def _num_frames(self, item: EncoderInput) -> int:
        if item.modality != "audio":
            raise ValueError(f"Qwen2-Audio's audio tower cannot encode {item.modality!r} item {item.mm_hash}")
        mask = item.tensors.get("feature_attention_mask")
        if mask is None:
            raise ValueError(f"audio item {item.mm_hash} lacks feature_attention_mask")
        frames = int(torch.as_tensor(mask).sum())
        if not 0 < frames <= self.num_frames:
            raise ValueError(
                f"audio item {item.mm_hash}: {frames} valid mel frames, expected 1..{self.num_frames}"
            )
        return frames

    def num_embeds(self, item: EncoderInput) -> int:
        return audio_output_lengths(self._num_frames(item))[1]

    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        if not items:
            return []
        device, dtype = self.conv1.weight.device, self.conv1.weight.dtype
        feats = []
        for it in items:
            f = torch.as_tensor(it.tensors["input_features"])
            if tuple(f.shape) != (1, self.num_mel_bins, self.num_frames):
                raise ValueError(
                    f"audio item {it.mm_hash}: input_features {tuple(f.shape)}, expected "
                    f"(1, {self.num_mel_bins}, {self.num_frames}) (Whisper features padded to 30 s)"
                )
            feats.append(f)
        lengths = [audio_output_lengths(self._num_frames(it)) for it in items]
        x = torch.cat(feats).to(device=device, dtype=dtype)
        x = nn.functional.gelu(self.conv1(x))
        x = nn.functional.gelu(self.conv2(x)).permute(0, 2, 1) + self.embed_positions
        valid = torch.tensor([conv_len for conv_len, _ in lengths], device=device)
        key_mask = (torch.arange(x.shape[1], device=device)[None, :] < valid[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = nn.functional.avg_pool1d(x.permute(0, 2, 1), kernel_size=2, stride=2).permute(0, 2, 1)
        x = self.projector(self.layer_norm(x))
        return [x[i, :n] for i, (_, n) in enumerate(lengths)]
