"""``cluster.bench.vs_vllm``'s arithmetic (no server): the ``vllm bench serve`` argv per load, the loads
by key, the paired-body twins, the comparison table's ratios and the median of rounds, by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.bench.cpu_profile import ProcessCost, ScenarioProfile
from cluster.bench.vllm_client import bench_argv
from cluster.bench.vs_report import (
    LOADS,
    Load,
    LoadResult,
    comparison_table,
    median_rounds,
    paired,
    paired_ratios,
    select_loads,
)
from cluster.bench.vs_vllm import parse_args


def test_vs_vllm_bench_argv_matches_the_peer_script_flags() -> None:
    args = argparse.Namespace(
        vllm_venv=Path("/v"),
        peer_dir=Path("/p"),
        served_name="m",
        model_dir=Path("/d"),
        input_len=64,
        output_len=16,
    )
    image = bench_argv(args, LOADS[0], "http://127.0.0.1:9", 0, Path("/r/x.json"))
    opts = dict(zip(image[4::2], image[5::2], strict=False))  # after: python vllm_cli.py bench serve
    assert image[:4] == ["/v/bin/python", "/p/vllm_cli.py", "bench", "serve"]
    assert opts["--dataset-name"] == "random-mm" and opts["--num-prompts"] == "128"
    assert opts["--max-concurrency"] == "32" and opts["--random-output-len"] == "16"
    assert opts["--random-mm-bucket-config"].startswith("{(64, 64, 1): 0.25")
    assert "--ignore-eos" in image and image[-4:] == ["--result-dir", "/r", "--result-filename", "x.json"]
    by_key = {load.key: load for load in LOADS}
    text = bench_argv(args, by_key["text-c32"], "http://127.0.0.1:9", 0, Path("/r/y.json"))
    assert "random" in text and not any(a.startswith("--random-mm") for a in text)
    four = bench_argv(args, by_key["image4-c32"], "http://127.0.0.1:9", 0, Path("/r/w.json"))
    four_opts = dict(zip(four[4::2], four[5::2], strict=False))
    assert four_opts["--random-mm-base-items-per-request"] == "4"
    assert json.loads(four_opts["--random-mm-limit-mm-per-prompt"]) == {"image": 4, "video": 0}
    assert opts["--request-rate"] == "inf"  # closed loop: `--max-concurrency` clients back to back
    (rate,) = [load for load in LOADS if load.key == "image-rate30"]
    open_loop = bench_argv(args, rate, "http://127.0.0.1:9", 0, Path("/r/z.json"))
    opts = dict(zip(open_loop[4::2], open_loop[5::2], strict=False))
    assert opts["--request-rate"] == "30.0" and opts["--num-prompts"] == "256"


def test_loads_are_picked_by_key_in_the_tables_order_and_an_unknown_key_is_refused() -> None:
    assert select_loads(None) == LOADS
    picked = select_loads("image-rate30, image-c32")
    assert [load.key for load in picked] == ["image-c32", "image-rate30"]
    with pytest.raises(ValueError, match="image-c64"):
        select_loads("image-c32,image-c64")


def test_paired_body_runs_each_load_then_its_twin_whose_requests_carry_the_body() -> None:
    body = '{"response_format": {"type": "json_object"}}'
    args = parse_args(["--loads", "text-c32,image-c32", "--paired-body", body])
    assert [load.key for load in args.loads] == [
        "image-c32",
        "image-c32+schema",
        "text-c32",
        "text-c32+schema",
    ]
    assert args.loads[1].name == "image, 128 req, c=32, schema"
    assert (args.loads[0].seed_offset, args.loads[1].seed_offset) == (0, 1)  # the twin: other requests
    ns = argparse.Namespace(vllm_venv=Path("/v"), peer_dir=Path("/p"), served_name="m", model_dir=Path("/d"))
    ns.input_len, ns.output_len = 64, 16
    plain, twin = (
        bench_argv(ns, load, "http://127.0.0.1:9", 0, Path("/r/x.json")) for load in args.loads[:2]
    )
    assert "--extra-body" not in plain and twin[twin.index("--extra-body") + 1] == body


def test_vs_vllm_table_gives_each_server_its_ratio_to_vllm() -> None:
    def result(server: str, rps: float, ttft: float, cpu_ms: float) -> LoadResult:
        m = {"request_throughput": rps, "mean_ttft_ms": ttft, "mean_tpot_ms": 4.0, "median_itl_ms": 2.0}
        prof = ScenarioProfile(LOADS[0].name, 10, rps, None, [ProcessCost(1, "x", "", cpu_ms)])
        return LoadResult(server, LOADS[0], m, prof)

    results = [result("vLLM", 64.0, 200.0, 270.0), result("mmserve", 16.0, 1000.0, 1000.0)]
    lines = comparison_table(results, ["vLLM", "mmserve@baseline", "mmserve"]).splitlines()
    assert lines[0].startswith("| load | server | req/s | ×vLLM | mean TTFT ms | ×vLLM |")

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    tpot_itl = ["4.0", "1.00", "2.0", "1.00"]
    assert cells(lines[2]) == [
        LOADS[0].name,
        "vLLM",
        "64.0",
        "1.00",
        "200.0",
        "1.00",
        *tpot_itl,
        "27.0",
        "1.00",
    ]
    assert cells(lines[3])[2:] == ["-"] * 10  # the baseline was not run
    # mmserve: 16/64 req/s, 1000/200 ms TTFT, CPU-ms per request 1000/10 over 270/10
    assert cells(lines[4]) == [
        LOADS[0].name,
        "mmserve",
        "16.0",
        "0.25",
        "1000.0",
        "5.00",
        *tpot_itl,
        "100.0",
        "3.70",
    ]
    assert len(lines) == 2 + 3 * len(LOADS)


def test_median_rounds_picks_each_pairs_median_round_whole_and_reports_the_range() -> None:
    def result(server: str, load: int, rps: float, ttft: float) -> LoadResult:
        prof = ScenarioProfile(LOADS[load].name, 10, rps, None, [ProcessCost(1, "x", "", rps)])
        return LoadResult(server, LOADS[load], {"request_throughput": rps, "mean_ttft_ms": ttft}, prof)

    rounds = [
        [result("vLLM", 0, 60.0, 200.0), result("mmserve", 0, 50.0, 300.0), result("mmserve", 1, 9.0, 30.0)],
        [result("mmserve", 0, 40.0, 900.0), result("mmserve", 1, 11.0, 20.0), result("vLLM", 0, 70.0, 150.0)],
        [result("vLLM", 0, 65.0, 170.0), result("mmserve", 0, 45.0, 400.0), result("mmserve", 1, 10.0, 25.0)],
    ]
    picked, spread = median_rounds(rounds)
    # first-seen order; each row is one round's whole result (its TTFT and CPU beside its req/s)
    assert [
        (r.server, r.load.name, r.value("request_throughput"), r.value("mean_ttft_ms")) for r in picked
    ] == [
        ("vLLM", LOADS[0].name, 65.0, 170.0),
        ("mmserve", LOADS[0].name, 45.0, 400.0),
        ("mmserve", LOADS[1].name, 10.0, 25.0),
    ]
    assert picked[1].profile.total_ms == 45.0
    assert spread[("mmserve", LOADS[0].name)] == "40.0–50.0"
    two, _ = median_rounds(rounds[:2])  # an even count: the lower middle
    assert two[0].value("request_throughput") == 60.0
    assert median_rounds(rounds[:1])[0] == rounds[0]
    # a round whose client saw more in flight than its concurrency is not a measurement: left out
    broken = result("vLLM", 0, 41.0, 690.0)
    broken.metrics["max_concurrent_requests"] = 95
    ok = result("vLLM", 0, 108.0, 166.0)
    ok.metrics["max_concurrent_requests"] = 32
    kept, ranges = median_rounds([[broken], [ok]])
    assert kept[0] is ok and ranges[("vLLM", LOADS[0].name)] == "108.0–108.0 (1 suspect round(s) left out)"
    assert median_rounds([[broken]])[0] == [broken]  # nothing else to pick: kept, not dropped


def test_paired_repeats_alternate_which_goes_first_and_give_each_pair_its_seeds() -> None:
    body = '{"response_format": {"type": "json_object"}}'
    args = parse_args(["--loads", "text-c32", "--paired-body", body, "--paired-repeats", "3"])
    assert [(load.key, load.seed_offset) for load in args.loads] == [
        ("text-c32", 0),
        ("text-c32+schema", 1),
        ("text-c32+schema", 3),
        ("text-c32", 2),
        ("text-c32", 4),
        ("text-c32+schema", 5),
    ]


def test_paired_ratios_divide_each_twin_by_its_own_pair_and_give_the_median() -> None:
    base, twin = paired([LOADS[5]], "{}", "schema", repeats=3)[:2]

    def result(load: Load, tpot: float, rps: float) -> LoadResult:
        m = {"request_throughput": rps, "mean_tpot_ms": tpot}
        prof = ScenarioProfile(load.name, 10, rps, None, [ProcessCost(1, "x", "", 100.0)])
        return LoadResult("mmserve", load, m, prof)

    # pair 1: 12/10, pair 2: 30/20 (a slow stretch of the run weighs on both), pair 3: 11/10
    results = [
        result(base, 10.0, 100.0),
        result(twin, 12.0, 90.0),
        result(twin, 30.0, 40.0),
        result(base, 20.0, 50.0),
        result(base, 10.0, 100.0),
        result(twin, 11.0, 100.0),
    ]
    lines = paired_ratios(results, "schema").splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["mmserve", twin.name, "3"]
    assert cells[3:5] == ["1.20", "1.10–1.50"]  # TPOT: 1.10, 1.20, 1.50
    assert cells[5:7] == ["0.90", "0.80–1.00"]  # req/s: 0.90, 0.80, 1.00
    assert cells[7:9] == ["1.00", "1.00–1.00"]  # CPU-ms per request
