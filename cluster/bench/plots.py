"""The figures of ``cluster.bench.vs_vllm``, beside its tables: latency percentiles per server and
CPU-ms per request by process, one panel per load (matplotlib, no display: the Agg backend).

Each function builds the figure from the same ``LoadResult``s the tables come from and returns it;
``write`` saves them as PNGs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.bench.vs_report import Load, LoadResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PERCENTILES = (("p50", "median"), ("p90", "p90"), ("p99", "p99"))
LATENCIES = (("TTFT", "ttft"), ("ITL", "itl"))


def _figure(num_loads: int) -> tuple[Figure, list[Axes]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, num_loads, figsize=(5.5 * num_loads, 4.2), squeeze=False)
    return fig, list(axes[0])


def latency_figure(results: Sequence[LoadResult], servers: Sequence[str], loads: Sequence[Load]) -> Figure:
    """Per load, TTFT and ITL at p50/p90/p99 (ms): one group of bars per percentile and latency, a bar
    per server (absent: no bar)."""
    fig, axes = _figure(len(loads))
    by = {(r.server, r.load.name): r for r in results}
    groups = [(f"{lat} {p}", f"{key}_{metric}_ms") for lat, metric in LATENCIES for p, key in PERCENTILES]
    width = 0.8 / max(len(servers), 1)
    for ax, load in zip(axes, loads, strict=True):
        for i, server in enumerate(servers):
            r = by.get((server, load.name))
            values = [(r.value(key) if r else None) for _, key in groups]
            xs = [g + i * width for g, v in enumerate(values) if v is not None]
            ax.bar(xs, [v for v in values if v is not None], width, label=server)
        ax.set_xticks([g + width * (len(servers) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels([label for label, _ in groups], rotation=30, ha="right")
        ax.set_title(load.name)
        ax.set_ylabel("ms")
        ax.legend()
    fig.tight_layout()
    return fig


def cpu_figure(results: Sequence[LoadResult], servers: Sequence[str], loads: Sequence[Load]) -> Figure:
    """Per load, a bar per server: its CPU-ms per completed request, stacked by process kind."""
    fig, axes = _figure(len(loads))
    by = {(r.server, r.load.name): r for r in results}
    kinds = sorted({k.kind for r in results for k in r.profile.kinds()})
    for ax, load in zip(axes, loads, strict=True):
        bottoms = [0.0] * len(servers)
        for kind in kinds:
            heights = []
            for server in servers:
                r = by.get((server, load.name))
                cost = next((k.cpu_ms for k in r.profile.kinds() if k.kind == kind), 0.0) if r else 0.0
                heights.append(cost / r.profile.requests if r and r.profile.requests else 0.0)
            ax.bar(range(len(servers)), heights, 0.6, bottom=bottoms, label=kind)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.set_xticks(range(len(servers)))
        ax.set_xticklabels(servers)
        ax.set_title(load.name)
        ax.set_ylabel("CPU-ms per request")
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def write(
    results: Sequence[LoadResult], servers: Sequence[str], loads: Sequence[Load], out_dir: Path
) -> list[Path]:
    """``latency.png`` and ``cpu.png`` in ``out_dir``; their paths."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in (("latency.png", latency_figure), ("cpu.png", cpu_figure)):
        fig = build(results, servers, loads)
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths
