"""cluster.bench's progress bar counts every request of a scenario as it ends, whatever its order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.bench import client as bench_client
from cluster.bench.serving import progress_bar


def test_the_bar_counts_each_request_as_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[int] = []

    async def fake_send(client: Any, spec: int, max_tokens: int) -> int:
        await asyncio.sleep(0.001 * (5 - spec))  # later ones end first
        ended.append(spec)
        return spec

    monkeypatch.setattr(bench_client, "send_request", fake_send)
    seen: list[int] = []
    with progress_bar(5, "scenario") as bar:

        def done() -> None:
            bar.update()
            seen.append(bar.n)

        results, _ = asyncio.run(bench_client.run_requests(None, [0, 1, 2, 3, 4], 5, 8, on_done=done))  # type: ignore[arg-type, list-item]
        assert bar.n == 5
    assert results == [0, 1, 2, 3, 4] and seen == [1, 2, 3, 4, 5] and ended == [4, 3, 2, 1, 0]
