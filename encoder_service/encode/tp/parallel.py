"""Megatron-style sharded linears for the encoder towers, and the collectives they need.

``weights`` mode::

    x ──▶ ColumnParallelLinear (rows of W split: rank r holds heads / fc1 units of its slice)
      ──▶ local attention or activation on the shard (no communication)
      ──▶ RowParallelLinear (columns of W split) ──▶ partial sums ──all-reduce──▶ + bias ──▶ y

One all-reduce per row-parallel layer; the bias is added once, after the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPContext:
    """Where this process sits in its encoder TP group. ``group=None`` means the default group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def shard(self, total: int, what: str) -> slice:
        """This rank's contiguous slice of ``total`` units (heads, MLP units), which must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the encoder TP size {self.size}")
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def all_gather_rows(x: torch.Tensor, sizes: list[int], tp: TPContext) -> list[torch.Tensor]:
    """Gather every rank's ``[sizes[r], ...]`` tensor; all ranks know ``sizes``, so pad to the max."""
    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(out, padded.contiguous(), group=tp.group)
    return [t[:n] for t, n in zip(out, sizes, strict=True)]


class ColumnParallelLinear(nn.Module):
    """``y_shard = x W_shard^T + b_shard``; the caller picks the output rows (``out_index``)."""

    def __init__(self, in_features: int, out_rows: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_rows, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_rows), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None, out_index: torch.Tensor) -> None:
        self.weight.data = weight[out_index].contiguous()
        if self.bias is not None:
            if bias is None:
                raise ValueError("checkpoint lacks a bias this layer expects")
            self.bias.data = bias[out_index].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard W[:, shard]^T) + b``: input features split, output reduced."""

    def __init__(self, in_cols: int, out_features: int, tp: TPContext, bias: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_cols), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None, in_index: torch.Tensor) -> None:
        self.weight.data = weight[:, in_index].contiguous()
        if self.bias is not None:
            if bias is None:
                raise ValueError("checkpoint lacks a bias this layer expects")
            self.bias.data = bias.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(nn.functional.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


def head_rows(num_heads: int, head_dim: int, tp: TPContext, what: str = "num_heads") -> torch.Tensor:
    """Row indices (of a ``[num_heads * head_dim, in]`` weight) of this rank's heads."""
    sl = tp.shard(num_heads, what)
    return torch.arange(sl.start * head_dim, sl.stop * head_dim)


def unit_rows(total: int, tp: TPContext, what: str) -> torch.Tensor:
    sl = tp.shard(total, what)
    return torch.arange(sl.start, sl.stop)
