"""Incremental detokenization with stop strings, as a stream of text deltas, in linear time.

Only a window of the ids is decoded per call, as in vLLM's and TGI's incremental detokenizers::

    ids:   ... | lead-in ids | ids not yet committed (the tail) |
               ^ _prefix     ^ _commit                          ^ len(ids)

The text of ``ids[:_commit]`` is final: ``_commit`` is a point where the byte stream ends on a
complete character, so decoding on from it gives the same text as decoding everything. Each call
decodes ``ids[_prefix:]`` and drops the lead-in's text (decoding from an earlier point keeps
tokenizers that strip a leading space, e.g. SentencePiece's "▁", consistent with a full decode).
When the tail's text ends on a complete character (no trailing U+FFFD), the commit point moves to
the end and the window shrinks back to the last call's ids. Trailing U+FFFD are an incomplete
multi-byte character: held back until later tokens complete it, or until ``final``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
# A tail still ending on U+FFFD after this many ids holds invalid bytes (a UTF-8 character has at
# most 4), not only an incomplete character: look for an earlier safe commit point inside it.
MAX_PENDING_IDS = 16


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation, at ``final``, is
    ``decode(all ids)`` cut before the first stop string (the one that completes first; of those
    completing in the same call, the one starting earliest). With stop strings, the last
    ``max(len(stop)) - 1`` characters are held back until they can no longer start a stop string.
    """

    decode: Callable[[Sequence[int]], str]
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    stopped: bool = False
    _prefix: int = 0  # where the decoded window starts (the commit point before ``_commit``)
    _commit: int = 0  # the text of token_ids[:_commit] is final
    _lead_len: int = 0  # len(decode(token_ids[_prefix:_commit]))
    _tail_stable: int = 0  # characters of the tail's text already passed on as stable
    _next_split: int = MAX_PENDING_IDS  # tail length (in ids) at which to look for a split point
    _held: str = ""  # stable text not yet released (it might start a stop string)

    def add(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly releasable text. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        return self._release(self._advance(final), final)

    def _advance(self, final: bool) -> str:
        """Decode the window; return the text that became stable, and move the commit point."""
        ids = self.token_ids
        tail = self.decode(ids[self._prefix :])[self._lead_len :]
        stable = tail if final else tail.rstrip(REPLACEMENT)
        new = stable[self._tail_stable :]
        self._tail_stable = max(self._tail_stable, len(stable))
        if not tail.endswith(REPLACEMENT):
            self._move_commit(len(ids), len(self.decode(ids[self._commit :])), tail_stable=0)
        elif len(ids) - self._commit >= self._next_split:
            new += self._split_stuck_tail(tail)
        return new

    def _move_commit(self, to: int, lead_len: int, tail_stable: int) -> None:
        """Make ``token_ids[:to]`` final; ``lead_len`` is len(decode(token_ids[_commit:to])),
        ``tail_stable`` how much of the text after ``to`` was already passed on."""
        self._prefix, self._commit, self._lead_len = self._commit, to, lead_len
        self._tail_stable = tail_stable
        self._next_split = MAX_PENDING_IDS

    def _split_stuck_tail(self, tail: str) -> str:
        """Commit at the latest id boundary that splits the tail's bytes between characters: decoding
        both sides apart gives the same text, and the right side starts with a byte (so later bytes
        cannot join the left side's last character). Returns text that became stable by it."""
        ids, start = self.token_ids, self._commit
        self._next_split = len(ids) - start + MAX_PENDING_IDS  # if nothing splits, retry later
        if self.decode(ids[start:]) != tail:  # a leading-space tokenizer: keep the lead-in window
            return ""
        for q in range(len(ids) - 1, max(start, len(ids) - MAX_PENDING_IDS), -1):
            # ``ids[q:]`` must hold bytes (non-empty text): ids without any (skipped special tokens)
            # prove nothing, the byte that completes or breaks the character is still to come.
            rest = self.decode(ids[q:])
            head = self.decode(ids[start:q])
            if rest and head + rest == tail:
                released = head[self._tail_stable :]
                self._move_commit(q, len(head), max(0, self._tail_stable - len(head)))
                return released
        return ""

    def _release(self, new_text: str, final: bool) -> str:
        """Pass on stable text, holding back what could still start a stop string."""
        buf = self._held + new_text
        # A stop string can only newly appear in ``buf``: everything released before it is at least
        # ``max(len(stop)) - 1`` characters back, too far for one to start there and end here.
        hits = [i for s in self.stop if (i := buf.find(s)) != -1]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        cut = max(0, len(buf) - hold)
        self._held = buf[cut:]
        return buf[:cut]
