"""How often each request has generated each token, kept from step to step for the penalties (vLLM's
output bin counts): a ``[slots, vocab]`` table with a slot per request that asks for a penalty.

Each step adds only the tokens a request generated since its last count (one sparse accumulate for the
whole batch), instead of rebuilding every row from its whole history. A request seen for the first
time (or whose output is shorter than what was counted: it was reset) is counted from its whole
output. Repetition penalties also need the prompt's tokens: a second, boolean table, filled once per
slot. ``release`` frees a request's slot when it leaves the engine.
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
        self._has_prompt: list[bool] = []
        self._free: list[int] = []
        self._out = torch.zeros(0, vocab, device=device)
        self._prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._one = torch.ones(1, device=device)

    def release(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def rows(
        self, keys: Sequence[Hashable], ctx: Sequence[RowTokens], prompt: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output counts of each ``keys[i]``'s request (``ctx[i]``) brought up to date, ``[n,
        vocab]``; with ``prompt``, also whether each token is in its prompt."""
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
        if toks:
            index = torch.tensor([rows, toks], device=self.device).unbind()
            self._out.index_put_(index, self._one, accumulate=True)
        slot_index = torch.tensor(slots, device=self.device)
        if not prompt:
            return self._out.index_select(0, slot_index), None
        self._fill_prompts(slots, ctx)
        return self._out.index_select(0, slot_index), self._prompt.index_select(0, slot_index)

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
        self._prompt = torch.cat(
            [self._prompt, torch.zeros(new - old, self.vocab, dtype=torch.bool, device=self.device)]
        )
        self._counted.extend([0] * (new - old))
        self._has_prompt.extend([False] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # popped lowest first

    def _fill_prompts(self, slots: list[int], ctx: Sequence[RowTokens]) -> None:
        rows, toks = [], []
        for slot, row in zip(slots, ctx, strict=True):
            if not self._has_prompt[slot]:
                self._prompt[slot] = False
                rows.extend([slot] * len(row.prompt_token_ids))
                toks.extend(row.prompt_token_ids)
                self._has_prompt[slot] = True
        if toks:
            self._prompt[torch.tensor(rows, device=self.device), torch.tensor(toks, device=self.device)] = (
                True
            )
