"""Pure statistics of the multi-turn chat benchmark (no I/O): per turn, TTFT and the prefix-cache hit
rate over all conversations, and one server's turns against another's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.bench.stats import percentile


@dataclass(frozen=True)
class TurnResult:
    """One request of one conversation as the client saw it; times in seconds."""

    conversation: int
    turn: int  # 1-based
    ok: bool
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class TurnRow:
    turn: int
    completed: int
    failed: int
    ttft_mean_s: float
    ttft_p50_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        """Σ cached_tokens / Σ prompt_tokens over the turn's completed requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def turn_rows(results: Sequence[TurnResult]) -> list[TurnRow]:
    """One row per turn, in turn order; a failed request (or one without a TTFT) counts only as failed."""
    rows = []
    for turn in sorted({r.turn for r in results}):
        ok = [r for r in results if r.turn == turn and r.ok and r.ttft_s is not None]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        rows.append(
            TurnRow(
                turn=turn,
                completed=len(ok),
                failed=sum(r.turn == turn for r in results) - len(ok),
                ttft_mean_s=statistics.fmean(ttfts) if ttfts else math.nan,
                ttft_p50_s=percentile(ttfts, 50) if ttfts else math.nan,
                prompt_tokens=sum(r.prompt_tokens for r in ok),
                cached_tokens=sum(r.cached_tokens for r in ok),
            )
        )
    return rows


def later_turns_hit_rate(rows: Sequence[TurnRow]) -> float:
    """Σ cached / Σ prompt over every turn after the first (the turns a re-sent conversation can hit)."""
    later = [r for r in rows if r.turn > 1]
    prompt = sum(r.prompt_tokens for r in later)
    return sum(r.cached_tokens for r in later) / prompt if prompt else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def fmt(x: float, digits: int = 2) -> str:
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def render_table(by_server: dict[str, list[TurnRow]], hybrid: str, attention: str) -> str:
    """A markdown table: per turn and server, mean / p50 TTFT (ms) and hit rate; then ``hybrid`` over
    ``attention`` (TTFT mean, hit rate); a last row sums turns 2+ for the hit rates."""
    names = list(by_server)
    head = ["turn"] + [f"{n}: TTFT mean / p50 ms, hit" for n in names]
    head += [f"{hybrid}/{attention}: TTFT mean", "hit rate"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join([":---"] + ["---:"] * (len(head) - 1)) + " |"]
    turns = sorted({r.turn for rows in by_server.values() for r in rows})
    for turn in turns:
        cells = [str(turn)]
        row_of = {n: next((r for r in by_server[n] if r.turn == turn), None) for n in names}
        for n in names:
            r = row_of[n]
            cells.append(
                "—"
                if r is None
                else f"{fmt(r.ttft_mean_s * 1e3, 1)} / {fmt(r.ttft_p50_s * 1e3, 1)}, {fmt(r.hit_rate)}"
                + (f" ({r.failed} failed)" if r.failed else "")
            )
        h, a = row_of.get(hybrid), row_of.get(attention)
        cells.append(fmt(ratio(h.ttft_mean_s, a.ttft_mean_s)) if h and a else "—")
        cells.append(fmt(ratio(h.hit_rate, a.hit_rate)) if h and a else "—")
        lines.append("| " + " | ".join(cells) + " |")
    later = {n: later_turns_hit_rate(by_server[n]) for n in names}
    cells = ["2+"] + [f"hit {fmt(later[n])}" for n in names]
    cells += ["", fmt(ratio(later.get(hybrid, math.nan), later.get(attention, math.nan)))]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal(
    rows_hybrid: Sequence[TurnRow], rows_attention: Sequence[TurnRow], turn: int = 3
) -> dict[str, float]:
    """The issue's goal: hit rate (turns 2+) hybrid/attention >= 0.9 and turn-``turn`` mean TTFT
    hybrid/attention <= 1.2 (and the p50's ratio beside it)."""
    th = next((r for r in rows_hybrid if r.turn == turn), None)
    ta = next((r for r in rows_attention if r.turn == turn), None)
    return {
        "hit_rate_ratio": ratio(later_turns_hit_rate(rows_hybrid), later_turns_hit_rate(rows_attention)),
        f"turn{turn}_ttft_ratio": ratio(th.ttft_mean_s, ta.ttft_mean_s) if th and ta else math.nan,
        f"turn{turn}_ttft_p50_ratio": ratio(th.ttft_p50_s, ta.ttft_p50_s) if th and ta else math.nan,
    }


def all_turns_hit_rate(rows: Sequence[TurnRow]) -> float:
    """Σ cached / Σ prompt over every turn, the first included (it can hit a shared template head)."""
    prompt = sum(r.prompt_tokens for r in rows)
    return sum(r.cached_tokens for r in rows) / prompt if prompt else math.nan


def policy_table(by_server: dict[str, list[TurnRow]], variants: dict[str, int], attention: str) -> str:
    """A markdown table, one row per snapshot policy (``variants``: server -> snapshot interval in
    blocks, 0: prompt ends only): hit rate over all turns and over turns 2+, mean TTFT per turn (ms),
    and the last turn's mean TTFT over ``attention``'s."""
    turns = sorted({r.turn for rows in by_server.values() for r in rows})
    head = ["snapshots", "hit all turns", "hit turns 2+"] + [f"turn {t} TTFT" for t in turns]
    head.append(f"turn {turns[-1]} x {attention}" if turns else "x")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join([":---"] + ["---:"] * (len(head) - 1)) + " |"]
    last_a = next((r for r in by_server.get(attention, []) if turns and r.turn == turns[-1]), None)
    for name, interval in variants.items():
        rows = by_server.get(name)
        if rows is None:
            continue
        label = f"every {interval} blocks" if interval else "prompt ends only"
        cells = [label, fmt(all_turns_hit_rate(rows)), fmt(later_turns_hit_rate(rows))]
        by_turn = {r.turn: r for r in rows}
        cells += [fmt(by_turn[t].ttft_mean_s * 1e3, 1) if t in by_turn else "—" for t in turns]
        last = by_turn.get(turns[-1]) if turns else None
        cells.append(fmt(ratio(last.ttft_mean_s, last_a.ttft_mean_s)) if last and last_a else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
