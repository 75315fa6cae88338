"""cluster/bench/soak_stats.py and soak_plot.py: a soak's samples, growth and verdict from hand-built
samples (and this test process's own ``/proc`` entry)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.bench.procs import read_proc
from cluster.bench.soak_plot import figure, series_by_kind
from cluster.bench.soak_stats import (
    CSV_HEADER,
    MIB,
    PAGE_BYTES,
    CsvLog,
    ProcMem,
    Sample,
    StoreUse,
    csv_rows,
    from_csv,
    growth,
    growth_table,
    parse_statm_rss,
    parse_status_shmem,
    read_mem,
    reference_sample,
    sample_procs,
    to_csv,
    verdict,
)


def _p(pid: int, rss_mib: float, fds: int = 10, kind: str = "LLMServer-m", start: int = 1) -> ProcMem:
    return ProcMem(pid, start, kind, round(rss_mib * MIB), fds)


def _run() -> list[Sample]:
    """Baseline, 8 minutes of load (a sample a minute), two quiet samples. Pid 1 grows 10 % after
    minute 5, pid 2 stays flat, pid 3 is replaced at minute 6 by pid 4 (same kind)."""
    samples = [
        Sample(0.0, "baseline", (_p(1, 100), _p(2, 200), _p(3, 50, kind="EncoderServer-m")), StoreUse(0, 0))
    ]
    for minute in range(9):
        t = 30.0 + 60 * minute
        rss1 = 100 if minute <= 5 else 100 + 2.5 * (minute - 5) * 4 / 3  # 110 at minute 8
        procs = [_p(1, rss1, fds=10 + (minute >= 7)), _p(2, 200)]
        procs.append(
            _p(3, 50, kind="EncoderServer-m") if minute < 6 else _p(4, 60, kind="EncoderServer-m", start=9)
        )
        samples.append(Sample(t, "load", tuple(procs), StoreUse(5 * MIB, 40)))
    for i, used in enumerate((3 * MIB, MIB // 2)):
        samples.append(Sample(600.0 + 60 * i, "quiet", samples[-1].procs, StoreUse(used, 1), cache_entries=7))
    return samples


def test_statm_and_this_process_read() -> None:
    assert parse_statm_rss("1000 250 30 1 0 400 0\n") == 250 * PAGE_BYTES
    with pytest.raises(ValueError, match="statm"):
        parse_statm_rss("12")
    rss, fds, _ = read_mem(os.getpid()) or (0, 0, 0)
    assert rss > 10 * MIB and fds >= 3  # a Python with pytest loaded, stdin/out/err open
    me = read_proc(os.getpid())
    assert me is not None
    (p,) = sample_procs({me.pid: me}, {me.pid: "bench"})
    assert (p.pid, p.kind, p.start_ticks) == (me.pid, "bench", me.start_ticks)
    assert read_mem(2**22 + 12345) is None  # no such pid


def test_shared_memory_pages_this_process_touches_count_in_its_rss_and_as_shm() -> None:
    """A /dev/shm segment (what the object store is) of 8 MiB, written: RssShmem and RSS both grow by
    it, the private part (RSS less shm) by little."""
    from multiprocessing import shared_memory

    assert parse_status_shmem("VmRSS:\t 2048 kB\nRssShmem:\t  512 kB\n") == 512 * 1024
    assert parse_status_shmem("VmRSS:\t 2048 kB\n") == 0
    rss0, _, shm0 = read_mem(os.getpid()) or (0, 0, 0)
    seg = shared_memory.SharedMemory(create=True, size=8 * MIB)
    try:
        for page in range(0, 8 * MIB, 4096):  # every page touched, no private buffer of 8 MiB on the way
            seg.buf[page] = 1
        rss1, _, shm1 = read_mem(os.getpid()) or (0, 0, 0)
    finally:
        seg.close()
        seg.unlink()
    assert shm1 - shm0 >= 8 * MIB
    assert rss1 - rss0 >= 8 * MIB and (rss1 - shm1) - (rss0 - shm0) < 2 * MIB


def test_growth_without_the_object_store_pages() -> None:
    """A raylet whose RSS grows only by store pages it touched: RSS +10 %, private growth 0."""
    ref = Sample(300.0, "load", (ProcMem(7, 1, "raylet", 30 * MIB, 100, 1 * MIB),), None)
    end = Sample(600.0, "load", (ProcMem(7, 1, "raylet", 33 * MIB, 100, 4 * MIB),), None)
    (g,), _ = growth([ref, end], 300.0)
    assert g.rss_growth == pytest.approx(0.10) and g.private_growth == 0.0
    v = verdict([ref, end], 300.0)
    assert not v.rss_ok and v.private_ok and v.worst_private_kind == "raylet"
    assert from_csv(to_csv([ref, end]))[1].procs[0].shm_bytes == 4 * MIB


def test_reference_is_the_first_load_sample_at_minute_five() -> None:
    samples = _run()
    assert reference_sample(samples, 300.0).t_s == 330.0
    assert reference_sample(samples, 10_000.0).t_s == 510.0  # a short run: its last load sample
    with pytest.raises(ValueError, match="under load"):
        reference_sample(samples[:1], 300.0)


def test_growth_per_process_and_the_replaced_one() -> None:
    rows, born = growth(_run(), 300.0)
    by = {g.pid: g for g in rows}
    assert set(by) == {1, 2, 3}
    assert by[1].rss_growth == pytest.approx(0.10) and not by[1].ended
    assert by[1].fd_growth == 1
    assert by[2].rss_growth == 0.0
    assert by[3].ended and by[3].rss_growth == 0.0  # gone at minute 6: not "grown"
    assert [(p.pid, p.kind) for p in born] == [(4, "EncoderServer-m")]


def test_verdict_flags_the_grower_the_fds_and_the_store() -> None:
    v = verdict(_run(), 300.0)
    assert v.worst_rss_kind == "LLMServer-m" and v.worst_rss_growth == pytest.approx(0.10)
    assert not v.rss_ok and not v.fds_ok and v.fd_growth == 1
    assert v.store_baseline == 0 and v.store_after == MIB // 2 and v.store_ok  # within a MiB
    flat = [s for s in _run() if s.t_s <= 330.0] + [
        Sample(700.0, "quiet", _run()[6].procs, StoreUse(3 * MIB, 2))
    ]
    v2 = verdict(flat, 300.0)
    assert v2.rss_ok and v2.fds_ok and not v2.store_ok  # 3 MiB left in the store


def test_csv_round_trip_and_the_table() -> None:
    samples = _run()
    text = to_csv(samples)
    assert text.splitlines()[0].startswith("t_s,phase,series,pid,kind,rss_mib")
    back = from_csv(text)
    assert [(s.t_s, s.phase) for s in back] == [(s.t_s, s.phase) for s in samples]
    assert (
        back[-1].store == samples[-1].store and back[-1].cache_entries == 7 and back[0].cache_entries is None
    )
    assert [p.rss_bytes for p in back[5].procs] == [p.rss_bytes for p in samples[5].procs]
    table = growth_table(samples, 300.0)
    assert "+10.0 %" in table and "born later" in table and "exited" in table


def test_csv_log_keeps_every_sample_as_it_is_taken(tmp_path: Path) -> None:
    """What the soak appends per sample is on disk after each one (a run killed midway keeps it), and
    the file read back is the run's samples."""
    samples = _run()
    log = CsvLog(tmp_path / "soak.csv")
    for i, s in enumerate(samples):
        log.append([dict(zip(CSV_HEADER, row, strict=True)) for row in csv_rows(s)])
        on_disk = from_csv((tmp_path / "soak.csv").read_text())
        assert [(x.t_s, x.phase) for x in on_disk] == [(x.t_s, x.phase) for x in samples[: i + 1]]
    assert (tmp_path / "soak.csv").read_text() == to_csv(samples)
    memory = CsvLog(tmp_path / "soak_memory.csv")
    memory.append([])  # a sample with no breakdown writes nothing
    assert not (tmp_path / "soak_memory.csv").exists()
    memory.append([{"t_s": 1.0, "pid": 7}])
    memory.append([{"t_s": 2.0, "pid": 8}])
    assert (tmp_path / "soak_memory.csv").read_text().splitlines() == ["t_s,pid", "1.0,7", "2.0,8"]


def test_plot_series_sum_each_kind() -> None:
    series = series_by_kind(_run(), t0=30.0)
    xs, ys = series["LLMServer-m"]
    assert xs[0] == -0.5 and ys[0] == 300.0  # pids 1 and 2 at the baseline
    assert figure(_run(), 30.0, 300.0).axes[2].get_title() == "object store in use (MiB)"


def test_the_ramp_stops_once_throughput_stops_growing() -> None:
    from cluster.bench.soak import ramp_goes_on

    assert ramp_goes_on([1.6]) and ramp_goes_on([1.6, 3.3]) and ramp_goes_on([1.6, 3.3, 6.8])
    assert not ramp_goes_on([1.6, 3.3, 6.8, 7.0])  # +3 %: saturated
    assert not ramp_goes_on([1.6, 3.3, 6.8, 5.0])


def test_uuid_repeats_name_an_image_sent_a_few_images_before() -> None:
    from cluster.bench.soak import MIX, UUID_LAG, Mix
    from cluster.bench.workload import WorkloadConfig

    mix = Mix(WorkloadConfig(run_id=1))
    sent: list[str] = []  # uuids sent with bytes, in order
    for _ in range(5 * len(MIX)):
        kind, spec = mix.next()
        part = spec.content[0]
        if kind in ("image", "uuid") and "image_url" in part:
            sent.append(str(part["uuid"]))
        elif kind == "uuid":
            assert "image_url" not in part and part["uuid"] in sent[-UUID_LAG - 1 : -UUID_LAG + 1]
