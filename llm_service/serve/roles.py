"""An E/P/D replica's role books, as ``LLMServer`` builds them (llm_service/serve/deployment.py): what it
takes from the wiring (``HandoffWiring``), and a prefill replica's ``PrefillHandoffs`` or a decode
replica's ``DecodeImports`` (with its pair groups under ``kv_transfer: collective``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llm_service.engine_loop import EngineLoop
from llm_service.serve.handoff import Address, DecodeImports, KVSource, PrefillHandoffs, TransferStats
from llm_service.serve.kv_pair import DecodePairs

if TYPE_CHECKING:
    from llm_service.engine import LLMEngine


@dataclass(frozen=True)
class HandoffWiring:
    """What an E/P/D replica takes from the wiring: where its own link listens (a prefill replica's
    answer names it), a link to a prefill replica (a decode replica pulls over it), the deadlines."""

    address: Callable[[], Awaitable[Address]]
    connect: Callable[[Address], KVSource]
    deadline_s: float = 30.0  # a prefill replica holds a hand-off's blocks this long for its pull
    timeout_s: float = 10.0  # a decode replica's pull fails past this
    pull_chunks: bool = False  # a prefill replica answers at once; the decode side pulls chunk by chunk
    transfer: str = "link"  # "collective": the KV moves on a pair group (llm_service/serve/kv_pair.py)


def role_books(
    role: str,
    handoff: HandoffWiring | None,
    loop: EngineLoop,
    engine: LLMEngine,
    replica_id: str,
    kv_stats: TransferStats,
) -> tuple[PrefillHandoffs | None, DecodeImports | None]:
    """A ``prefill`` replica's pins or a ``decode`` replica's imports (the other one None)."""
    if handoff is None:
        raise ValueError(f"an LLM replica of role {role!r} needs its hand-off wiring")
    if role == "prefill":
        return PrefillHandoffs(loop, engine, replica_id, handoff.address, handoff.deadline_s, kv_stats), None
    pairs = None
    if handoff.transfer == "collective":
        pairs = DecodePairs(engine, handoff.address, handoff.timeout_s, kv_stats, replica_id)
    return None, DecodeImports(loop, engine, handoff.connect, handoff.timeout_s, kv_stats, replica_id, pairs)
