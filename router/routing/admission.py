"""Admission at the ingress: bounded work in flight, by count and by cost, refused fast past either.

Pure Python (no Ray, no torch): the ingress asks ``admit(cost)`` before any other work and gives the
ticket back when the response is over. A refusal is immediate, so a burst past capacity gets 503s
with ``Retry-After`` in milliseconds instead of queueing until it times out::

    cost = 1 + sum(media_cost[modality] for each item) + text_chars // text_chars_per_cost

    admit(cost) ── in_flight < max_requests and cost_in_flight + cost <= max_cost ──▶ Ticket
                └─ otherwise ──▶ Overloaded (503, Retry-After)     closed (draining) ──▶ 503

A request costlier than the whole budget is admitted only when nothing else is in flight (it is
clamped to the budget), so no valid request is refused forever.

Memory comes first: a request's body is held while it is read, before its cost is known, so the bytes
of the bodies being read or served are bounded apart (``max_body_bytes_in_flight``). A ``BodyLease``
reserves a body's ``Content-Length`` before its first byte is read (or, without one, its bytes as they
arrive); past the budget the reservation is refused (503, ``Retry-After``) and the body left unread.
The ticket takes the lease over at admission, so the bytes come back with it when the request ends;
a body larger than the whole budget is let in only alone, like a cost::

    reserve_body(lease, n) ── body_bytes_in_flight + (n - lease) <= max_body_bytes_in_flight ──▶ held
                           └─ otherwise (and another body in flight) ──▶ Overloaded (503)
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
    max_body_bytes_in_flight: int = 256 << 20  # request bodies held at once (read, or being served)


@dataclass
class BodyLease:
    """The body bytes one request holds of the budget, from its ``Content-Length`` (or first byte) to
    its end; ``AdmissionController.release_body`` (or its ticket's release) gives them back once."""

    reserved: int = 0
    released: bool = False


@dataclass
class Ticket:
    """One admitted request's share (and its body's bytes); ``AdmissionController.release`` takes it
    back once."""

    cost: int
    released: bool = False
    body: BodyLease | None = None


class AdmissionController:
    def __init__(self, limits: AdmissionLimits) -> None:
        if (
            min(limits.max_concurrent_requests, limits.max_concurrent_cost, limits.max_body_bytes_in_flight)
            < 1
        ):
            raise ValueError("admission limits must be positive")
        self.limits = limits
        self.in_flight = 0
        self.cost_in_flight = 0
        self.body_bytes_in_flight = 0
        self.admitted = 0
        self.refused = 0
        self.closed = False

    def cost(self, modalities: Iterable[str], text_chars: int) -> int:
        media = sum(self.limits.media_cost.get(m, 1) for m in modalities)
        return 1 + media + text_chars // self.limits.text_chars_per_cost

    def reserve_body(self, lease: BodyLease, nbytes: int) -> None:
        """Grow ``lease`` to ``nbytes`` (a body's ``Content-Length``, or what arrived of it so far);
        ``Overloaded`` if the budget cannot take it, and the lease keeps what it held."""
        extra = nbytes - lease.reserved
        if extra <= 0 or lease.released:
            return
        self._refuse_if_closed()
        lim = self.limits
        others = self.body_bytes_in_flight - lease.reserved
        if others > 0 and self.body_bytes_in_flight + extra > lim.max_body_bytes_in_flight:
            self.refused += 1
            raise Overloaded(
                f"the server is at capacity ({self.body_bytes_in_flight} bytes of request bodies in "
                f"flight, of {lim.max_body_bytes_in_flight}; this one needs {nbytes}); "
                f"retry after {lim.retry_after_s} s",
                retry_after_s=lim.retry_after_s,
            )
        lease.reserved += extra
        self.body_bytes_in_flight += extra

    def release_body(self, lease: BodyLease) -> None:
        if lease.released:
            return
        lease.released = True
        self.body_bytes_in_flight -= lease.reserved

    def _refuse_if_closed(self) -> None:
        if self.closed:
            self.refused += 1
            raise Overloaded("the server is shutting down; retry on another replica", "shutting_down", 1)

    def admit(self, cost: int, body: BodyLease | None = None) -> Ticket:
        """A ticket for a request of ``cost``; it takes over ``body`` (released with it). A refusal
        leaves ``body`` to its caller."""
        lim = self.limits
        cost = min(max(cost, 1), lim.max_concurrent_cost)
        self._refuse_if_closed()
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
        return Ticket(cost, body=body)

    def release(self, ticket: Ticket) -> None:
        if ticket.body is not None:
            self.release_body(ticket.body)
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
            "body_bytes_in_flight": self.body_bytes_in_flight,
            "admitted": self.admitted,
            "refused": self.refused,
            "closed": self.closed,
        }
