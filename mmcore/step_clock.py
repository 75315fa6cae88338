"""How much of its steps' wall time a step thread actually ran: the encoder's tower steps, the LLM's
engine steps.

A step thread that waits for a core (other processes on the node, the replica's own preprocessing
threads) or for the GIL shows wall time without CPU time. ``cpu_s / wall_s`` is that share; a
pool whose share is low on a busy node is starved, not slow: more of its replicas on the same
cores would not help, cores of its own would. Measured with ``time.thread_time`` (the calling
thread's CPU time, any OS), around the call only, on the thread that runs the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StepClock:
    """Totals of the steps ``run`` times; ``run`` is called from one thread at a time (a pool's step
    thread), the totals read from any (floats, each written whole)."""

    __slots__ = ("cpu_s", "last_cpu_s", "last_wall_s", "steps", "wall_s")

    def __init__(self) -> None:
        self.steps = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.last_wall_s = 0.0
        self.last_cpu_s = 0.0

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, timed in wall and in this thread's CPU time (a step that raises is not
        counted)."""
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        self.last_wall_s, self.last_cpu_s = wall, cpu
        self.steps += 1
        self.wall_s += wall
        self.cpu_s += cpu
        return out

    def stats(self) -> dict[str, float | int | None]:
        """The totals, and the share of the steps' wall time their thread ran (None before a step)."""
        return {
            "steps": self.steps,
            "step_wall_s": round(self.wall_s, 3),
            "step_cpu_s": round(self.cpu_s, 3),
            "step_cpu_share": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
        }
