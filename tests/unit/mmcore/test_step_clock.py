"""StepClock: a step's wall time and its thread's CPU time, apart (mmcore/step_clock.py)."""

from __future__ import annotations

import threading
import time

import pytest

from mmcore.step_clock import StepClock


def _burn(cpu_s: float) -> str:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass
    return "burnt"


def test_a_busy_step_counts_its_cpu_and_a_waiting_one_only_its_wall() -> None:
    clock = StepClock()
    assert clock.stats()["step_cpu_share"] is None
    assert clock.run(_burn, 0.03) == "burnt"
    assert clock.cpu_s >= 0.03 and clock.wall_s >= clock.cpu_s
    busy_cpu = clock.cpu_s
    clock.run(time.sleep, 0.05)  # waiting: wall time, next to no CPU
    assert clock.last_wall_s >= 0.05 and clock.last_cpu_s < 0.01
    stats = clock.stats()
    assert stats["steps"] == 2
    assert (
        stats["step_cpu_share"] is not None and stats["step_cpu_share"] < busy_cpu / (busy_cpu + 0.05) + 0.1
    )


def test_only_the_calling_threads_cpu_counts() -> None:
    stop = threading.Event()
    other = threading.Thread(target=lambda: [_burn(0.005) for _ in iter(stop.is_set, True)])
    other.start()  # another thread burning CPU while the step sleeps
    try:
        clock = StepClock()
        clock.run(time.sleep, 0.05)
    finally:
        stop.set()
        other.join()
    assert clock.cpu_s < 0.01


def test_a_step_that_raises_is_not_counted() -> None:
    clock = StepClock()
    with pytest.raises(ZeroDivisionError):
        clock.run(lambda: 1 / 0)
    assert clock.steps == 0 and clock.wall_s == 0.0
