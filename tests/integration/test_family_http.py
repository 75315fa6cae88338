"""Families beyond the default pair, served over HTTP by the whole app (`tiny: <family>` in the config,
the openai client) and checked against transformers' ``generate`` on the same weights."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate
from tests.integration.local_app import start_local_app
from tests.media import make_image_array, make_image_bytes

MODEL = "tiny-qwen2.5-vl"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    from ray import serve

    cache_dir = tmp_path_factory.mktemp("models")
    model = {"name": MODEL, "tiny": "qwen2.5-vl"}
    client = start_local_app({"models": [model], "models_cache_dir": str(cache_dir)})
    yield {"client": client, "dir": Path(cache_dir) / "tiny-qwen2.5-vl"}
    serve.shutdown()
    ray.shutdown()


def _ask(client: OpenAI, content: Any) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
    )
    return str(r.choices[0].message.content)


def test_qwen2_5_vl_text_and_images_equal_hf(app: dict[str, Any]) -> None:
    from PIL import Image

    client, model_dir = app["client"], app["dir"]
    assert _ask(client, "hello there, tell me more") == hf_generate(
        model_dir, [{"role": "user", "content": "hello there, tell me more"}], MAX_TOKENS
    )
    sizes = [(96, 64, 31), (56, 120, 32)]
    urls = [
        "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=s)).decode()
        for w, h, s in sizes
    ]
    images = [Image.fromarray(make_image_array(w, h, seed=s)) for w, h, s in sizes]
    for n in (1, 2):
        served = _ask(
            client,
            [
                *({"type": "image_url", "image_url": {"url": u}} for u in urls[:n]),
                {"type": "text", "text": "Compare."},
            ],
        )
        hf_messages = [
            {
                "role": "user",
                "content": [*({"type": "image"} for _ in range(n)), {"type": "text", "text": "Compare."}],
            }
        ]
        assert served == hf_generate(model_dir, hf_messages, MAX_TOKENS, images=images[:n]), n
