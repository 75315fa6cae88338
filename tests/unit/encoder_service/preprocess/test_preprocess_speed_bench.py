"""``python -m cluster.bench.preprocess`` runs and prints its table (no timing is asserted:
benchmarks print numbers, tests check that the tool works)."""

from __future__ import annotations

import pytest

from cluster.bench import preprocess as bench_preprocess


def test_bench_prints_every_row(tiny_vl_dir, capsys: pytest.CaptureFixture[str]):
    bench_preprocess.main(
        ["--model-dir", str(tiny_vl_dir), "--kinds", "224png", "--rounds", "1", "--seconds", "0.01"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert "img/s/core" in lines[1]
    rows = [line for line in lines if line.startswith("224 px PNG")]
    names = [
        "decode only",
        "HF PIL processor",
        "HF torchvision processor",
        "decode + HF torchvision",
        "mmserve Preprocessor.preprocess",
    ]
    assert [name for name in names if any(name in row for row in rows)] == names
    for row in rows:
        img_per_s, cpu_ms = (float(v) for v in row.split()[-4:-2])
        assert img_per_s > 0 and cpu_ms > 0 and abs(img_per_s * cpu_ms / 1e3 - 1) < 0.05
