"""A pool's ``cpu_affinity``: its forms, the config's check of them (naming the pool's field), the node's
check of the cores, the per-replica sets' claim on a node, and the pinning of every thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig
from cluster.cpu_affinity import (
    CpuAffinityError,
    check_cores,
    claim_set,
    format_cpus,
    parse_cpu_affinity,
    pin_process,
    process_cpus,
)
from cluster.one_machine import check_cpu_affinity


@pytest.mark.parametrize(
    ("value", "sets"),
    [
        ("3", [{3}]),
        ("0-3", [{0, 1, 2, 3}]),
        ("0,2,4-5", [{0, 2, 4, 5}]),
        (" 1 , 0 ", [{0, 1}]),
        ("0|1", [{0}, {1}]),
        ("0-1|2-3", [{0, 1}, {2, 3}]),
        ([0, 1], [{0, 1}]),
        ([5], [{5}]),
    ],
)
def test_forms(value: str | list[int], sets: list[set[int]]) -> None:
    assert [set(s) for s in parse_cpu_affinity(value)] == sets


@pytest.mark.parametrize(
    "value", ["", "a", "0-", "3-1", "0||1", "0,,1", "-1", "\u0663", "0-99999999", [], [-1], [True], [70000]]
)
def test_bad_forms_are_refused(value: str | list[int]) -> None:
    with pytest.raises(CpuAffinityError):
        parse_cpu_affinity(value)


def test_format_is_the_kernels_cpu_list() -> None:
    assert format_cpus({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert format_cpus([3]) == "3"


def _config(
    llm_deployment: dict[str, object], encoder_deployment: dict[str, object] | None = None
) -> AppConfig:
    model = {"name": "m", "tiny": "qwen2-vl", "llm": {"deployment": llm_deployment}}
    if encoder_deployment is not None:
        model["encoder"] = {"deployment": encoder_deployment}
    return AppConfig.model_validate({"models": [model]})


def test_the_config_names_the_pool_whose_form_is_bad() -> None:
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(
            {
                "models": [
                    {
                        "name": "m",
                        "tiny": "qwen2-vl",
                        "llm": {
                            "pools": [
                                {"role": "prefill"},
                                {"role": "decode", "deployment": {"cpu_affinity": "1-0"}},
                            ]
                        },
                    }
                ]
            }
        )
    assert "models.0.llm.pools.1.deployment.cpu_affinity" in str(e.value)
    assert "runs backwards" in str(e.value)
    assert _config({}).models[0].llm.deployment.cpu_affinity is None  # off by default


def test_cores_the_node_lacks_are_named_with_the_pool() -> None:
    cfg = _config({"cpu_affinity": "0|1"}, {"cpu_affinity": "2-5"})
    check_cpu_affinity(_config({"cpu_affinity": "0|1"}), {0, 1})
    with pytest.raises(
        CpuAffinityError, match=r"EncoderServer-m: cpu_affinity core 2 is not on this node \(its cores: 0-1\)"
    ):
        check_cpu_affinity(cfg, {0, 1})
    with pytest.raises(CpuAffinityError, match="LLMServer-m: cpu_affinity core 1 "):
        check_cores(parse_cpu_affinity("0|1"), {0}, "LLMServer-m")


def test_each_replica_on_a_node_claims_a_set_of_its_own(tmp_path: Path) -> None:
    sets = parse_cpu_affinity("0|1|2")
    held = [claim_set(sets, "app.LLMServer-m", tmp_path) for _ in range(3)]
    assert held == [0, 1, 2]  # each claim holds its lock (one open file each, as one process each)
    assert claim_set(sets, "app.LLMPrefillServer-m", tmp_path) == 0  # another pool: its own locks
    assert claim_set(sets, "app.LLMServer-m", tmp_path) == os.getpid() % 3  # all taken: shared
    assert claim_set(parse_cpu_affinity("1"), "app.X", tmp_path) == 0  # one set: no lock


def test_a_freed_set_is_claimed_again(tmp_path: Path) -> None:
    from cluster import cpu_affinity

    sets = parse_cpu_affinity("0|1")
    assert [claim_set(sets, "k", tmp_path) for _ in range(2)] == [0, 1]
    first = next(f for f in cpu_affinity._HELD if f.name.endswith("k.0.lock"))
    first.close()  # the replica holding set 0 ends: the kernel drops its lock
    assert claim_set(sets, "k", tmp_path) == 0


def test_every_thread_is_pinned_and_later_threads_inherit() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)
    early.start()
    try:
        assert pin_process(frozenset({core})) >= 2
        assert os.sched_getaffinity(early.native_id) == {core}  # type: ignore[arg-type]
        seen: list[set[int]] = []
        late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        late.start()
        late.join()
        assert seen == [{core}]
        assert process_cpus() == [core]
    finally:
        stop.set()
        early.join()
        pin_process(frozenset(before))
    assert set(process_cpus()) == before


def test_a_replica_with_a_core_its_node_lacks_fails_naming_it() -> None:
    from cluster.cpu_affinity import pin_replica

    before = os.sched_getaffinity(0)
    missing = max(before) + 1000
    with pytest.raises(CpuAffinityError, match=f"deployment LLMDecodeServer-m: cpu_affinity core {missing} "):
        pin_replica(f"{min(before)}|{missing}", "deployment LLMDecodeServer-m", "app.LLMDecodeServer-m")
    assert os.sched_getaffinity(0) == before  # nothing pinned
    assert pin_replica(None, "deployment X", "app.X") is None


def test_no_writable_lock_directory_still_gives_a_set(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the lock directory would be: mkdir fails
    assert claim_set(parse_cpu_affinity("0|1"), "k", blocked / "locks") == os.getpid() % 2


def test_the_serve_flag_pins_each_named_pool_of_every_model() -> None:
    import argparse

    from cluster.serve_cli import add_serve_command, config_from_args

    def cfg(*argv: str) -> AppConfig:
        parser = argparse.ArgumentParser()
        add_serve_command(parser.add_subparsers())
        return config_from_args(parser.parse_args(["serve", *argv]))

    c = cfg(
        "--pd", "--cpu-affinity", "prefill=0", "--cpu-affinity", "decode=1", "--cpu-affinity", "ingress=0"
    )
    assert {m.llm.pool("prefill").cpu_affinity for m in c.models} == {"0"}
    assert {m.llm.pool("decode").cpu_affinity for m in c.models} == {"1"}
    assert c.ingress.deployment.cpu_affinity == "0" and c.models[0].encoder.deployment.cpu_affinity is None
    both = cfg("--cpu-affinity", "llm=0|1", "--cpu-affinity", "encoder=0-1").models[1]
    assert (both.llm.deployment.cpu_affinity, both.encoder.deployment.cpu_affinity) == ("0|1", "0-1")
    with pytest.raises(SystemExit, match="has no decode pool"):
        cfg("--cpu-affinity", "decode=1")
    with pytest.raises(SystemExit, match="POOL=CORES"):
        cfg("--cpu-affinity", "gpu=1")
    with pytest.raises(ValidationError, match="cpu_affinity"):
        cfg("--cpu-affinity", "llm=0-")
