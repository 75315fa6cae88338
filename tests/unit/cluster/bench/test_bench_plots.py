"""cluster/bench/plots.py: the figures show the numbers of the tables they sit beside."""

from __future__ import annotations

from pathlib import Path

from cluster.bench.cpu_profile import ProcessCost, ScenarioProfile
from cluster.bench.plots import cpu_figure, latency_figure, write
from cluster.bench.vs_report import LOADS, LoadResult

IMAGE, TEXT = LOADS[0], LOADS[2]


def _result(server: str, load: object, scale: float) -> LoadResult:
    metrics = {
        f"{p}_{m}_ms": scale * (i + 1)
        for i, (p, m) in enumerate((p, m) for m in ("ttft", "itl") for p in ("median", "p90", "p99"))
    }
    costs = [ProcessCost(1, "ingress", "Ingress", 40.0 * scale), ProcessCost(2, "llm", "LLM", 60.0 * scale)]
    return LoadResult(server, load, metrics, ScenarioProfile(str(load), 20, 10.0, None, costs))  # type: ignore[arg-type]


def test_latency_bars_are_the_percentiles_per_server() -> None:
    results = [_result("vLLM", IMAGE, 1.0), _result("mmserve", IMAGE, 2.0)]
    fig = latency_figure(results, ["vLLM", "mmserve"], [IMAGE])
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1, 2, 3, 4, 5, 6, 2, 4, 6, 8, 10, 12]  # vLLM's six, then mmserve's
    assert [t.get_text() for t in ax.get_xticklabels()][:3] == ["TTFT p50", "TTFT p90", "TTFT p99"]


def test_cpu_bars_stack_each_kind_per_request() -> None:
    results = [_result("vLLM", TEXT, 1.0), _result("mmserve", TEXT, 0.5)]
    fig = cpu_figure(results, ["vLLM", "mmserve"], [TEXT])
    (ax,) = fig.axes
    # kinds in name order (ingress, llm), each a bar per server: 40 and 60 CPU-ms over 20 requests
    assert [p.get_height() for p in ax.patches] == [2.0, 1.0, 3.0, 1.5]
    assert [p.get_y() for p in ax.patches] == [0.0, 0.0, 2.0, 1.0]


def test_write_saves_both_pngs(tmp_path: Path) -> None:
    results = [_result("mmserve", IMAGE, 1.0), _result("mmserve", TEXT, 1.0)]
    paths = write(results, ["mmserve"], [IMAGE, TEXT], tmp_path / "plots")
    assert [p.name for p in paths] == ["latency.png", "cpu.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
