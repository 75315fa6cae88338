"""Incremental detokenization with stop strings, as a stream of text deltas."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is decoded from the whole id list each time (simple and exact for byte-level BPE) and
    released only up to the last complete character; with stop strings, the last
    ``max(len(stop)) - 1`` characters are held back until they can no longer start a stop string.
    """

    decode: Callable[[Sequence[int]], str]
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    _emitted: int = 0  # characters of the decoded text already released
    stopped: bool = False

    def add(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        text = self.decode(self.token_ids)
        if not final:
            while text.endswith(REPLACEMENT):  # an incomplete multi-byte character: wait for more tokens
                text = text[:-1]
        for s in self.stop:
            # Search only where a stop string could newly appear.
            idx = text.find(s, max(0, self._emitted - len(s) + 1))
            if idx != -1:
                self.stopped = True
                delta = text[self._emitted : idx]
                self._emitted = idx
                return delta
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self._emitted, len(text) - hold)
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
