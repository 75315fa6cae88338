"""The state cache's tensors: per linear-attention layer, a conv state and a recurrent state for each
slot of the pool (``llm_service/state_cache.py`` keeps the books: which request holds which slot).

A step reads the states of its sequences at their chunk starts and writes the new ones only when
the whole step succeeded (``commit``): the engine replays a failed step's other requests, and a
state applied twice would be wrong where rewritten KV is not. A chunk starting at token 0 (a new or
preempted-and-resumed request) starts from zero states, whatever the slot held before.

Layout per linear layer ``j``::

    conv[j]       [num_slots, conv_dim, K - 1]      model dtype
    recurrent[j]  [num_slots, H_v, d_k, d_v]        float32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

StateShapes = tuple[tuple[int, ...], tuple[int, ...]]  # one linear layer's (conv, recurrent) per slot


@dataclass
class StepStates:
    """The step's sequences in batch order: query rows ``[q_start, q_start + q_len)`` read and write
    ``slots[i]``; ``fresh[i]``: start from zero states. ``staged``: each layer's new states."""

    q_starts: list[int]
    q_lens: list[int]
    slots: torch.Tensor  # [n] long
    fresh: torch.Tensor  # [n] bool
    staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def decodes(self) -> list[int]:
        return [i for i, n in enumerate(self.q_lens) if n == 1]

    @property
    def prefills(self) -> list[int]:
        return [i for i, n in enumerate(self.q_lens) if n > 1]


class LinearStates:
    def __init__(
        self, shapes: list[StateShapes], num_slots: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.conv = [torch.zeros((num_slots, *c), dtype=dtype, device=device) for c, _ in shapes]
        self.recurrent = [torch.zeros((num_slots, *r), dtype=torch.float32, device=device) for _, r in shapes]

    @staticmethod
    def slot_bytes(shapes: list[StateShapes], dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return sum(_numel(c) * elem + _numel(r) * 4 for c, r in shapes)

    def step(self, q_lens: list[int], starts: list[int], slots: list[int]) -> StepStates:
        q_starts, row = [], 0
        for n in q_lens:
            q_starts.append(row)
            row += n
        device = self.conv[0].device if self.conv else torch.device("cpu")
        return StepStates(
            q_starts,
            list(q_lens),
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor([s == 0 for s in starts], dtype=torch.bool, device=device),
        )

    def read(self, layer: int, step: StepStates) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the step's sequences' states for linear layer ``layer`` (zero where fresh)."""
        keep = (~step.fresh)[:, None, None]  # where(), not a product: a slot's stale NaN must not leak
        conv = self.conv[layer][step.slots]
        rec = self.recurrent[layer][step.slots]
        return torch.where(keep, conv, 0.0), torch.where(keep[..., None], rec, 0.0)

    def commit(self, step: StepStates) -> None:
        for layer, (conv, rec) in step.staged.items():
            self.conv[layer].index_copy_(0, step.slots, conv.to(self.conv[layer].dtype))
            self.recurrent[layer].index_copy_(0, step.slots, rec.float())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
