"""``RecentTTFT``: an LLM replica's time to a first token over its last ``window_s`` seconds, as a
p90, for the prefill pool's autoscaling policy (``ttft_p90_ms``; cluster/autoscaling.py's
``with_ttft``). Pure: no torch, no Ray.

A request's TTFT here is the engine's: from entering it to its first token (``RequestTiming.queue +
prefill``, on the output that ends it on this replica: a prefill replica's hand-off), so it grows with
the prompts queued before it and with the chunks of other prompts between its own."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from llm_service.outputs import RequestOutput

WINDOW_S = 10.0  # Serve averages the reports over the pool's look_back_period_s on top of this
MAX_SAMPLES = 4096  # the window's newest, whatever the rate


class RecentTTFT:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, TTFT in s)

    def observe(self, outputs: Iterable[RequestOutput]) -> None:
        """The TTFTs of the requests whose last output on this replica is among ``outputs``."""
        now = self.clock()
        for out in outputs:
            if out.timing is not None and out.new_token_ids:
                self._samples.append((now, out.timing.queue + out.timing.prefill))

    def p90_ms(self) -> float:
        """The window's TTFT p90 in milliseconds (nearest rank); 0.0 with no first token in it."""
        cutoff = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        values = sorted(s for _, s in self._samples)
        return 1000.0 * values[math.ceil(0.9 * len(values)) - 1]
