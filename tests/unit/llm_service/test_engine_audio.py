"""LLMEngine vs transformers on the tiny Qwen2-Audio (Qwen2 decoder, 1-D RoPE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.errors import RequestRejected
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_audio_array
from tests.unit.llm_service.hf_ref import build_case, hf_generate

N = 12
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
GREEDY = SamplingParams(max_tokens=N)


@pytest.fixture(scope="module")
def audio(tiny_audio_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    torch.set_num_threads(1)
    proc = AutoProcessor.from_pretrained(tiny_audio_dir)
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(tiny_audio_dir).eval()
    return hf, proc


def test_audio_clip_and_text_concurrently(audio, tiny_audio_dir) -> None:
    hf, proc = audio
    clip = build_case(
        hf, proc, f"listen {AUDIO} and answer", audio=[make_audio_array(1.0, freq=330.0)], sampling_rate=16000
    )
    (item,) = clip.mm_inputs
    assert item.modality == "audio" and item.length > 10
    text = build_case(hf, proc, "no sound in this one at all")
    eng = LLMEngine(
        EngineConfig(model=str(tiny_audio_dir), block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    )
    outs = eng.generate([GenerateRequest(c.prompt, GREEDY, c.mm_inputs) for c in (clip, text)])
    assert [o.token_ids for o in outs] == [hf_generate(hf, clip, N), hf_generate(hf, text, N)]
    assert outs[0].num_prompt_tokens == len(clip.prompt)
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks
    assert eng.eos_token_ids == (hf.generation_config.eos_token_id,)
    assert eng.hidden_size == hf.config.text_config.hidden_size


def test_audio_prefix_cache_keyed_by_mm_hash(audio, tiny_audio_dir) -> None:
    hf, proc = audio
    text = f"hear {AUDIO} then reply"
    a = build_case(hf, proc, text, ["clip-a"], audio=[make_audio_array(1.0, seed=1)], sampling_rate=16000)
    b = build_case(hf, proc, text, ["clip-b"], audio=[make_audio_array(1.0, seed=2)], sampling_rate=16000)
    assert a.prompt == b.prompt
    eng = LLMEngine(EngineConfig(model=str(tiny_audio_dir), block_size=4, num_kv_blocks=64))
    first, again, other = (
        eng.generate([GenerateRequest(c.prompt, GREEDY, c.mm_inputs)])[0] for c in (a, a, b)
    )
    assert first.token_ids == again.token_ids == hf_generate(hf, a, N)
    assert other.token_ids == hf_generate(hf, b, N)
    assert again.num_cached_tokens == (len(a.prompt) - 1) // 4 * 4
    assert other.num_cached_tokens == a.mm_inputs[0].offset // 4 * 4


def test_audio_model_rejects_bad_items(audio, tiny_audio_dir) -> None:
    hf, proc = audio
    clip = build_case(hf, proc, f"x {AUDIO}", audio=[make_audio_array(0.5)], sampling_rate=16000)
    eng = LLMEngine(EngineConfig(model=str(tiny_audio_dir), num_kv_blocks=16))
    item = clip.mm_inputs[0]
    shifted = type(item).of(item.embeddings, len(clip.prompt) - 2, item.mm_hash, "audio")
    with pytest.raises(RequestRejected, match="audio item 0") as e:
        eng.add_request("r", clip.prompt, GREEDY, [shifted])
    assert e.value.code == "bad_mm_input"
    with pytest.raises(RequestRejected, match="modality"):
        eng.add_request("r", clip.prompt, GREEDY, [type(item).of(item.embeddings, item.offset, "h", "smell")])


def test_half_precision_and_derived_pool(audio, tiny_audio_dir) -> None:
    hf, proc = audio
    case = build_case(hf, proc, "half precision run")
    with torch.no_grad():
        ref = torch.log_softmax(hf(**case.hf_inputs).logits[0, -1].float(), -1)
    cfg = EngineConfig(
        model=str(tiny_audio_dir), dtype="bfloat16", device="cpu", max_num_seqs=3, max_model_len=100
    )
    eng = LLMEngine(cfg)
    assert eng.stats().num_total_blocks == 3 * 7  # max_num_seqs sequences of ceil(100 / 16) blocks
    assert eng.runner.kv_caches[0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)
    (out,) = eng.generate([GenerateRequest(case.prompt, params)])
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.logprobs is not None
    first = out.logprobs[0]
    assert first.logprob == pytest.approx(float(ref[first.token_id]), abs=0.25)
