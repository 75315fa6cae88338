"""Admission at the ingress: bounded work in flight, by count and by cost, refused fast past either.

Pure Python (no Ray, no torch): the ingress asks ``admit(cost)`` before any other work and gives the
ticket back when the response is over. A refusal is immediate, so a burst past capacity gets 503s
with ``Retry-After`` in milliseconds instead of queueing until it times out::

    cost = 1 + sum(media_cost[modality] for each item) + text_chars // text_chars_per_cost

    admit(cost) ── in_flight < max_requests and cost_in_flight + cost <= max_cost ──▶ Ticket
                └─ otherwise ──▶ Overloaded (503, Retry-After)     closed (draining) ──▶ 503

A request costlier than the whole budget is admitted only when nothing else is in flight (it is
clamped to the budget), so no valid request is refused forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class Overloaded(RuntimeError):
    """The ingress is at capacity (or draining); the client should retry after ``retry_after_s``."""

    status_code = 503

    def __init__(self, message: str, code: str = "overloaded", retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionLimits:
    max_concurrent_requests: int = 256
    max_concurrent_cost: int = 1024
    media_cost: Mapping[str, int] = field(default_factory=lambda: {"image": 4, "video": 16, "audio": 4})
    text_chars_per_cost: int = 4096
    retry_after_s: int = 1


@dataclass
class Ticket:
    """One admitted request's share; ``AdmissionController.release`` takes it back once."""

    cost: int
    released: bool = False


class AdmissionController:
    def __init__(self, limits: AdmissionLimits) -> None:
        if limits.max_concurrent_requests < 1 or limits.max_concurrent_cost < 1:
            raise ValueError("admission limits must be positive")
        self.limits = limits
        self.in_flight = 0
        self.cost_in_flight = 0
        self.admitted = 0
        self.refused = 0
        self.closed = False

    def cost(self, modalities: Iterable[str], text_chars: int) -> int:
        media = sum(self.limits.media_cost.get(m, 1) for m in modalities)
        return 1 + media + text_chars // self.limits.text_chars_per_cost

    def admit(self, cost: int) -> Ticket:
        lim = self.limits
        cost = min(max(cost, 1), lim.max_concurrent_cost)
        if self.closed:
            self.refused += 1
            raise Overloaded("the server is shutting down; retry on another replica", "shutting_down", 1)
        if (
            self.in_flight >= lim.max_concurrent_requests
            or self.cost_in_flight + cost > lim.max_concurrent_cost
        ):
            self.refused += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_flight} requests, cost {self.cost_in_flight} of "
                f"{lim.max_concurrent_cost} in flight; this one costs {cost}); retry after {lim.retry_after_s} s",
                retry_after_s=lim.retry_after_s,
            )
        self.in_flight += 1
        self.cost_in_flight += cost
        self.admitted += 1
        return Ticket(cost)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        self.cost_in_flight -= ticket.cost

    def close(self) -> None:
        """Draining: refuse everything from now on; tickets already out are still released."""
        self.closed = True

    def stats(self) -> dict[str, int | bool]:
        return {
            "in_flight": self.in_flight,
            "cost_in_flight": self.cost_in_flight,
            "admitted": self.admitted,
            "refused": self.refused,
            "closed": self.closed,
        }
