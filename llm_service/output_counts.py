"""How often each request has generated each token, kept from step to step for the penalties (vLLM's
output bin counts): a ``[slots, vocab]`` table with a slot per request that asks for a penalty.

Each step adds only the tokens a request generated since its last count (one sparse accumulate for the
whole batch), instead of rebuilding every row from its whole history. A request seen for the first
time (or whose output is shorter than what was counted: it was reset) is counted from its whole
output. Repetition penalties also need which tokens the prompt or the output holds: a second table of
0/1 floats (``seen``), filled from the prompt once per slot and kept up to date with the output's new
tokens (floats, so the penalty is arithmetic rather than a slower boolean select). ``release`` frees
a request's slot when it leaves the engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch


class RowTokens(Protocol):
    """What the penalties and ``min_tokens`` read of a sampling row's request (a ``Request`` is one)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def stop_token_ids(self) -> frozenset[int]: ...


class OutputCounts:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self._slots: dict[Hashable, int] = {}
        self._counted: list[int] = []  # tokens of the slot's output already in its row
        self._has_prompt: list[bool] = []  # the slot's ``seen`` row holds its prompt and output
        self._free: list[int] = []
        self._out = torch.zeros(0, vocab, device=device)
        self._seen = torch.zeros(0, vocab, device=device)
        self._one = torch.ones(1, device=device)
        self._index: tuple[tuple[int, ...], torch.Tensor] = (
            (),
            torch.zeros(0, dtype=torch.long, device=device),
        )

    def release(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def rows(
        self, keys: Sequence[Hashable], ctx: Sequence[RowTokens], prompt: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output counts of each ``keys[i]``'s request (``ctx[i]``) brought up to date, ``[n,
        vocab]``; with ``prompt``, also 1.0 where a token is in its prompt or its output, else 0.0."""
        slots = [self._slot(k) for k in keys]
        reset, rows, toks = [], [], []
        for slot, row in zip(slots, ctx, strict=True):
            out, counted = row.output_token_ids, self._counted[slot]
            if len(out) < counted:
                reset.append(slot)
                counted = 0
            if len(out) > counted:
                new = out[counted:]
                rows.extend([slot] * len(new))
                toks.extend(new)
            self._counted[slot] = len(out)
        if reset:
            self._out[reset] = 0.0
            for slot in reset:
                self._has_prompt[slot] = False  # its ``seen`` row is rebuilt below when asked for
        if toks:
            index = torch.tensor([rows, toks], device=self.device).unbind()
            self._out.index_put_(index, self._one, accumulate=True)
            self._seen.index_put_(index, self._one)
        slot_index = self._slot_index(slots)
        if not prompt:
            return self._out.index_select(0, slot_index), None
        self._fill_prompts(slots, ctx)
        return self._out.index_select(0, slot_index), self._seen.index_select(0, slot_index)

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """``slots`` as a tensor, the last step's when the batch's slots are the same."""
        key = tuple(slots)
        if key != self._index[0]:
            self._index = (key, torch.tensor(slots, dtype=torch.long, device=self.device))
        return self._index[1]

    def _slot(self, key: Hashable) -> int:
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[key] = slot
        self._counted[slot] = 0
        self._has_prompt[slot] = False
        self._out[slot] = 0.0
        return slot

    def _grow(self) -> None:
        old = self._out.shape[0]
        new = max(8, 2 * old)
        self._out = torch.cat([self._out, torch.zeros(new - old, self.vocab, device=self.device)])
        self._seen = torch.cat([self._seen, torch.zeros(new - old, self.vocab, device=self.device)])
        self._counted.extend([0] * (new - old))
        self._has_prompt.extend([False] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # popped lowest first

    def _fill_prompts(self, slots: list[int], ctx: Sequence[RowTokens]) -> None:
        rows, toks = [], []
        for slot, row in zip(slots, ctx, strict=True):
            if not self._has_prompt[slot]:
                self._seen[slot] = self._out[slot].sign()  # the output counted so far
                rows.extend([slot] * len(row.prompt_token_ids))
                toks.extend(row.prompt_token_ids)
                self._has_prompt[slot] = True
        if toks:
            self._seen.index_put_(torch.tensor([rows, toks], device=self.device).unbind(), self._one)
