"""E/P/D's KV hand-off over ``torch.distributed``: NCCL between GPU replicas, gloo between CPU ones.

The prefill rank sends a request's blocks straight out of its paged KV cache; the decode rank receives
them straight into the blocks it allocated (``LLMEngine.reserve_import``'s ``ImportSlots``). Each
layer's cache is ``[2, num_blocks, block_size, heads, head_dim]``, so one block's K (or V) is a
contiguous ``[block_size, heads, head_dim]`` slice: one send/recv per (layer, K|V, block), all posted
at once (``batch_isend_irecv``: NCCL coalesces them into one group call), and no contiguous copy of the
sequence on either side, no trip through host memory on GPUs::

    prefill rank  cache[l][k, src_ids[j]] ──isend──▶ irecv──▶ cache[l][k, dst_ids[j]]  decode rank

Not wired into serving yet: it needs a process group between a prefill and a decode replica, which
the cluster does not form (the serving path moves the KV over the direct link, llm_service/serve/
handoff.py); docs/disaggregation.md says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _ops(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    peer: int,
    op: object,
    group: dist.ProcessGroup | None,
) -> list[dist.P2POp]:
    ops = []
    for cache in kv_caches:
        for k_or_v in (0, 1):
            for block_id in block_ids:
                part = cache[k_or_v, block_id]
                assert part.is_contiguous(), "a paged KV block must be one contiguous slice"
                ops.append(dist.P2POp(op, part, peer, group))  # type: ignore[arg-type]
    return ops


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def send_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Send blocks ``block_ids`` of every layer's cache to rank ``dst``; returns the bytes sent."""
    _run(_ops(kv_caches, block_ids, dst, dist.isend, group))
    return sum(2 * len(block_ids) * c[0, 0].numel() * c.element_size() for c in kv_caches)


def recv_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    src: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Receive the blocks rank ``src`` sends (``send_blocks``, in the same order) into ``block_ids``."""
    _run(_ops(kv_caches, block_ids, src, dist.irecv, group))
