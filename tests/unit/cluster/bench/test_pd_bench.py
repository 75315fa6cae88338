"""The colocated vs prefill/decode benchmark's pure parts (cluster/bench/mixed_load.py, pd_report.py),
against values worked out by hand (no server)."""

from __future__ import annotations

import pytest

from cluster.bench.mixed_load import LONG, SHORT, SLO, MixedLoad, summarize_mixed
from cluster.bench.pd_report import kv_per_request, kv_transfer, render
from cluster.bench.stats import RequestResult


def test_schedule_is_two_poisson_streams_fixed_by_the_seed() -> None:
    load = MixedLoad("m", long_count=40, long_rate=0.5, short_count=400, short_rate=4.0, seed=3)
    plan = load.schedule()
    assert plan == load.schedule()  # the same requests at the same offsets on every server
    assert (
        plan
        != MixedLoad("m", long_count=40, long_rate=0.5, short_count=400, short_rate=4.0, seed=4).schedule()
    )
    assert [t for t, _, _ in plan] == sorted(t for t, _, _ in plan)
    for kind, count, rate in ((LONG, 40, 0.5), (SHORT, 400, 4.0)):
        times = [t for t, k, _ in plan if k == kind]
        assert len(times) == count
        assert [i for _, k, i in plan if k == kind] == list(range(count))
        # the last arrival of n exponential gaps of mean 1/rate: n/rate within 5 standard deviations
        assert abs(times[-1] - count / rate) < 5 * count**0.5 / rate


def test_a_long_request_carries_its_images_and_text_and_runs_differ() -> None:
    load = MixedLoad("m", long_images=4, image_size=56)
    spec = load.request(LONG, 0, run="a")
    images = [p for p in spec.content if p["type"] == "image_url"]
    assert len(images) == 4 and len({str(p["image_url"]) for p in images}) == 4
    assert spec.content[-1]["type"] == "text" and spec.kind == LONG
    assert spec == load.request(LONG, 0, run="a")
    assert str(load.request(LONG, 0, run="b").content[0]) != str(spec.content[0])
    short = load.request(SHORT, 5, run="a")
    assert short.kind == SHORT and [p["type"] for p in short.content] == ["text"]
    assert load.max_tokens(SHORT) == load.short_max_tokens and load.max_tokens(LONG) == load.long_max_tokens


def _r(kind: str, ttft: float, itls: tuple[float, ...], ok: bool = True) -> RequestResult:
    return RequestResult(
        kind, ok=ok, e2e_s=ttft + sum(itls), ttft_s=ttft, output_tokens=len(itls) + 1, itls_s=itls
    )


def test_slo_needs_the_kinds_ttft_bound_and_no_gap_over_the_itl_bound() -> None:
    slo = SLO(ttft_long_s=2.0, ttft_short_s=0.5, max_itl_s=0.1)
    assert slo.met(_r(LONG, 1.9, (0.05, 0.1)))
    assert not slo.met(_r(LONG, 2.1, (0.05,)))
    assert slo.met(_r(SHORT, 0.5, (0.02,) * 10))
    assert not slo.met(_r(SHORT, 0.6, (0.02,)))  # a long request's bound does not apply
    assert not slo.met(_r(SHORT, 0.1, (0.02,) * 50 + (0.101,)))  # one stall is enough
    assert not slo.met(RequestResult(SHORT, ok=False, e2e_s=0.1, error="503"))


def test_summary_pools_every_gap_and_counts_goodput_over_the_run() -> None:
    results = [
        _r(SHORT, 0.2, (0.01, 0.02, 0.03)),
        _r(SHORT, 0.4, (0.5,)),  # a stall: misses the SLO
        _r(LONG, 1.0, (0.04,)),
        RequestResult(LONG, ok=False, e2e_s=1.0, error="boom"),
    ]
    s = summarize_mixed(results, duration_s=4.0, slo=SLO(2.0, 1.0, 0.2))
    assert (s.completed, s.failed, s.slo_met) == (3, 1, 2)
    assert s.goodput == pytest.approx(0.5)
    # gaps 0.01 0.02 0.03 0.04 0.5: p50 the middle one; p99 at rank 3.96 = 0.04 + 0.96 * 0.46
    assert s.itl_p50_s == pytest.approx(0.03)
    assert s.itl_p99_s == pytest.approx(0.04 + 0.96 * 0.46)
    assert s.short_itl_p99_s == pytest.approx(0.03 + 0.97 * 0.47)  # 0.01 0.02 0.03 0.5, rank 2.97
    assert s.ttft[SHORT] == (pytest.approx(0.3), pytest.approx(0.2 + 0.99 * 0.2))
    assert s.ttft[LONG] == (1.0, 1.0)


def _stats(replicas: dict[str, dict[str, float]]) -> dict[str, object]:
    return {"m": {"pools": {"llm_replicas": replicas}}}


def test_kv_transfer_is_the_counters_delta_summed_over_both_roles() -> None:
    before = _stats(
        {
            "d": {"kv_imports": 2, "kv_bytes_pulled": 1e6, "kv_import_cpu_s": 0.01},
            "p": {"kv_export_cpu_s": 0.02},
        }
    )
    after = _stats(
        {
            "d": {"kv_imports": 6, "kv_bytes_pulled": 9e6, "kv_import_cpu_s": 0.03},
            "p": {"kv_export_cpu_s": 0.06},
            "p2": {"kv_export_cpu_s": 0.01},  # a replica that came up meanwhile counts from zero
        }
    )
    kv = kv_transfer(before, after)
    assert kv is not None
    assert kv["kv_imports"] == 4 and kv["kv_bytes_pulled"] == 8e6
    mb, cpu_ms = kv_per_request(kv)
    assert mb == pytest.approx(2.0)  # 8 MB over 4 requests
    assert cpu_ms == pytest.approx((0.02 + 0.04 + 0.01) * 1000 / 4)
    assert kv_transfer(_stats({"r": {"running": 1}}), _stats({"r": {"running": 3}})) is None  # colocated
    assert kv_per_request(None) == (None, None)


def test_render_gives_the_ratios_over_colocated() -> None:
    def row(name: str, itl_p99: float, goodput: float) -> dict[str, object]:
        summary = {
            "completed": 10,
            "failed": 0,
            "itl_p50_s": 0.02,
            "itl_p99_s": itl_p99,
            "short_itl_p99_s": itl_p99,
            "ttft": {"long": (1.0, 2.0), "short": None},
            "slo_met": 5,
            "goodput": goodput,
        }
        return {"server": name, "summary": summary, "kv": None, "cpu_ms_per_request": 100.0}

    text = render([row("colocated", 0.4, 1.0), {**row("pd", 0.1, 1.5), "host_load": [1.25, 3.0]}], "header")
    assert "| pd | 0.25 | 0.25 | 1.50 |" in text
    assert "| 100 | - |" in text and "| 100 | 1.2 → 3.0 |" in text  # the host's load around each load
    assert "| colocated | 1.00 | 1.00 | 1.00 |" in text
    assert "1000 / 2000" in text and "- / -" in text


def test_pinned_configs_give_each_llm_replica_a_core_and_the_others_the_same() -> None:
    import json

    from cluster.bench.pd_vs_colocated import mmserve_config, parse_args
    from cluster.config import AppConfig

    def config(argv: list[str], pd: bool) -> AppConfig:
        return AppConfig.model_validate(json.loads(mmserve_config(parse_args(argv), pd)))

    plain = config([], pd=False)
    assert all(d.cpu_affinity is None for d in plain.pool_deployments().values())
    coloc = config(["--pin", "--pin-cores", "2,3"], pd=False).pool_deployments()
    assert coloc["LLMServer-epd-qwen2-vl"].cpu_affinity == "2|3"  # one core per replica
    assert coloc["LLMServer-epd-qwen2-vl"].num_replicas == 2
    assert coloc["EncoderServer-epd-qwen2-vl"].cpu_affinity is None is coloc["IngressServer"].cpu_affinity
    pd = config(["--pin", "--pin-cores", "2,3", "--others-cores", "0"], pd=True).pool_deployments()
    assert (
        pd["LLMPrefillServer-epd-qwen2-vl"].cpu_affinity,
        pd["LLMDecodeServer-epd-qwen2-vl"].cpu_affinity,
    ) == (
        "2",
        "3",
    )
    assert pd["EncoderServer-epd-qwen2-vl"].cpu_affinity == "0" == pd["IngressServer"].cpu_affinity
    with pytest.raises(SystemExit, match="--pin-cores"):
        mmserve_config(parse_args(["--pin", "--pin-cores", "1,1"]), pd=True)


def test_replica_cores_read_every_replicas_cpu_affinity() -> None:
    from cluster.bench.pd_report import cores_line, replica_cores

    stats = {
        "m": {
            "pools": {
                "llm_replicas": {
                    "a1": {"role": "prefill", "cpu_affinity": [0]},
                    "b2": {"role": "decode", "cpu_affinity": [1]},
                },
                "preparing_replica": {"replica_id": "e3", "cpu_affinity": [0, 1]},
                "ingress_replica": {"replica_id": "i4", "cpu_affinity": [1]},
            }
        }
    }
    cores = replica_cores(stats)
    assert cores == {"prefill/a1": [0], "decode/b2": [1], "encoder/e3": [0, 1], "ingress/i4": [1]}
    line = cores_line([{"server": "pd", "cores": cores}, {"server": "vllm", "cores": {}}])
    assert (
        line == "Replicas' cores (cpu_affinity): pd: decode/b2 1, encoder/e3 0-1, ingress/i4 1, prefill/a1 0"
    )
    assert cores_line([{"server": "vllm"}]) == ""
