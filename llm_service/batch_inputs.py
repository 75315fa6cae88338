"""A scheduled batch's flat model inputs: every chunk's token ids, positions (M-RoPE's three axes where
the model uses them) and input rows (the media items' embeddings over their placeholder rows), in batch
order, and each chunk's state slots for a hybrid model (``StepSeq``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llm_service.errors import RequestFaults
from llm_service.linear_states import StepSeq
from llm_service.runner_state import RunnerState
from llm_service.scheduler import ScheduledChunk
from llm_service.sequence import Request


def _positions(
    model: Any, states: Mapping[str, RunnerState], req: Request, start: int, end: int, device: torch.device
) -> torch.Tensor:
    if not model.uses_mrope:
        return torch.arange(start, end, device=device)
    state, n = states[req.request_id], req.num_prompt_tokens
    assert state.mrope is not None, f"request {req.request_id} has no M-RoPE positions"
    parts = []
    if start < n:
        parts.append(state.mrope[:, start : min(end, n)])
    if end > n:
        parts.append(torch.arange(max(start, n), end, device=device).expand(3, -1) + state.delta)
    return torch.cat(parts, dim=1)


def flat_positions(
    model: Any, states: Mapping[str, RunnerState], chunks: list[ScheduledChunk], device: torch.device
) -> torch.Tensor:
    """Every chunk's positions, in batch order; decode runs built from ints, not per-chunk tensors."""
    if not model.uses_mrope:
        flat = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        return torch.tensor(flat, dtype=torch.long, device=device)
    parts: list[torch.Tensor | list[int]] = []
    for c in chunks:
        req, start, end = c.request, c.start, c.start + c.num_tokens
        if start < req.num_prompt_tokens:
            parts.append(_positions(model, states, req, start, end, device))
            continue
        # past the prompt: text positions, shifted; all 3 axes alike
        delta = states[req.request_id].delta
        if not parts or not isinstance(parts[-1], list):
            parts.append([])
        parts[-1].extend(range(start + delta, end + delta))  # type: ignore[union-attr]
    tensors = [
        p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long, device=device).expand(3, -1)
        for p in parts
    ]
    return torch.cat(tensors, dim=-1)


def flat_ids(chunks: list[ScheduledChunk], device: torch.device) -> torch.Tensor:
    ids = [t for c in chunks for t in token_ids(c.request, c.start, c.start + c.num_tokens)]
    return torch.tensor(ids, dtype=torch.long, device=device)


def flat_embeds(
    model: Any, states: Mapping[str, RunnerState], chunks: list[ScheduledChunk], ids: torch.Tensor
) -> torch.Tensor:
    """Every chunk's input rows, in batch order: one embedding lookup for the whole batch (``ids``),
    then each chunk's slices of its media items' embeddings written over their placeholder rows."""
    emb = model.embed_tokens(ids)
    width = getattr(model, "mm_row_width", emb.shape[1])
    if width > emb.shape[1]:  # DeepStack (Qwen3-VL): an item's levels ride after its main columns
        emb = torch.cat([emb, emb.new_zeros(emb.shape[0], width - emb.shape[1])], dim=1)
    row = 0
    for c in chunks:
        start, end = c.start, c.start + c.num_tokens
        for offset, length, embeds in states[c.request.request_id].mm:
            lo, hi = max(start, offset), min(end, offset + length)
            if lo >= hi:  # a chunk may hold only a slice of the item, or none of it
                continue
            if embeds is None:  # the scheduler parks such a request: never here
                raise RequestFaults({c.request.request_id: f"no embeddings for the item at {offset}"})
            emb[row + lo - start : row + hi - start] = embeds[lo - offset : hi - offset]
        row += c.num_tokens
    return emb


def step_seq(c: ScheduledChunk) -> StepSeq:
    """A chunk's state slots: it reads its own (or the snapshot it restores) and writes its own."""
    st = c.request.state
    assert st is not None, f"request {c.request.request_id} runs without a state slot"
    read = st.slot if st.restore_from is None else st.restore_from
    captures = [(pos - c.start, slot) for pos, slot in st.captures]
    return StepSeq(c.num_tokens, read, st.slot, c.start == 0, captures)


def token_ids(req: Request, start: int, end: int) -> list[int]:
    """``req.all_token_ids[start:end]`` without building the whole list (a decode reads one id)."""
    n = len(req.prompt_token_ids)
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    if end <= n:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - n]
