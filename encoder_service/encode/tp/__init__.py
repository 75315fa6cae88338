"""Tensor parallelism for the encoder towers: the group handle, sharded linears, collectives, launch."""

from __future__ import annotations

from encoder_service.encode.tp.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    all_gather_rows,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPContext", "all_gather_rows"]
