"""The benchmark's CPU profile: process kinds from real titles, the before/after arithmetic by hand, and
``/proc`` readings against the kernel's own accounting (``os.times``) and a socket opened here."""

from __future__ import annotations

import os
import socket
import time

import pytest

from cluster.bench.cpu_profile import (
    IDLE_WORKERS,
    IdleProfile,
    ProcessCost,
    ProcSample,
    ScenarioProfile,
    by_kind,
    class_kind,
    per_request,
    process_costs,
    process_kind,
    profile_table,
)
from cluster.bench.procs import (
    CLOCK_TICKS_PER_S,
    ProcInfo,
    anyone_connected_to,
    cluster_members,
    connections_to,
    find_raylet,
    gcs_address,
    listening_inodes,
    parse_stat,
    pid_listening_on,
    read_proc,
    session_name,
)

SESSION = "session_2026-12-01_02-49-56_924887_11751"
RAY = "/work/main/.venv/lib/python3.11/site-packages/ray"
PY = "/work/main/.venv/bin/python"

# Titles as /proc/PID/cmdline showed them for a running app (padding included), and their kinds.
TITLES = [
    ("ray::ServeReplica:mmserve:IngressServer" + " " * 40, "IngressServer"),
    ("ray::ServeReplica:mmserve:LLMServer-tiny-qwen2-vl", "LLMServer-tiny-qwen2-vl"),
    ("ray::ServeReplica:mmserve:LLMServer-qwen2.5-vl", "LLMServer-qwen2.5-vl"),  # a dot in a model name
    ("ray::ProxyActor", "Serve proxy"),
    ("ray::ServeController", "Serve controller"),
    ("ray::CacheIndexShard", "CacheIndexShard"),
    ("ray::CacheIndexShard.get_or_reserve", "CacheIndexShard"),  # a sync actor inside a method
    ("ray::EncoderRankWorker", "EncoderRankWorker"),
    ("ray::DashboardAgent", "dashboard agent"),
    ("ray::RuntimeEnvAgent", "runtime-env agent"),
    ("ray::IDLE", IDLE_WORKERS),
    (f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/{SESSION}/sockets/raylet", "raylet"),
    (f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/{SESSION}/logs", "GCS server"),
    (
        f"{PY} -u {RAY}/autoscaler/_private/monitor.py --logs-dir=/tmp/ray/{SESSION}/logs",
        "autoscaler monitor",
    ),
    (f"{PY} {RAY}/dashboard/dashboard.py --host=127.0.0.1 --port=8265", "dashboard"),
    (f"{PY} -u {RAY}/_private/log_monitor.py --session-dir=/tmp/ray/{SESSION}", "log monitor"),
    (f"{PY} {RAY}/_private/workers/default_worker.py --node-ip-address=127.0.0.1", IDLE_WORKERS),
    (f"{PY} -m cluster.cli serve --model /tmp/m", "cluster.cli"),
    ("/tmp/peer_vllm/venv/bin/python /x/vllm_cli.py serve /tmp/m", "vllm_cli.py"),
    ("VLLM::EngineCore", "VLLM::EngineCore"),
    ("/v/bin/python -B -c from multiprocessing.resource_tracker import main;main(5)", "python -c"),
]


@pytest.mark.parametrize(("title", "kind"), TITLES)
def test_process_kind_of_real_titles(title: str, kind: str) -> None:
    assert process_kind(title) == kind


def test_actor_class_wins_over_the_title() -> None:
    assert process_kind("ray::IDLE", actor_class="ServeReplica:mmserve:Preprocessor-m") == "Preprocessor-m"
    assert class_kind("ServeReplica:mmserve:EncoderServer-tiny") == "EncoderServer-tiny"


def test_parse_stat_reads_ppid_cpu_and_start_past_a_name_with_parens_and_spaces() -> None:
    # proc(5): pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    #          utime stime cutime cstime priority nice threads itrealvalue starttime ...
    line = "4242 (ray::a) (b c)) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 9 9 20 0 12 0 98765 1000 50"
    assert parse_stat(line) == (17, 325, 98765)  # children's times (cutime, cstime) not counted
    with pytest.raises(ValueError, match="stat"):
        parse_stat("garbage")


def test_read_proc_of_this_process_agrees_with_os_times() -> None:
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn some CPU so the tick counts are not all zero
        pass
    me = read_proc(os.getpid())
    t = os.times()
    assert me is not None and me.ppid == os.getppid() and "pytest" in me.title
    assert me.cpu_s == pytest.approx(t.user + t.system, abs=3 / CLOCK_TICKS_PER_S)


def sample(pid: int, ticks: int, start: int = 1, kind: str = "k") -> ProcSample:
    return ProcSample(pid=pid, start_ticks=start, cpu_ticks=ticks, kind=kind, title=f"t{pid}")


def test_process_costs_subtracts_counts_new_processes_in_full_and_drops_the_exited() -> None:
    before = {1: sample(1, 100), 2: sample(2, 50), 3: sample(3, 70, start=5), 9: sample(9, 1000)}
    after = {1: sample(1, 130), 2: sample(2, 50), 3: sample(3, 20, start=8), 4: sample(4, 15)}
    costs = {c.pid: c.cpu_ms for c in process_costs(before, after, ticks_per_s=100)}
    # 30 ticks at 100/s = 300 ms; pid 3 was reused (new start time): all its 20 ticks; 4 is new; 9 exited
    assert costs == {1: 300.0, 2: 0.0, 3: 200.0, 4: 150.0}


def test_by_kind_sums_replicas_and_orders_by_cost() -> None:
    costs = [
        ProcessCost(1, "LLMServer-m", "", 100.0),
        ProcessCost(2, "CacheIndexShard", "", 30.0),
        ProcessCost(3, "CacheIndexShard", "", 50.0),
        ProcessCost(4, "raylet", "", 80.0),
    ]
    rows = [(k.kind, k.processes, k.cpu_ms) for k in by_kind(costs)]
    assert rows == [("LLMServer-m", 1, 100.0), ("CacheIndexShard", 2, 80.0), ("raylet", 1, 80.0)]


def test_per_request_and_the_table_by_hand() -> None:
    assert per_request(500.0, 4) == 125.0
    assert per_request(500.0, 0) is None
    costs = [
        ProcessCost(1, "IngressServer", "", 400.0),
        ProcessCost(2, "shard", "", 60.0),
        ProcessCost(3, "shard", "", 20.0),
    ]
    text_run = ScenarioProfile("text", requests=8, request_throughput=12.5, ttft_p50_s=0.0421, costs=costs)
    image_run = ScenarioProfile("image", requests=0, request_throughput=0.0, ttft_p50_s=None, costs=costs[:1])
    lines = profile_table([text_run, image_run]).splitlines()
    assert lines[0] == "| CPU-ms per request | text | image |"
    assert lines[2] == "| req/s | 12.50 | 0.00 |"
    assert lines[3] == "| TTFT p50 (ms) | 42.1 | - |"
    assert lines[4] == "| **total** | **60.0** | **-** |"  # 480 ms over 8 requests
    assert lines[5] == "| IngressServer | 50.0 | - |"
    assert lines[6] == "| shard (×2) | 10.0 | - |"
    js = text_run.to_json()
    assert js["cpu_ms_per_request"] == {"IngressServer": 50.0, "shard": 10.0}
    assert js["processes_per_kind"] == {"IngressServer": 1, "shard": 2}
    assert [p["pid"] for p in js["processes"]] == [1, 2, 3]


def proc(pid: int, ppid: int, title: str) -> ProcInfo:
    return ProcInfo(pid=pid, ppid=ppid, start_ticks=1, cpu_ticks=0, title=title)


OTHER = "session_2026-12-01_02-44-15_496944_5163"
TREE = {
    p.pid: p
    for p in [
        proc(1, 0, "/sbin/init"),
        proc(100, 1, "bash"),
        proc(200, 100, f"{PY} -m cluster.cli serve"),
        proc(201, 200, f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/{SESSION}/logs"),
        proc(
            202,
            200,
            f"{RAY}/core/src/ray/raylet/raylet --store=/tmp/ray/{SESSION}/s --gcs-address=127.0.0.1:36643",
        ),
        proc(203, 200, f"{PY} -u {RAY}/_private/log_monitor.py --session-dir=/tmp/ray/{SESSION}"),
        proc(300, 202, "ray::ProxyActor"),
        proc(301, 202, "ray::ServeReplica:mmserve:IngressServer"),
        proc(302, 301, "some child of a replica"),
        # another cluster on the same machine, started by `ray start` (daemonized under init)
        proc(500, 1, f"{RAY}/core/src/ray/raylet/raylet --store=/tmp/ray/{OTHER}/s"),
        proc(501, 1, f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/{OTHER}/logs"),
        proc(502, 500, "ray::ServeReplica:other:IngressServer"),
    ]
}


def test_one_cluster_is_found_from_a_worker_or_from_its_driver_and_excludes_the_other() -> None:
    assert find_raylet(TREE, 300) == 202  # from the proxy (the process listening on the port)
    assert find_raylet(TREE, 200) == 202  # from the driver
    assert find_raylet(TREE, 100) == 202  # the shell above it: its descendants hold one raylet
    assert find_raylet(TREE, 501) is None
    assert cluster_members(TREE, 202) == {200, 201, 202, 203, 300, 301, 302}
    assert cluster_members(TREE, 500) == {500, 501, 502}  # its parent is init: no driver
    assert session_name(TREE[201].title) == SESSION
    assert gcs_address(TREE[202].title) == "127.0.0.1:36643"


def test_listening_inodes_parses_proc_net_tcp_by_hand() -> None:
    table = "\n".join(
        [
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode",
            "   0: 0100007F:20F1 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4711 1",
            "   1: 0100007F:20F1 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4712 1",
            "   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4713 1",
        ]
    )
    assert listening_inodes(table, 0x20F1) == {4711}  # 8433; the established socket (01) is not listening
    assert listening_inodes(table, 8080) == {4713}
    assert listening_inodes(table, 1234) == set()


def test_connections_to_counts_established_sockets_whose_remote_end_is_the_port() -> None:
    table = "\n".join(
        [
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode",
            "   0: 0100007F:20F1 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4711 1",
            "   1: 0100007F:9C40 0100007F:20F1 01 00000000:00000000 00:00000000 00000000     0        0 4712 1",
            "   2: 0100007F:20F1 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4713 1",
            "   3: 0100007F:9C41 0100007F:20F1 06 00000000:00000000 00:00000000 00000000     0        0 0 1",
        ]
    )
    # the client's end of one connection (1); the server's own end (2) and a TIME_WAIT (06) do not count
    assert connections_to(table, 0x20F1) == 1
    assert connections_to(table, 0x9C40) == 1 and connections_to(table, 1234) == 0


def test_anyone_connected_to_sees_a_loopback_connection_this_test_makes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not anyone_connected_to(port)
        with socket.create_connection(("127.0.0.1", port)):
            assert anyone_connected_to(port)


def test_pid_listening_on_finds_this_process_for_a_loopback_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert pid_listening_on(port) == os.getpid()
    assert pid_listening_on(port) is None


def test_idle_column_is_cpu_ms_per_second() -> None:
    costs = [ProcessCost(1, "IngressServer", "", 400.0), ProcessCost(2, "Serve controller", "", 10.0)]
    run = ScenarioProfile("text", requests=4, request_throughput=2.0, ttft_p50_s=0.01, costs=costs)
    idle = IdleProfile(seconds=5.0, costs=[ProcessCost(2, "Serve controller", "", 30.0)])
    lines = profile_table([run], idle).splitlines()
    assert lines[0] == "| CPU-ms per request | text | idle CPU-ms/s (5 s) |"
    assert lines[4] == "| **total** | **102.5** | **6.0** |"  # 410 ms / 4 requests; 30 ms / 5 s
    assert lines[5] == "| IngressServer | 100.0 | 0.0 |"
    assert lines[6] == "| Serve controller | 2.5 | 6.0 |"
    assert idle.to_json() == {"seconds": 5.0, "cpu_ms_per_s": {"Serve controller": 6.0}}


def test_vs_vllm_bench_argv_matches_the_peer_script_flags() -> None:
    import argparse
    import json
    from pathlib import Path

    from cluster.bench.vllm_client import bench_argv
    from cluster.bench.vs_report import LOADS

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
    import pytest

    from cluster.bench.vs_report import LOADS, select_loads

    assert select_loads(None) == LOADS
    picked = select_loads("image-rate30, image-c32")
    assert [load.key for load in picked] == ["image-c32", "image-rate30"]
    with pytest.raises(ValueError, match="image-c64"):
        select_loads("image-c32,image-c64")


def test_paired_body_runs_each_load_then_its_twin_whose_requests_carry_the_body() -> None:
    import argparse
    from pathlib import Path

    from cluster.bench.vllm_client import bench_argv
    from cluster.bench.vs_vllm import parse_args

    body = '{"response_format": {"type": "json_object"}}'
    args = parse_args(["--loads", "text-c32,image-c32", "--paired-body", body])
    assert [load.key for load in args.loads] == [
        "image-c32",
        "image-c32+schema",
        "text-c32",
        "text-c32+schema",
    ]
    assert args.loads[1].name == "image, 128 req, c=32, schema"
    ns = argparse.Namespace(vllm_venv=Path("/v"), peer_dir=Path("/p"), served_name="m", model_dir=Path("/d"))
    ns.input_len, ns.output_len = 64, 16
    plain, twin = (
        bench_argv(ns, load, "http://127.0.0.1:9", 0, Path("/r/x.json")) for load in args.loads[:2]
    )
    assert "--extra-body" not in plain and twin[twin.index("--extra-body") + 1] == body


def test_vs_vllm_table_gives_each_server_its_ratio_to_vllm() -> None:
    from cluster.bench.vs_report import LOADS, LoadResult, comparison_table

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
    from cluster.bench.vs_report import LOADS, LoadResult, median_rounds

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


def test_ray_is_joined_only_on_loopback() -> None:
    from cluster.bench.profiler import loopback_refusal

    assert loopback_refusal("127.0.0.1:39867", "0") is None
    assert loopback_refusal("[::1]:6379", "0") is None
    assert "not on loopback" in (loopback_refusal("192.0.2.2:39867", "0") or "")
    assert "no raylet" in (loopback_refusal(None, "0") or "")
    assert "leave loopback" in (loopback_refusal("127.0.0.1:39867", None) or "")
