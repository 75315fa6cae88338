"""The encoder replica's step policy: a FIFO of items from every request, cut into steps under the
compute budget. Pure Python (no torch, no Ray): ``EncoderServer`` only drives it.

    push(entry) ──▶ [ FIFO of entries, queued_embeds counted ] ──next_step()──▶ ≤ budget per step

A step takes entries in arrival order until the next would overflow ``max_num_encoder_input_tokens``
(the first always goes: admission checked it fits), so many small requests share a step and one
huge request cannot hold the rest for longer than one step. Entries whose caller left are skipped.

``step_embeds`` ends a step early, once it holds that many embeddings. Every item of a step waits for
the whole step, so a step larger than the device needs to run at full speed only delays its first
items: on CPU a step of 4 small images encodes as many embeddings per second as one of 32
(``python -m cluster.bench.encoder``), and a burst of 29 requests cut into steps of ~6 has its
first items in the LLM's queue while the rest still encode.

``apart``: a request whose items are handed on one by one (overlap prefill) wants each as soon as
it is encoded, since the LLM prefills up to its first missing item: a step ends before a second
item of such a request, in FIFO order (README, "Overlap prefill": what it changed). Items of other
requests still share a step.

The FIFO is bounded in embeddings (``max_queued_embeds``): ``admit`` refuses a request's items at once
(``EncoderOverloaded``, a 503 with Retry-After) when they would overflow it, unless the FIFO is empty.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from mmcore.errors import Overloaded


class HasNumEmbeds(Protocol):
    @property
    def num_embeds(self) -> int: ...


T = TypeVar("T", bound=HasNumEmbeds)


class EncoderOverloaded(Overloaded):
    """The encoder replica's FIFO is full."""


class EncoderQueue(Generic[T]):
    def __init__(
        self,
        max_num_encoder_input_tokens: int,
        is_cancelled: Callable[[T], bool],
        max_queued_embeds: int | None = None,
        step_embeds: int | None = None,
        apart: Callable[[T], str | None] | None = None,
    ) -> None:
        """``apart(entry)``: a key (its request) for an entry whose request takes its items one
        step each; None where it shares steps freely."""
        if max_num_encoder_input_tokens <= 0:
            raise ValueError("max_num_encoder_input_tokens must be positive")
        if max_queued_embeds is not None and max_queued_embeds <= 0:
            raise ValueError("max_queued_embeds must be positive")
        if step_embeds is not None and step_embeds <= 0:
            raise ValueError("step_embeds must be positive")
        self.budget = max_num_encoder_input_tokens
        self.step_embeds = min(step_embeds or self.budget, self.budget)
        self.max_queued_embeds = max_queued_embeds
        self._is_cancelled = is_cancelled
        self._apart = apart
        self._fifo: deque[T] = deque()
        self.queued_embeds = 0  # waiting in the FIFO plus taken by the step being computed

    def __len__(self) -> int:
        return len(self._fifo)

    def check(self, entry: T, what: str) -> None:
        """Admission: an item larger than one step can never be encoded."""
        if entry.num_embeds > self.budget:
            raise ValueError(
                f"{what} needs {entry.num_embeds} embeddings, more than "
                f"max_num_encoder_input_tokens={self.budget}"
            )

    def admit(self, entries: list[T]) -> None:
        """Bound: refuse ``entries`` (one request's items) if they would overflow the FIFO."""
        more = sum(e.num_embeds for e in entries)
        bound = self.max_queued_embeds
        if bound is not None and self.queued_embeds and self.queued_embeds + more > bound:
            raise EncoderOverloaded(
                f"the encoder queue holds {self.queued_embeds} embeddings; {more} more would pass "
                f"max_queued_embeddings={bound}"
            )

    def push(self, entry: T) -> None:
        self._fifo.append(entry)
        self.queued_embeds += entry.num_embeds

    def next_step(self) -> list[T]:
        """Entries for the next step, oldest first, within the budget and up to ``step_embeds``;
        cancelled ones are dropped."""
        step: list[T] = []
        total = 0
        apart: set[str] = set()  # requests that take one item per step and have theirs in this one
        while self._fifo and (
            not step or (total < self.step_embeds and total + self._fifo[0].num_embeds <= self.budget)
        ):
            entry = self._fifo[0]
            if self._is_cancelled(entry):
                self._fifo.popleft()
                self.queued_embeds -= entry.num_embeds
                continue
            key = self._apart(entry) if self._apart is not None else None
            if key is not None:
                if key in apart:
                    break  # the step ends here; FIFO order is kept
                apart.add(key)
            self._fifo.popleft()
            step.append(entry)
            total += entry.num_embeds
        return step

    def done(self, step: list[T]) -> None:
        """The step was computed (or failed): its embeddings are no longer queued."""
        self.queued_embeds -= sum(e.num_embeds for e in step)
