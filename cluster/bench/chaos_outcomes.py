"""Pure books of a chaos scenario (no I/O): each request's fate, and the scenario's table row.

A request of the load ends one of four ways:

  ok        the whole answer arrived
  coded     the server answered with an error that names its code (a 5xx/429 JSON body, or an SSE
            error event in a stream): the client can tell why and retry
  uncoded   any other failure: a connection cut, a 500 without a code, a broken stream
  lost      no end within the request's deadline (a hang)

A fault may cost requests ``coded`` failures; it must never cost ``uncoded`` or ``lost`` ones.
``cluster/bench/chaos_node.py`` and ``chaos_head.py`` drive the load and the faults and feed these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

OK, CODED, UNCODED, LOST = "ok", "coded", "uncoded", "lost"
VERDICTS = (OK, CODED, UNCODED, LOST)


@dataclass(frozen=True)
class Outcome:
    """One request of the load as the client saw it (times from ``time.monotonic``)."""

    kind: str
    start: float
    end: float
    verdict: str  # one of VERDICTS
    code: str | None = None  # the error code the server named (coded)
    detail: str = ""  # the exception, for uncoded and lost

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


def classify(exc: BaseException | None, timed_out: bool = False) -> tuple[str, str | None]:
    """(verdict, code) of a request that ended with ``exc`` (None: it succeeded); ``timed_out``: the
    client's deadline passed first. The ``openai`` client puts the body's ``error.code`` (a JSON
    error, or an SSE error event) on the exception as ``code``; without one the failure is uncoded."""
    if timed_out:
        return LOST, None
    if exc is None:
        return OK, None
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return CODED, code
    return UNCODED, None


@dataclass(frozen=True)
class ScenarioReport:
    """One fault's row: the counts of every verdict, the codes seen, and how the service came back."""

    scenario: str
    sent: int
    counts: dict[str, int]
    codes: dict[str, int]
    in_flight_at_fault: int  # requests open at the fault's instant
    first_ok_after_s: float | None  # fault -> the first success of a request sent after it
    full_capacity_s: float | None  # fault -> every pool back at its target size, answering
    leaks: dict[str, object] = field(default_factory=dict)  # what is still held after the run
    notes: tuple[str, ...] = ()

    @property
    def leak_count(self) -> int:
        return sum(1 for v in self.leaks.values() if v)


def report(
    scenario: str,
    outcomes: Sequence[Outcome],
    fault_at: float | None,
    full_capacity_s: float | None,
    leaks: dict[str, object] | None = None,
    notes: Sequence[str] = (),
) -> ScenarioReport:
    counts = Counter(o.verdict for o in outcomes)
    codes = Counter(o.code for o in outcomes if o.code is not None)
    first_ok = None
    in_flight = 0
    if fault_at is not None:
        in_flight = sum(1 for o in outcomes if o.start <= fault_at <= o.end)
        first_ok = min((o.end for o in outcomes if o.verdict == OK and o.start > fault_at), default=None)
    uncoded = sorted({o.detail[:160] for o in outcomes if o.verdict in (UNCODED, LOST)})
    return ScenarioReport(
        scenario=scenario,
        sent=len(outcomes),
        counts={v: counts.get(v, 0) for v in VERDICTS},
        codes=dict(sorted(codes.items())),
        in_flight_at_fault=in_flight,
        first_ok_after_s=None if first_ok is None or fault_at is None else first_ok - fault_at,
        full_capacity_s=full_capacity_s,
        leaks=dict(leaks or {}),
        notes=tuple(notes) + tuple(f"uncoded/lost: {d}" for d in uncoded),
    )


HEADERS = [
    "scenario",
    "sent",
    "ok",
    "coded",
    "uncoded",
    "lost",
    "codes",
    "in flight at fault",
    "first ok after (s)",
    "full capacity after (s)",
    "leaks",
]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def row(r: ScenarioReport) -> list[str]:
    codes = ", ".join(f"{c} {n}" for c, n in r.codes.items()) or "-"
    leaks = "0" if not r.leak_count else "; ".join(f"{k}={v}" for k, v in r.leaks.items() if v)
    c = r.counts
    return [
        r.scenario,
        str(r.sent),
        str(c[OK]),
        str(c[CODED]),
        str(c[UNCODED]),
        str(c[LOST]),
        codes,
        str(r.in_flight_at_fault),
        _num(r.first_ok_after_s),
        _num(r.full_capacity_s),
        leaks,
    ]
