"""Encoder batch planning: the compute budget per step and the split of a step's items across TP ranks.

Pure Python (no torch, no Ray), so the router and the runner share it and it is unit-tested in
milliseconds. Items are named by their index in the caller's list; every function returns indices.
"""

from __future__ import annotations

from collections.abc import Sequence


class EncoderBudgetError(ValueError):
    """An item needs more embeddings than one encoder step may compute."""


def plan_encoder_batches(
    items_num_embeds: Sequence[int], max_num_encoder_input_tokens: int
) -> list[list[int]]:
    """Cut the items, in order, into steps whose embedding counts sum to at most the budget.

    Greedy and order-preserving: a step takes items until the next one would overflow it, so
    concatenating the steps gives ``0..n-1`` back. An item larger than the whole budget can never be
    encoded and raises ``EncoderBudgetError`` here, before any compute (the config layer raises the
    budget to fit the largest item it admits).
    """
    if max_num_encoder_input_tokens <= 0:
        raise ValueError(f"max_num_encoder_input_tokens must be positive, got {max_num_encoder_input_tokens}")
    steps: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(items_num_embeds):
        if n < 0:
            raise ValueError(f"item {i} has a negative embedding count {n}")
        if n > max_num_encoder_input_tokens:
            raise EncoderBudgetError(
                f"item {i} needs {n} encoder embeddings, more than max_num_encoder_input_tokens="
                f"{max_num_encoder_input_tokens}; raise the budget or shrink the item"
            )
        if current and used + n > max_num_encoder_input_tokens:
            steps.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        steps.append(current)
    return steps


def split_items_across_ranks(items_num_embeds: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Assign items to ranks for ``mm_encoder_tp_mode="data"``, balanced by embedding count.

    Largest item first onto the least-loaded rank (ties: the item with the lower index first, the
    rank with the lower number). Deterministic, so every rank computes the same plan on its own.
    Each rank's list is sorted by item index. Ranks may get no item when there are fewer items.
    """
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    order = sorted(range(len(items_num_embeds)), key=lambda i: (-items_num_embeds[i], i))
    loads = [0] * num_ranks
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        assignment[rank].append(i)
        loads[rank] += items_num_embeds[i]
    return [sorted(items) for items in assignment]
