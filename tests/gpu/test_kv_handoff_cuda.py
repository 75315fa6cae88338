"""E/P/D's KV hand-off on CUDA: two engines on one GPU (the link's path: blocks read to host, written
into the decode engine's blocks) equal a colocated engine; NCCL between two GPUs (needs 2 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.unit.llm_service.hf_ref import RefCase, engine, run
from tests.unit.llm_service.test_kv_collective import check_received, free_port, rank_main
from tests.unit.llm_service.test_kv_handoff import hand_off

pytestmark = pytest.mark.gpu


def test_handoff_between_cuda_engines_equals_colocated(tiny_vl_dir: Path) -> None:
    prompt = [(13 * i + 7) % 140 + 12 for i in range(45)]
    case = RefCase(prompt, [], {})
    (expected,) = run(engine(tiny_vl_dir, device="cuda"), [case])
    p = engine(tiny_vl_dir, device="cuda", max_num_batched_tokens=16)
    d = engine(tiny_vl_dir, device="cuda")
    tokens, _ = hand_off(p, d, "g", case)
    assert tokens == expected


def test_nccl_moves_blocks_between_paged_caches(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two ranks needs 2 GPUs")
    mp.spawn(rank_main, args=(free_port(), "nccl", str(tmp_path)), nprocs=2)
    check_received(tmp_path)
