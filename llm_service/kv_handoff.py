"""The hand-off of a request's KV from a prefill replica to a decode replica: its records and the
prefill side's pins (pure: no torch, no Ray)::

  ingress ──prefill(spec)──────────▶ prefill replica: the prompt computed (chunked, prefix cache and
          ◀──KVHandoff──────────────   encoder cache as in a colocated pool), the first token sampled;
                                        the prompt's blocks pinned (``HandoffPins``) until pulled
  ingress ──submit(spec + KVHandoff)─▶ decode replica: the leading full blocks its own prefix cache
                                        holds are taken, the rest allocated (``ImportSlots``);
          decode ──pull_kv(rid, from_block, window_from)──▶ prefill replica (over the direct link)
          decode ◀──KVBlocks (those blocks only)──  pin released: the blocks stay in its prefix cache
                                        written block by block into the allocated blocks, registered
                                        under the same chained hashes; the request runs on from the
                                        first token, its tokens streamed on the decode replica's channel
  A pin lasts until its pull or its deadline, whichever comes first; a failed pull frees the decode
  side's blocks (the ingress prefills the request again).

What moves per family (``HeldKV`` on the prefill side, ``ImportSlots`` on the decode side):

  full-attention layers   the prompt's blocks from the first one the decode side's cache lacks
  sliding-window layers   (Gemma 3/4: their own block group) only the blocks the decode side's first
                          query still reads, ``[(P - window + 1) // block_size, cdiv(P, block_size))``;
                          the decode side's table holds the null block before them, as a colocated
                          request's does once its window has passed them
  KV-shared layers        (Gemma 4) nothing: they own no cache, they read their owner's
  linear-attention layers (Qwen3.5) the request's conv and recurrent state after its ``P`` prompt
                          tokens, written into the state slot the decode side gave the request;
                          and the prefill side's snapshot at the prompt's last full block, where it
                          took one (as a colocated engine does), filed on the decode side under that
                          block's hash: a preempted request resumes from there
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llm_service.outputs import RequestOutput
from mmcore.errors import Overloaded
from mmcore.wire import from_fields, to_fields


class KVTransferFailed(RuntimeError):
    """The decode replica could not get a request's KV (the prefill replica died or let its pin go):
    its blocks are freed there and the ingress prefills the request again (503 if it cannot)."""

    status_code = 503
    code = "kv_transfer_failed"
    retry_after_s = 1

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the message across pickling
        return (type(self), self.args)


class DecodeRefused(Overloaded):
    """A decode replica is short of what an import needs (blocks, window blocks, a state slot): it
    allocated nothing, and the prefill side's pin stands, so the ingress tries another decode replica
    (``replica_id`` last); a 503 ``overloaded`` with Retry-After when none has room in time."""

    def __init__(self, message: str, replica_id: str = "") -> None:
        super().__init__(message)
        self.replica_id = replica_id

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps ``replica_id`` across pickling
        return (type(self), (self.args[0], self.replica_id))


@dataclass(frozen=True)
class KVHandoff:
    """A prefill replica's answer: the first output and, unless that ended the request, where its KV
    waits. ``block_hashes``: the prompt's full blocks' chained hashes (llm_service/prefix_hash.py),
    which the decode replica recomputes and checks before it registers the imported blocks."""

    request_id: str
    replica_id: str
    first: RequestOutput  # the first token; finished (stop, length): nothing to hand off
    address: tuple[str, int] | None = None  # the prefill replica's direct link
    num_tokens: int = 0  # prompt tokens whose KV is held (all of them)
    num_blocks: int = 0  # blocks holding them (the last may be partial)
    block_hashes: tuple[bytes, ...] = ()
    deadline_s: float = 0.0  # how long the prefill replica holds the blocks for the pull
    # besides ``num_blocks``, what a decode replica allocates to import it (router.routing.decode_choice)
    num_window_blocks: int = 0  # a sliding-window family's window-group blocks still read
    num_state_slots: int = 0  # a hybrid family's linear-attention state slot
    refused_by: tuple[str, ...] = ()  # decode replicas that refused it as overloaded: tried last
    # answered before its first token (``kv_pull_chunks``): the decode replica pulls the prompt's full
    # blocks as the prefill computes them (``pull_kv_chunks``), the rest and the first token at the end
    early: bool = False

    @property
    def handed_off(self) -> bool:
        return not self.first.finished

    def to_wire(self) -> dict[str, object]:
        """Its fields for ``mmcore.wire.pack`` (inside ``LLMRequestSpec``'s form), the first output as
        its own wire bytes."""
        return {**to_fields(self, ("first",)), "first": self.first.to_wire()}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> KVHandoff:  # Any: msgpack's map, checked by from_fields
        return from_fields(KVHandoff, d, first=RequestOutput.from_wire(d["first"]))


@dataclass(frozen=True)
class KVBlocks:
    """What crosses the wire: blocks ``[from_block, from_block + num_blocks)`` of a request, per
    KV-writing layer one buffer of ``[2, num_blocks, block_size, heads, head_dim]`` (K and V) values
    of ``dtype``, raw bytes in the layer's shape (a sliding-window layer's: its window blocks from
    ``window_from``, so its own count); a hybrid model's linear-attention state after the prompt,
    per linear layer its conv state then its recurrent state (``state_shapes``, ``state_dtypes``)."""

    request_id: str
    from_block: int
    num_blocks: int
    dtype: str
    shapes: list[tuple[int, ...]]
    data: list[bytes]
    window_from: int = 0
    snapshot: bool = False  # ``states`` holds a second set: the snapshot at the last full prompt block
    state_shapes: list[tuple[int, ...]] = field(default_factory=list)
    state_dtypes: list[str] = field(default_factory=list)
    states: list[bytes] = field(default_factory=list)
    first: RequestOutput | None = None  # an early hand-off's last pull: its first output
    # an early hand-off's last pull: the prompt's full blocks' chained hashes, as the prefill side
    # computed them (a plain hand-off sends them in ``KVHandoff.block_hashes``), checked by the decode side
    block_hashes: tuple[bytes, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self.data) + sum(len(s) for s in self.states)


@dataclass(frozen=True)
class HeldKV:
    """What a prefill replica holds of a handed-off request for its pull: its full-group blocks (the
    last may be partial); a window group's table up to the prompt's end, whose entries before
    ``window_first`` are the null block (dropped: no later query reads them); a hybrid model's state
    slot."""

    block_ids: list[int]
    window_ids: list[int] = field(default_factory=list)
    window_first: int = 0
    state_slot: int | None = None
    snapshot_slot: int | None = None  # the state snapshot at the prompt's last full block (pinned)


@dataclass(frozen=True)
class ImportSlots:
    """The decode replica's blocks for an imported request: ``hit_blocks`` leading full blocks found in
    its own prefix cache (not pulled), then ``block_ids`` to fill with the pulled ones; a window
    group's blocks ``window_ids`` for the prompt's window blocks from ``window_from`` on; a hybrid
    model's ``state_slot`` for the pulled state."""

    hit_blocks: int
    block_ids: list[int]
    window_from: int = 0
    window_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    snapshot_slot: int | None = None  # reserved for the prefill side's snapshot, if it sends one


@dataclass
class _Pin:
    held: HeldKV
    expires_at: float
    generation: int
    pulling: bool = False


@dataclass
class HandoffPins:
    """The prefill replica's books of handed-off requests whose blocks it holds for a pull. A pin ends
    once: its pull finished (``done``) or its deadline passed unpulled (``expire``); either way the
    caller frees the request's blocks (``LLMEngine.release_handoff``). A pull started in time runs
    to its end."""

    clock: Callable[[], float] = time.monotonic
    _pins: dict[str, _Pin] = field(default_factory=dict)
    _generations: int = 0

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, request_id: str, held: HeldKV, deadline_s: float) -> int:
        """Hold ``held`` for a pull; a request prefilled again replaces its earlier pin (whose blocks
        the engine freed). Returns the pin's generation, for ``expire``."""
        self._generations += 1
        self._pins[request_id] = _Pin(held, self.clock() + deadline_s, self._generations)
        return self._generations

    def take(self, request_id: str) -> HeldKV | None:
        """Start the pull: what the request holds, or None (unknown, expired, or pulled already)."""
        pin = self._pins.get(request_id)
        if pin is None or pin.pulling or self.clock() > pin.expires_at:
            return None
        pin.pulling = True
        return pin.held

    def done(self, request_id: str) -> bool:
        """The pull ended (sent or failed): True if the caller should free the blocks now."""
        return self._pins.pop(request_id, None) is not None

    def drop(self, request_id: str) -> bool:
        """Its hand-off was abandoned (every decode replica refused it): True if unpulled (dropped:
        the caller frees the blocks now, not at the deadline); a pull in progress keeps it."""
        return self.expire(request_id)

    def expire(self, request_id: str, generation: int | None = None) -> bool:
        """Its deadline: True if unpulled (dropped: the caller frees the blocks); a pull in progress
        keeps it until ``done``; ``generation``: only that pin, not one that replaced it."""
        pin = self._pins.get(request_id)
        if pin is None or pin.pulling or generation not in (None, pin.generation):
            return False
        del self._pins[request_id]
        return True
