"""The mixed open-loop load of ``cluster.bench.pd_vs_colocated``: long multimodal prompts (several
distinct images and a paragraph each) arriving at random among short-prompt long-output text
requests, and what the client saw of it (decode ITL, TTFT per kind, goodput under an SLO).

Arrivals are two Poisson processes drawn from one seed (``MixedLoad.schedule``), so every server gets
the same requests at the same offsets from the start; each request is sent at its offset whether or
not earlier ones have ended (an open loop: a slow server queues, it does not slow the arrivals).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.bench.client import make_client, send_request
from cluster.bench.media import make_image_bytes
from cluster.bench.stats import RequestResult, percentile
from cluster.bench.workload import TOPICS, RequestSpec, data_url

LONG, SHORT = "long", "short"


@dataclass(frozen=True)
class MixedLoad:
    """Two request streams, each ``count`` requests arriving at ``rate`` per second (Poisson)."""

    model: str
    long_count: int = 30
    long_rate: float = 0.5
    long_images: int = 4
    image_size: int = 224  # px, square: 64 image tokens each on Qwen2-VL (14 px patches, 2x2 merge)
    long_words: int = 160  # a paragraph after the images: more prompt to prefill
    long_max_tokens: int = 32
    short_count: int = 120
    short_rate: float = 2.0
    short_max_tokens: int = 128
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.long_count} long at {self.long_rate:g}/s ({self.long_images} distinct {self.image_size} px "
            f"images + {self.long_words} words, {self.long_max_tokens} out) among {self.short_count} short at "
            f"{self.short_rate:g}/s (one sentence, {self.short_max_tokens} out); Poisson arrivals, "
            f"seed {self.seed}, ignore_eos, temperature 0"
        )

    def schedule(self) -> list[tuple[float, str, int]]:
        """(offset s, kind, index) of every request, sorted by offset; the same for one seed."""
        rng = random.Random(self.seed)
        out: list[tuple[float, str, int]] = []
        for kind, count, rate in (
            (LONG, self.long_count, self.long_rate),
            (SHORT, self.short_count, self.short_rate),
        ):
            t = 0.0
            for i in range(count):
                t += rng.expovariate(rate)
                out.append((t, kind, i))
        return sorted(out)

    def request(self, kind: str, i: int, run: str) -> RequestSpec:
        """Request ``i`` of ``kind``; ``run`` seeds the images and words, so a warm-up (another ``run``)
        shares nothing with the measured load and every server sees the same bytes."""
        rng = random.Random(f"{run}-{self.seed}-{kind}-{i}")
        words = " ".join(rng.choice(TOPICS) for _ in range(self.long_words if kind == LONG else 6))
        if kind == SHORT:
            text = f"Tell a long story about the {words}."
            return RequestSpec(SHORT, self.model, [{"type": "text", "text": text}])
        parts: list[Mapping[str, object]] = []
        for k in range(self.long_images):
            png = make_image_bytes(self.image_size, self.image_size, seed=rng.randrange(2**32) + k)
            parts.append({"type": "image_url", "image_url": {"url": data_url(png, "image/png")}})
        parts.append({"type": "text", "text": f"Compare these images; notes: {words}."})
        return RequestSpec(LONG, self.model, parts)

    def max_tokens(self, kind: str) -> int:
        return self.long_max_tokens if kind == LONG else self.short_max_tokens


async def run_mixed(
    base_url: str, load: MixedLoad, run: str, timeout_s: float = 300.0
) -> tuple[list[RequestResult], float]:
    """Every request of ``load`` sent at its offset; the results (in schedule order) and the wall time
    from the first send to the last answer. The request bodies (images encoded) are built first."""
    plan = [(t, kind, load.request(kind, i, run)) for t, kind, i in load.schedule()]
    client = make_client(base_url, timeout_s)
    start = time.perf_counter()

    async def one(at: float, kind: str, spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await send_request(client, spec, load.max_tokens(kind))

    try:
        results = await asyncio.gather(*(one(t, kind, spec) for t, kind, spec in plan))
    finally:
        await client.close()
    return list(results), time.perf_counter() - start


# -- what the client saw (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """A request meets it when its first token comes within its kind's TTFT bound and no gap between
    two of its streamed tokens exceeds ``max_itl_s`` (a stall the reader sees, however rare)."""

    ttft_long_s: float = 2.0
    ttft_short_s: float = 1.0
    max_itl_s: float = 0.2

    def describe(self) -> str:
        return (
            f"TTFT ≤ {self.ttft_long_s * 1000:.0f} ms (long) / ≤ {self.ttft_short_s * 1000:.0f} ms (short), "
            f"every inter-token gap ≤ {self.max_itl_s * 1000:.0f} ms"
        )

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None:
            return False
        bound = self.ttft_long_s if r.kind == LONG else self.ttft_short_s
        return r.ttft_s <= bound and max(r.itls_s, default=0.0) <= self.max_itl_s


@dataclass(frozen=True)
class MixedSummary:
    completed: int
    failed: int
    duration_s: float
    itl_p50_s: float | None  # every gap of every request (decode ITL)
    itl_p99_s: float | None
    short_itl_p99_s: float | None  # the short requests' gaps only: the decode the long prompts disturb
    ttft: dict[str, tuple[float, float] | None]  # kind -> (p50, p99)
    slo_met: int
    goodput: float  # requests meeting the SLO per second of the run

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def summarize_mixed(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> MixedSummary:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.itls_s]
    short_gaps = [g for r in ok if r.kind == SHORT for g in r.itls_s]
    ttft: dict[str, tuple[float, float] | None] = {}
    for kind in (LONG, SHORT):
        xs = [r.ttft_s for r in ok if r.kind == kind and r.ttft_s is not None]
        ttft[kind] = (percentile(xs, 50), percentile(xs, 99)) if xs else None
    met = sum(slo.met(r) for r in results)
    return MixedSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        itl_p50_s=percentile(gaps, 50) if gaps else None,
        itl_p99_s=percentile(gaps, 99) if gaps else None,
        short_itl_p99_s=percentile(short_gaps, 99) if short_gaps else None,
        ttft=ttft,
        slo_met=met,
        goodput=met / duration_s if duration_s > 0 else 0.0,
    )
