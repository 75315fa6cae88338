"""``llm.kv_transfer``: `link` (the default) or `collective`, refused where it cannot work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import LLMConfig

PD = {"pools": [{"role": "prefill"}, {"role": "decode"}]}


def test_link_is_the_default_and_collective_takes_an_epd_model() -> None:
    assert LLMConfig().kv_transfer == "link"
    llm = LLMConfig.model_validate({**PD, "kv_transfer": "collective"})
    assert llm.for_role("decode").kv_transfer == llm.for_role("prefill").kv_transfer == "collective"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"kv_transfer": "collective"},
            "llm.kv_transfer: `collective` moves KV between a prefill and a decode",
        ),
        ({**PD, "kv_transfer": "collective", "kv_pull_chunks": True}, "does not take llm.kv_pull_chunks"),
        ({**PD, "kv_transfer": "nccl"}, "kv_transfer"),
    ],
)
def test_collective_where_it_cannot_work_is_a_config_error(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LLMConfig.model_validate(settings)


def test_the_helm_chart_takes_it() -> None:
    schema = json.loads((Path(__file__).parents[3] / "helm/mmserve/values.schema.json").read_text())
    llm = schema["properties"]["models"]["items"]["properties"]["llm"]["properties"]
    assert llm["kv_transfer"]["enum"] == ["link", "collective"]
