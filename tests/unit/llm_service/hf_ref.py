"""Build HF reference inputs and outputs for the engine-vs-transformers tests.

The embeddings handed to the engine are the very rows HF's own model feeds its language model
(captured with a pre-hook on ``model.language_model``), so only the engine is under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams


@dataclass
class RefCase:
    prompt: list[int]
    mm_inputs: list[MultiModalInput]
    hf_inputs: dict[str, Any]


def capture_lm_inputs(hf: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """Run one HF forward and return the ``inputs_embeds`` [T, hidden] given to its language model."""
    seen: list[torch.Tensor] = []

    def hook(_mod, _args, kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["inputs_embeds"].detach().clone())

    handle = hf.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        handle.remove()
    return seen[0][0]


def runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token_id``."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def build_case(
    hf: Any, processor: Any, text: str, mm_hashes: list[str] | None = None, **media: Any
) -> RefCase:
    inputs = dict(processor(text=[text], return_tensors="pt", **media))
    ids = inputs["input_ids"][0].tolist()
    cfg = hf.config
    spans: list[tuple[int, int, str, tuple[int, int, int] | None]] = []
    if getattr(cfg, "image_token_id", None) is not None:
        grids = {
            "image": [tuple(g.tolist()) for g in inputs.get("image_grid_thw", [])],
            "video": [tuple(g.tolist()) for g in inputs.get("video_grid_thw", [])],
        }
        for modality, tok in (("image", cfg.image_token_id), ("video", cfg.video_token_id)):
            for (off, n), grid in zip(runs(ids, tok), grids[modality], strict=True):
                spans.append((off, n, modality, grid))
    else:
        spans = [(off, n, "audio", None) for off, n in runs(ids, cfg.audio_token_id)]
    spans.sort()
    embeds = capture_lm_inputs(hf, inputs) if spans else None
    mm_inputs = []
    for i, (off, n, modality, grid) in enumerate(spans):
        assert embeds is not None
        mm_hash = mm_hashes[i] if mm_hashes else f"{modality}-{i}"
        mm_inputs.append(MultiModalInput.of(embeds[off : off + n].clone(), off, mm_hash, modality, grid))
    return RefCase(ids, mm_inputs, inputs)


def hf_generate_constrained(hf: Any, case: RefCase, backend: Any, spec: Any, n: int) -> list[int]:
    """HF ``generate`` under the same mask as the engine's structured output: xgrammar's own
    transformers processor over the same compiled grammar, and the special tokens the engine never
    lets a structured output write (``GrammarBackend.forbidden_token_ids``) suppressed."""
    import xgrammar as xgr
    from transformers import SuppressTokensLogitsProcessor

    processors = [xgr.contrib.hf.LogitsProcessor(backend.compile(spec))]
    if backend.forbidden_token_ids:
        processors.append(SuppressTokensLogitsProcessor(list(backend.forbidden_token_ids)))
    with torch.no_grad():
        out = hf.generate(**case.hf_inputs, max_new_tokens=n, do_sample=False, logits_processor=processors)
    return out[0, len(case.prompt) :].tolist()


def hf_generate(hf: Any, case: RefCase, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**case.hf_inputs, max_new_tokens=n, do_sample=False)
    return out[0, len(case.prompt) :].tolist()


# ---- what every engine-vs-transformers test module needs -------------------------------------------
N = 12  # new tokens per answer
IMG = "<|vision_start|><|image_pad|><|vision_end|>"  # a Qwen-VL image in the prompt text
VID = "<|vision_start|><|video_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=N)  # stops at EOS like HF generate


def hf_model(model_dir: Any) -> tuple[Any, Any]:
    """transformers' model (the class the checkpoint's ``architectures`` names) and its processor."""
    import json
    from pathlib import Path

    import transformers

    torch.set_num_threads(1)
    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    return getattr(transformers, arch).from_pretrained(model_dir).eval(), proc


def image(w: int, h: int, seed: int) -> Any:
    from PIL import Image

    from tests.media import make_image_array

    return Image.fromarray(make_image_array(w, h, seed))


def engine(model_dir: Any, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def run(eng: LLMEngine, cases: list[RefCase], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = eng.generate([GenerateRequest(c.prompt, params, c.mm_inputs) for c in cases])
    return [o.token_ids for o in outs]


def assert_all_free(eng: LLMEngine) -> None:
    st = eng.stats()
    assert not eng.has_unfinished_requests()
    assert st.num_free_blocks == st.num_total_blocks and st.kv_usage == 0.0
    assert not eng.runner.states  # every request's tensors dropped as it left
