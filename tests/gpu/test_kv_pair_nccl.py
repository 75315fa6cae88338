"""E/P/D's serving path with ``llm.kv_transfer: collective`` on two GPUs: the prefill replica on one, the
decode replica on the other (``num_gpus: 1`` each), the KV moving between their CUDA caches on the NCCL
pair group they form (llm_service/serve/kv_pair.py); answers equal transformers' greedy ``generate``
for text and an image, and every byte moved on the group. Needs 2 GPUs (skipped otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.local_app import local_app
from tests.integration.test_pd_families import Family, _chat, _hf, _image, _stats

pytestmark = pytest.mark.gpu

FAMILY = Family("qwen2-vl", llm=(("kv_transfer", "collective"), ("device", "cuda")))


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL pair group needs 2 GPUs (one replica on each)")
    from tests.integration.test_pd_families import _model_config

    config = _model_config(FAMILY)
    for pool in config["llm"]["pools"]:
        pool["deployment"] = {"num_replicas": 1, "num_cpus": 0.1, "num_gpus": 1}
    cache_dir = tmp_path_factory.mktemp("models")
    with local_app({"models": [config], "models_cache_dir": str(cache_dir)}, num_cpus=4) as client:
        yield {"client": client, "cache_dir": Path(cache_dir)}


def test_kv_moves_on_nccl_and_answers_equal_hf(app: dict[str, Any]) -> None:
    f, client = FAMILY, app["client"]
    text = "hello there, tell me more"
    served, _, _ = _chat(client, f, [{"role": "user", "content": text}])
    assert served == _hf(app, f, [{"type": "text", "text": text}])
    part, image = _image(96, 64, 31)
    served, _, _ = _chat(client, f, [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}])
    assert served == _hf(app, f, [{"type": "image"}, {"type": "text", "text": "What?"}], images=[image])
    p, d = _stats("prefill", f), _stats("decode", f)
    assert d["kv_imports"] == p["kv_pulls"] == 2 and d["kv_failed_imports"] == 0
    assert d["kv_bytes_collective"] == d["kv_bytes_pulled"] > 0
    assert d["kv_pairs"] == d["kv_pairs_formed"] == 1 and p["kv_pins_held"] == 0
