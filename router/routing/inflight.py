"""A router's own in-flight amounts per replica, with their recent history (pure).

Replicas report their load to Serve every ``request_routing_stats_period_s`` and the report reaches a
router later still (the controller's long poll). The report counts this router's own calls too, so
``max(report, own)`` keeps a replica busy after a burst has ended until its next report arrives, and a
request whose prefix that replica holds is sent elsewhere for load it no longer has (the repeat then
computes its whole prompt again). Here the replica stamps its report (``REPORTED_AT``, wall time), the
router subtracts what it itself had in flight there at that stamp and adds what it has now: the other
callers' share of the report, plus this router's exact count.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable

REPORTED_AT = "reported_at"  # the routing-stats key of a report's wall-clock stamp


class InFlight:
    """Exact amounts this router has in flight per replica, and when each changed (``horizon_s`` back)."""

    def __init__(self, horizon_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.horizon_s = horizon_s
        self._clock = clock
        self.by_request: dict[str, tuple[Hashable, float]] = {}
        self.by_replica: dict[Hashable, float] = {}
        self._history: dict[Hashable, deque[tuple[float, float]]] = {}  # replica -> (time, amount after)

    def add(self, request_id: str, replica: Hashable, amount: float) -> None:
        self.by_request[request_id] = (replica, amount)
        self._set(replica, self.by_replica.get(replica, 0.0) + amount)

    def done(self, request_id: str) -> None:
        entry = self.by_request.pop(request_id, None)
        if entry is not None:
            replica, amount = entry
            self._set(replica, max(0.0, self.by_replica.get(replica, 0.0) - amount))

    def forget(self, replica: Hashable) -> None:
        self.by_replica.pop(replica, None)
        self._history.pop(replica, None)

    def at(self, replica: Hashable, when: float) -> float:
        """What this router had in flight on ``replica`` at wall time ``when`` (the last change at or
        before it; before the history kept, its oldest amount)."""
        history = self._history.get(replica)
        if not history:
            return self.by_replica.get(replica, 0.0)
        amount = history[0][1]
        for t, after in history:
            if t > when:
                break
            amount = after
        return amount

    def load(self, replica: Hashable, reported: float, reported_at: float | None) -> float:
        """The replica's load as this router sees it: the report's share from other callers, plus its own
        in flight now. An unstamped report (an older replica) is taken as it is: ``max(report, own)``."""
        own = self.by_replica.get(replica, 0.0)
        if reported_at is None:
            return max(reported, own)
        return max(0.0, reported - self.at(replica, reported_at)) + own

    def _set(self, replica: Hashable, amount: float) -> None:
        now = self._clock()
        history = self._history.setdefault(replica, deque())
        if not history:
            history.append((float("-inf"), self.by_replica.get(replica, 0.0)))
        history.append((now, amount))
        # keep one entry at or before the horizon: the amount in force from then on
        while len(history) > 1 and history[1][0] <= now - self.horizon_s:
            history.popleft()
        self.by_replica[replica] = amount
