"""E/P/D pools' own engine settings (``llm.pools[].engine``): parsed, merged over ``llm`` per role,
and refused where the moved KV needs both pools to agree (docs/disaggregation.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.budgets import encoder_budgets
from cluster.config import AppConfig, LLMConfig, ModelConfig
from cluster.pool_config import POOL_SHARED_FIELDS, LLMPoolEngine


def _model(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **llm: Any
) -> ModelConfig:
    pools = [{"role": "prefill", "engine": prefill or {}}, {"role": "decode", "engine": decode or {}}]
    return ModelConfig.model_validate(
        {
            "name": "m",
            "tiny": "qwen2-vl",
            "llm": {"num_kv_blocks": 100, "max_num_seqs": 8, **llm, "pools": pools},
        }
    )


def test_each_role_gets_llms_settings_with_its_own_pools_over_them() -> None:
    m = _model(
        prefill={"max_num_batched_tokens": 4096, "torch_threads": 2},
        decode={"num_kv_blocks": 400, "max_num_seqs": 128, "kv_swap_space_mib": 64},
        max_num_batched_tokens=512,
    )
    prefill, decode = m.llm.for_role("prefill"), m.llm.for_role("decode")
    assert (prefill.num_kv_blocks, prefill.max_num_seqs, prefill.max_num_batched_tokens) == (100, 8, 4096)
    assert (prefill.torch_threads, prefill.kv_swap_space_mib) == (2, None)
    assert (decode.num_kv_blocks, decode.max_num_seqs, decode.max_num_batched_tokens) == (400, 128, 512)
    assert (decode.torch_threads, decode.kv_swap_space_mib) == (None, 64)
    assert m.llm.num_kv_blocks == 100  # the shared section itself is unchanged
    # what a replica receives (the model's dump, validated again there) merges the same
    again = ModelConfig.model_validate(json.loads(json.dumps(m.model_dump())))
    assert again.llm.for_role("decode") == decode and again.llm.for_role("prefill") == prefill


def test_a_colocated_model_is_its_llm_section() -> None:
    llm = LLMConfig(num_kv_blocks=7)
    assert llm.for_role("both") is llm
    with pytest.raises(KeyError, match="prefill"):
        llm.for_role("prefill")


@pytest.mark.parametrize("field", sorted(POOL_SHARED_FIELDS))
def test_a_setting_the_kv_needs_alike_is_refused_naming_model_pool_and_field(field: str) -> None:
    value = LLMConfig.model_fields[field].default
    with pytest.raises(ValidationError) as err:
        _model(decode={field: value})
    assert f"model 'm': llm.pools[role=decode].engine.{field}: must be the same" in str(err.value)
    with pytest.raises(ValidationError, match=re.escape(f"llm.pools[role=prefill].engine.{field}")):
        AppConfig.model_validate(
            {
                "models": [
                    _model().model_dump()
                    | {"llm": {"pools": [{"role": "prefill", "engine": {field: value}}, {"role": "decode"}]}}
                ]
            }
        )


def test_swap_space_is_a_decode_pools_setting() -> None:
    with pytest.raises(
        ValidationError, match=re.escape("llm.pools[role=prefill].engine.kv_swap_space_mib: a decode")
    ):
        _model(prefill={"kv_swap_space_mib": 32})


def test_an_override_keeps_llms_bounds() -> None:
    with pytest.raises(ValidationError, match="num_kv_blocks"):
        _model(decode={"num_kv_blocks": 0})
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        _model(prefill={"max_num_batched_tokens": 8})
    with pytest.raises(ValidationError, match="no_such_setting"):
        _model(prefill={"no_such_setting": 1})


def test_every_llm_setting_is_either_per_pool_or_shared() -> None:
    """A new ``llm`` setting must be placed: overridable per pool, or one both pools share."""
    per_pool = set(LLMPoolEngine.model_fields)
    assert per_pool <= set(LLMConfig.model_fields)
    assert not per_pool & POOL_SHARED_FIELDS
    assert set(LLMConfig.model_fields) == per_pool | POOL_SHARED_FIELDS | {"deployment", "pools"}
    for name, field in LLMPoolEngine.model_fields.items():  # the same bounds as llm's own
        assert field.metadata == LLMConfig.model_fields[name].metadata, name


def test_the_encoder_budget_follows_the_prefill_pools_step() -> None:
    m = _model(prefill={"max_num_batched_tokens": 6000}, decode={"max_num_batched_tokens": 64})
    compute, _ = encoder_budgets(m)
    assert compute == 6000  # above the largest item (4096, max_model_len): the step itself


def test_the_helm_chart_takes_the_same_per_pool_settings() -> None:
    schema = json.loads((Path(__file__).parents[3] / "helm/mmserve/values.schema.json").read_text())
    llm = schema["properties"]["models"]["items"]["properties"]["llm"]["properties"]
    engine = llm["pools"]["items"]["properties"]["engine"]
    assert engine["additionalProperties"] is False
    assert set(engine["properties"]) == set(LLMPoolEngine.model_fields)
