"""Pieces shared by the encoder towers: the model interface, activations, sharded attention/MLP loading."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from encoder_service.encode.models.weights import CheckpointReader
from encoder_service.encode.tp.parallel import ColumnParallelLinear, RowParallelLinear, TPContext, unit_rows
from encoder_service.types import EncoderInput


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "silu": nn.functional.silu,
    "relu": nn.functional.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class EncoderModel(nn.Module, ABC):
    """One family's tower(s) up to the LLM's hidden size.

    ``encode`` takes items of this family only and returns one ``[num_embeds(item), hidden_size]``
    tensor per item, in order. Items are packed into one forward pass; no item attends to another.
    """

    family: str
    hidden_size: int
    modalities: tuple[str, ...]

    @abstractmethod
    def num_embeds(self, item: EncoderInput) -> int:
        """How many embeddings ``item`` becomes, computed from its tensors (not trusted from the record)."""

    @abstractmethod
    def encode(self, items: list[EncoderInput]) -> list[torch.Tensor]: ...

    @abstractmethod
    def load_weights(self, reader: CheckpointReader) -> None: ...


class ParallelMLP(nn.Module):
    """fc1 (column-parallel) → activation → fc2 (row-parallel, all-reduced)."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.rows = unit_rows(hidden, tp, "MLP hidden size")
        self.fc1 = ColumnParallelLinear(dim, len(self.rows))
        self.fc2 = RowParallelLinear(len(self.rows), dim, tp)
        self.act = activation(act)

    def load(self, reader: CheckpointReader, fc1: str, fc2: str) -> None:
        self.fc1.load(reader.get(f"{fc1}.weight"), reader.get_optional(f"{fc1}.bias"), self.rows)
        self.fc2.load(reader.get(f"{fc2}.weight"), reader.get_optional(f"{fc2}.bias"), self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def load_layer_norm(norm: nn.LayerNorm, reader: CheckpointReader, name: str) -> None:
    norm.weight.data = reader.get(f"{name}.weight")
    norm.bias.data = reader.get(f"{name}.bias")


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 and cast back before the weight (as HF's Qwen2 norms)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def load(self, reader: CheckpointReader, name: str) -> None:
        self.weight.data = reader.get(f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GatedParallelMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: gate and up column-parallel over the same units, down row-parallel."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPContext, bias: bool = True) -> None:
        super().__init__()
        self.rows = unit_rows(hidden, tp, "MLP intermediate_size")
        self.gate_proj = ColumnParallelLinear(dim, len(self.rows), bias=bias)
        self.up_proj = ColumnParallelLinear(dim, len(self.rows), bias=bias)
        self.down_proj = RowParallelLinear(len(self.rows), dim, tp, bias=bias)
        self.act = activation(act)

    def load(self, reader: CheckpointReader, name: str) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w, b = reader.get(f"{name}.{proj}.weight"), reader.get_optional(f"{name}.{proj}.bias")
            getattr(self, proj).load(w, b, self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
