"""The soak's figure (matplotlib, Agg): resident memory by kind of process, open file descriptors and
the object store's use, against minutes since the load began; the load and minute 5 marked."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.bench.soak_stats import MIB, Sample

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def series_by_kind(samples: Sequence[Sample], t0: float) -> dict[str, tuple[list[float], list[float]]]:
    """kind -> (minutes since ``t0``, RSS MiB summed over that kind's processes) per sample."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for s in samples:
        by: dict[str, int] = defaultdict(int)
        for p in s.procs:
            by[p.kind] += p.rss_bytes
        for kind, rss in by.items():
            xs, ys = out.setdefault(kind, ([], []))
            xs.append((s.t_s - t0) / 60)
            ys.append(rss / MIB)
    return out


def figure(samples: Sequence[Sample], load_t0: float, ref_s: float) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, fds, store) = plt.subplots(1, 3, figsize=(16, 4.6))
    for kind, (xs, ys) in sorted(series_by_kind(samples, load_t0).items(), key=lambda kv: -max(kv[1][1])):
        mem.plot(xs, ys, marker=".", label=kind)
    mem.set_title("RSS by kind of process (MiB, summed)")
    mem.legend(fontsize=6, loc="upper left", ncol=2)
    xs = [(s.t_s - load_t0) / 60 for s in samples]
    fds.plot(xs, [sum(p.open_fds for p in s.procs) for s in samples], marker=".")
    fds.set_title("open file descriptors (all processes)")
    st = [(x, s.store) for x, s in zip(xs, samples, strict=True) if s.store is not None]
    store.plot([x for x, _ in st], [u.used_bytes / MIB for _, u in st], marker=".", color="tab:red")
    store.set_title("object store in use (MiB)")
    quiet = [x for x, s in zip(xs, samples, strict=True) if s.phase == "quiet"]
    for ax in (mem, fds, store):
        ax.axvline(ref_s / 60, color="grey", linestyle=":", linewidth=1)
        if quiet:
            ax.axvspan(quiet[0], quiet[-1], color="grey", alpha=0.12)
        ax.set_xlabel("minutes since the load began (dotted: minute 5; shaded: no load)")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def write_figure(samples: Sequence[Sample], path: Path, load_t0: float, ref_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(samples, load_t0, ref_s).savefig(path, dpi=100)
