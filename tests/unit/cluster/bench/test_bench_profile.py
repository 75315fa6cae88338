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


def test_ray_is_joined_only_on_loopback() -> None:
    from cluster.bench.profiler import loopback_refusal

    assert loopback_refusal("127.0.0.1:39867", "0") is None
    assert loopback_refusal("[::1]:6379", "0") is None
    assert "not on loopback" in (loopback_refusal("192.0.2.2:39867", "0") or "")
    assert "no raylet" in (loopback_refusal(None, "0") or "")
    assert "leave loopback" in (loopback_refusal("127.0.0.1:39867", None) or "")
