"""The state cache's tensors: per linear-attention layer, a conv state and a recurrent state for each
slot (running sequences' slots first, then snapshot slots); ``llm_service/state_cache.py`` keeps
the books (which request holds which slot, which snapshot is filed under which block hash).

A step reads the states of its sequences at their chunk starts (their own slot, or the snapshot a
prefix hit restores, or zeros for a chunk starting at token 0) and writes the new ones, and the
snapshots it was asked to take, only when the whole step succeeded (``commit``): the engine replays
a failed step's other requests, and a state applied twice would be wrong where rewritten KV is not.

Layout per linear layer ``j``::

    conv[j]       [num_slots, conv_dim, K - 1]      model dtype
    recurrent[j]  [num_slots, H_v, d_k, d_v]        float32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

StateShapes = tuple[tuple[int, ...], tuple[int, ...]]  # one linear layer's (conv, recurrent) per slot
Snapshot = tuple[int, torch.Tensor, torch.Tensor]  # (slot, conv, recurrent)


@dataclass
class StepStates:
    """The step's sequences in batch order: query rows ``[q_start, q_start + q_len)`` start from
    ``read_slots[i]`` (zeros where ``fresh``) and end in ``write_slots[i]``; ``captures[i]``:
    ``(offset in the chunk, snapshot slot)`` to fill with the states after that many of its tokens.
    ``staged``/``snapshots``: what each linear layer computed, written by ``commit``."""

    q_starts: list[int]
    q_lens: list[int]
    read_slots: torch.Tensor  # [n] long
    write_slots: torch.Tensor  # [n] long
    fresh: torch.Tensor  # [n] bool
    captures: list[list[tuple[int, int]]]
    num_fresh: int = 0  # how many of ``fresh`` are set (none or all: ``read`` needs no select)
    staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    snapshots: dict[int, list[Snapshot]] = field(default_factory=dict)

    @property
    def decodes(self) -> list[int]:
        return [i for i, n in enumerate(self.q_lens) if n == 1]

    @property
    def prefills(self) -> list[int]:
        return [i for i, n in enumerate(self.q_lens) if n > 1]


@dataclass(frozen=True)
class StepSeq:
    """One chunk's part in the step (built by the runner from its request's ``StateAssignment``)."""

    num_tokens: int
    read_slot: int
    write_slot: int
    fresh: bool
    captures: list[tuple[int, int]]


class LinearStates:
    def __init__(
        self, shapes: list[StateShapes], num_slots: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.device = device
        self.conv = [torch.zeros((num_slots, *c), dtype=dtype, device=device) for c, _ in shapes]
        self.recurrent = [torch.zeros((num_slots, *r), dtype=torch.float32, device=device) for _, r in shapes]

    @staticmethod
    def slot_bytes(shapes: list[StateShapes], dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return sum(_numel(c) * elem + _numel(r) * 4 for c, r in shapes)

    def step(self, seqs: list[StepSeq]) -> StepStates:
        q_starts, row = [], 0
        for s in seqs:
            q_starts.append(row)
            row += s.num_tokens

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StepStates(
            q_starts,
            [s.num_tokens for s in seqs],
            longs([s.read_slot for s in seqs]),
            longs([s.write_slot for s in seqs]),
            torch.tensor([s.fresh for s in seqs], dtype=torch.bool, device=self.device),
            [list(s.captures) for s in seqs],
            sum(s.fresh for s in seqs),
        )

    def read(self, layer: int, step: StepStates) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the step's sequences' states for linear layer ``layer`` (zero where fresh)."""
        conv = self.conv[layer][step.read_slots]
        rec = self.recurrent[layer][step.read_slots]
        if step.num_fresh == 0:
            return conv, rec
        if step.num_fresh == len(step.q_lens):
            return torch.zeros_like(conv), torch.zeros_like(rec)
        keep = (~step.fresh)[:, None, None]  # where(), not a product: a slot's stale NaN must not leak
        return torch.where(keep, conv, 0.0), torch.where(keep[..., None], rec, 0.0)

    def commit(self, step: StepStates) -> None:
        for layer, (conv, rec) in step.staged.items():
            self.conv[layer].index_copy_(0, step.write_slots, conv.to(self.conv[layer].dtype))
            self.recurrent[layer].index_copy_(0, step.write_slots, rec.float())
        for layer, snaps in step.snapshots.items():
            if snaps:
                slots = torch.tensor([s for s, _, _ in snaps], dtype=torch.long, device=self.device)
                self.conv[layer].index_copy_(
                    0, slots, torch.stack([c for _, c, _ in snaps]).to(self.conv[layer].dtype)
                )
                self.recurrent[layer].index_copy_(0, slots, torch.stack([r for _, _, r in snaps]).float())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
