"""A failing engine step bisected down to the request(s) that broke it, the others' tokens kept:
``execute_isolating`` runs the step for ``LLMEngine.step``, and on an exception replays it in parts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llm_service.errors import RequestFaults
from llm_service.scheduler import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from llm_service.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Sampled = dict[str, tuple[int, object]]


def execute_isolating(runner: ModelRunner, sched: SchedulerOutput) -> tuple[Sampled, dict[str, str]]:
    """Run the step; if it raises, find the request(s) at fault and run it for the others.

    Returns ``(sampled, faults)``: ``faults`` maps each culprit to what went wrong. Culprits are
    the ones a ``RequestFaults`` names, then any group that still fails is halved until single
    requests fail alone. If every request not so named fails alone too, the fault is not one
    request's: the original exception is raised. Replaying chunks is safe: a chunk writes KV only
    into its own request's not-yet-computed slots (never a shared, cached block) and rewrites
    the same values; seeded generators are rewound before each attempt.
    """
    rng = runner.rng_states(sched)
    try:
        return runner.execute(sched), {}
    except Exception as exc:
        first = exc
    sampled: Sampled = {}
    named: dict[str, str] = {}
    alone: dict[str, str] = {}
    todo: list[tuple[list[ScheduledChunk], Exception]] = [(sched.chunks, first)]
    while todo:
        group, err = todo.pop()
        hit = {c.request.request_id for c in group} & set(getattr(err, "faults", ()))
        if isinstance(err, RequestFaults) and hit:
            named.update({rid: err.faults[rid] for rid in hit})
            rest = [c for c in group if c.request.request_id not in hit]
            parts = [rest] if rest else []
        elif len(group) == 1:
            alone[group[0].request.request_id] = f"{type(err).__name__}: {err}"
            continue
        else:
            parts = _halves(group)
        for part in parts:
            result = _attempt(runner, part, rng)
            if isinstance(result, Exception):
                todo.append((part, result))
            else:
                sampled.update(result)
    if alone and len(named) + len(alone) == len(sched.chunks):
        raise first  # every request that is not named fails alone too: not one request's fault
    faults = {**named, **alone}
    for rid, msg in faults.items():
        logger.warning("request %s failed in an engine step (the others went on): %s", rid, msg)
    return sampled, faults


def _attempt(
    runner: ModelRunner, chunks: list[ScheduledChunk], rng: dict[str, torch.Tensor]
) -> Sampled | Exception:
    runner.restore_rng_states(SchedulerOutput(chunks), rng)
    try:
        return runner.execute(SchedulerOutput(chunks))
    except Exception as e:
        return e


def _halves(chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
    mid = len(chunks) // 2
    return [part for part in (chunks[:mid], chunks[mid:]) if part]
