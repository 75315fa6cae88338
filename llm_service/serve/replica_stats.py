"""What an LLM replica reports (llm_service/serve/deployment.py's ``LLMServer``): ``stats`` (the
routers' and ``/stats``' view: engine counters, its role's hand-off books, swap space, pair groups) and
the custom autoscaling metrics the pools' policies read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_service.outputs import EngineStats

if TYPE_CHECKING:
    from llm_service.serve.deployment import LLMServer
    from llm_service.serve.handoff import DecodeImports, PrefillHandoffs


def replica_stats(server: LLMServer, s: EngineStats) -> dict[str, object]:
    """``server``'s counters, ``s`` its engine's latest."""
    prefill, decode = server._prefill, server._decode
    return {
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "num_free_blocks": s.num_free_blocks,
        "num_total_blocks": s.num_total_blocks,
        "kv_usage": s.kv_usage,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "skipped_embedding_fetches": server.skipped_fetches,
        "prefix_query_tokens": s.prefix_query_tokens,
        "num_preemptions": s.num_preemptions,
        **_reported_if_any(num_free_window_blocks=s.num_free_window_blocks),
        **_reported_if_any(num_free_state_slots=s.num_free_state_slots),
        "output_channels": len(server.channels),
        "replica_id": server.replica_id,
        "role": server.role,
        **server.loop.step_clock.stats(),
        **(server.kv_stats.as_dict() if server.role != "both" else {}),
        **({"kv_pins_held": len(prefill.pins)} if prefill is not None else {}),
        **_pair_counts(prefill, decode),
        **(_swap_counters(decode) if decode is not None else {}),
    }


def autoscaling_stats(s: EngineStats, queued_prompt_tokens: int, ttft_p90_ms: float) -> dict[str, float]:
    """Custom autoscaling metrics read by cluster.autoscaling_policy.LLMLoadPolicy."""
    return {
        "kv_usage": float(s.kv_usage),
        "num_running": float(s.num_running),
        "num_waiting": float(s.num_waiting),
        "queued_prompt_tokens": float(queued_prompt_tokens),  # E/P/D's prefill pool scales on it
        "ttft_p90_ms": ttft_p90_ms,  # and on this, given a target_ttft_ms
    }


def _swap_counters(decode: DecodeImports) -> dict[str, float]:
    """A decode replica's swap space (llm_service/kv_swap.py): swaps so far, host bytes held
    now, its budget, and the requests ended because their copy would have passed it."""
    swap = decode.engine.swap
    return {
        "kv_swapped_out": swap.swapped_out,
        "kv_swap_bytes": swap.held_bytes,
        "kv_swap_budget_bytes": swap.budget_bytes or 0,
        "kv_swap_refused": swap.refused,
    }


def _pair_counts(prefill: PrefillHandoffs | None, decode: DecodeImports | None) -> dict[str, int]:
    """Pair groups held now (``llm.kv_transfer: collective``), either side."""
    if prefill is not None:
        return {"kv_pairs": len(prefill.pairs)}
    if decode is not None and decode.pairs is not None:
        return {"kv_pairs": len(decode.pairs)}
    return {}


def _reported_if_any(**counts: int | None) -> dict[str, int]:
    """The counts the model has (a window group's, a hybrid's state slots), for ``stats``."""
    return {k: v for k, v in counts.items() if v is not None}
