"""LLMEngine vs transformers on the tiny Gemma 4: greedy outputs must agree token for token.

The tiny model (``cluster/tiny_model/gemma4.py``) has sliding layers with a window of 8 tokens, full
layers with wider heads, per-layer embeddings (PLE) and two KV-shared layers; each image is up to 70
soft tokens, attending each other both ways on the sliding layers. The embeddings handed to the
engine are the rows HF feeds its own language model, so what is under test is the decoder (PLE from
the token ids, placeholders included), the masks, the shared KV and the engine's chunking, preemption
and caching.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llm_service import kv_cache_sizing
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_audio_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.llm_service.hf_ref import (
    N,
    RefCase,
    assert_all_free,
    capture_lm_inputs,
    engine,
    hf_generate,
    hf_model,
    image,
    run,
    runs,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma4")


@pytest.fixture(scope="module")
def gemma(model_dir: Path) -> tuple[Any, Any]:
    return hf_model(model_dir)  # type: ignore[no-any-return]


def case(gemma: tuple[Any, Any], text: str, images=None, audios=None, hashes=None) -> RefCase:  # type: ignore[no-untyped-def]
    """``text`` as a user turn (``<image>`` / ``<audio>`` mark the items) through HF's template and
    processor; the items' embeddings are the rows HF gives its language model."""
    hf, proc = gemma
    parts: list[dict[str, Any]] = []
    for piece in text.replace("<audio>", "\0audio\0").replace("<image>", "\0image\0").split("\0"):
        if piece in ("image", "audio"):
            parts.append({"type": piece})
        elif piece:
            parts.append({"type": "text", "text": piece})
    prompt = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    media: dict[str, Any] = {}
    if images:
        media["images"] = images
    if audios:
        media["audio"] = audios
    inputs = dict(proc(text=[prompt], return_tensors="pt", **media))
    ids = inputs["input_ids"][0].tolist()
    spans = [(o, n, "image") for o, n in runs(ids, hf.config.image_token_id)]
    spans += [(o, n, "audio") for o, n in runs(ids, hf.config.audio_token_id)]
    spans.sort()
    embeds = capture_lm_inputs(hf, inputs) if spans else None
    items = []
    for i, (off, n, modality) in enumerate(spans):
        assert embeds is not None
        mm_hash = (hashes or {}).get(i, f"{modality}-{i}")
        items.append(MultiModalInput.of(embeds[off : off + n].clone(), off, mm_hash, modality))
    return RefCase(ids, items, inputs)


def test_family_facts(model_dir: Path) -> None:
    from llm_service.models.gemma4_config import Gemma4TextConfig

    cfg = engine(model_dir).runner.text_config
    assert isinstance(cfg, Gemma4TextConfig) and cfg.model_type == "gemma4"
    assert cfg.layer_is_sliding == (True, False, True, True, False) and cfg.sliding_window == 8
    assert cfg.layer_head_dims == (16, 32, 16, 16, 32) and cfg.kv_source == (0, 1, 2, 2, 1)
    assert cfg.ple_dim == 8 and cfg.bidirectional_vision and cfg.final_logit_softcapping == 30.0
    assert (cfg.rope_full.theta, cfg.rope_full.rotary_fraction) == (1_000_000.0, 0.25)


def test_ple_equals_hf(gemma, model_dir) -> None:
    """Our per-layer inputs of an image+audio prompt equal HF's: its token-identity part (looked up with
    pad at the placeholders) projected with the merged rows, as its language model does."""
    hf, _ = gemma
    c = case(gemma, "<image>hear <audio> this", [image(64, 48, 1)], [make_audio_array(0.8)])
    seen: dict[str, torch.Tensor] = {}

    def hook(_mod, _args, kwargs):  # type: ignore[no-untyped-def]
        seen.update(embeds=kwargs["inputs_embeds"][0], ple=kwargs["per_layer_inputs"][0])

    lm = hf.model.language_model
    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        hf(**c.hf_inputs)
        handle.remove()
        ref = lm.project_per_layer_inputs(seen["embeds"][None], seen["ple"][None])[0]
        ours = engine(model_dir).runner.model.per_layer_inputs(seen["embeds"], torch.tensor(c.prompt))
    assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


def test_text_longer_than_window(gemma, model_dir) -> None:
    c = case(gemma, "the quick brown fox jumps over the lazy dog and keeps running far away")
    assert len(c.prompt) > 3 * 8
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_one_image(gemma, model_dir) -> None:
    c = case(gemma, "<image>describe this picture please", [image(80, 48, 1)])
    assert [m.modality for m in c.mm_inputs] == ["image"]
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_two_images(gemma, model_dir) -> None:
    c = case(gemma, "a <image> and b <image> compare them", [image(64, 48, 2), image(90, 120, 3)])
    assert len(c.mm_inputs) == 2
    assert run(engine(model_dir), [c]) == [hf_generate(gemma[0], c, N)]


def test_audio_and_image_with_audio(gemma, model_dir) -> None:
    a = case(gemma, "<audio>what is this sound", audios=[make_audio_array(1.2, freq=330.0)])
    b = case(gemma, "<image> and <audio> together", [image(72, 56, 4)], [make_audio_array(0.9)])
    assert [m.modality for m in b.mm_inputs] == ["image", "audio"]
    assert run(engine(model_dir), [a, b]) == [hf_generate(gemma[0], x, N) for x in (a, b)]


def test_image_attention_is_bidirectional_on_sliding_layers(gemma, model_dir) -> None:
    """HF's own model, masked causally, disagrees with HF (the spans matter here), and we agree with HF."""
    hf, _ = gemma
    c = case(gemma, "<image>what is it", [image(64, 64, 4)])
    with torch.no_grad():
        ref = hf(**c.hf_inputs).logits[0, -1]
        causal = hf(
            **{**c.hf_inputs, "mm_token_type_ids": torch.zeros_like(c.hf_inputs["mm_token_type_ids"])}
        ).logits[0, -1]
    assert (ref - causal).abs().max() > 1e-2
    (out,) = engine(model_dir).generate(
        [GenerateRequest(c.prompt, SamplingParams(max_tokens=1, logprobs=5), c.mm_inputs)]
    )
    assert out.logprobs is not None
    ref_top = torch.topk(torch.log_softmax(ref.float(), -1), 5)
    assert [t for t, _ in out.logprobs[0].top] == ref_top.indices.tolist()
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)


@pytest.mark.slow
def test_chunked_prefill_splits_audio_never_an_image(gemma, model_dir) -> None:
    """Audio spans attend causally, so a chunk may end inside one; an image goes whole into one chunk."""
    c = case(gemma, "look <image> hear <audio> say", [image(64, 48, 5)], [make_audio_array(1.0)])
    img, aud = c.mm_inputs
    budget = 80
    eng = engine(model_dir, max_num_batched_tokens=budget)
    steps: list[tuple[int, int]] = []
    real = eng.runner.execute

    def spy(out):  # type: ignore[no-untyped-def]
        steps.extend((ch.start, ch.start + ch.num_tokens) for ch in out.chunks if ch.start < len(c.prompt))
        return real(out)

    eng.runner.execute = spy  # type: ignore[method-assign]
    assert run(eng, [c]) == [hf_generate(gemma[0], c, N)]
    assert any(aud.offset < e < aud.end for _, e in steps)  # an audio span was cut
    assert all(e <= img.offset or s >= img.end or (s <= img.offset and e >= img.end) for s, e in steps)
    assert_all_free(eng)


@pytest.mark.slow
def test_preemption_and_prefix_cache(gemma, model_dir) -> None:
    texts = ["hi", "one two three four five six seven", "a b c d e f g h i j k l m n o p q r s t u v"]
    cases = [case(gemma, t) for t in texts]
    cases += [case(gemma, f"img {i} <image> ok", [image(64 + 28 * i, 48, 20 + i)]) for i in range(2)]
    refs = [hf_generate(gemma[0], c, N) for c in cases]
    eng = engine(model_dir, num_kv_blocks=30, block_size=4, max_num_batched_tokens=80)
    assert run(eng, cases) == refs
    assert eng.stats().num_preemptions > 0
    again = run(eng, cases[-1:])
    assert again == refs[-1:] and eng.stats().prefix_hit_tokens > 0
    assert_all_free(eng)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["k_eq_v", "moe"])
def test_variants(variant: str) -> None:
    model_dir = tiny_model_dir("gemma4", variant)
    ref = hf_model(model_dir)
    cases = [
        case(ref, "the quick brown fox jumps over the lazy dog"),
        case(ref, "<image> and <audio> ok", [image(64, 48, 6)], [make_audio_array(0.6)]),
    ]
    assert run(engine(model_dir), cases) == [hf_generate(ref[0], c, N) for c in cases]


def test_causal_images_are_cut_by_chunks() -> None:
    """Without ``use_bidirectional_attention`` image soft tokens attend causally: 16-token chunks cut
    through a 60-token image and the answers equal HF's (the bidirectional base recipe never is cut:
    ``test_chunked_prefill_splits_audio_never_an_image``)."""
    model_dir = tiny_model_dir("gemma4", "causal_vision")
    ref = hf_model(model_dir)
    c = case(ref, "look <image> and say", [image(96, 64, 8)])
    (img,) = c.mm_inputs
    eng = engine(model_dir, max_num_batched_tokens=16)
    assert eng.runner.model.bidirectional_mm is False
    ends: list[int] = []
    real = eng.runner.execute

    def spy(out):  # type: ignore[no-untyped-def]
        ends.extend(ch.start + ch.num_tokens for ch in out.chunks)
        return real(out)

    eng.runner.execute = spy  # type: ignore[method-assign]
    assert run(eng, [c]) == [hf_generate(ref[0], c, N)]
    assert sum(img.offset < e < img.end for e in ends) >= 2  # the image's span was cut more than once
    assert_all_free(eng)


def test_shared_layers_own_no_kv(model_dir) -> None:
    """KV bytes per token = the KV-writing layers' (num_kv_heads x head_dim) x 2 (K, V) x 4 bytes:
    sliding layers 2 x 16, full layers 2 x 32; the shared layers 3 and 4 add nothing. (One block
    group for every layer here: the window layers' own group is ``test_window_layers_own_blocks``.)"""
    shared = engine(model_dir, block_size=4, sliding_window_blocks=False).runner
    unshared = engine(tiny_model_dir("gemma4", "unshared"), block_size=4, sliding_window_blocks=False).runner
    assert len(shared.kv_caches) == 3 and len(unshared.kv_caches) == 5
    assert shared.model.cache_index == [0, 1, 2, 2, 1]
    assert shared.block_bytes == 4 * 2 * (32 + 64 + 32) * 4
    assert unshared.block_bytes == 4 * 2 * (32 + 64 + 32 + 32 + 64) * 4
    assert (
        sum(t.numel() * t.element_size() for t in shared.kv_caches) == shared.num_blocks * shared.block_bytes
    )


def test_sharing_admits_proportionally_more(monkeypatch, model_dir) -> None:
    """Under one KV memory budget the engine derives 7/4 as many blocks for the sharing model (1792 vs
    1024 bytes per token) and admits that many more requests at once."""
    budget = 28 * 4 * 1792  # 28 blocks of 4 tokens for the unshared model
    monkeypatch.setattr(kv_cache_sizing, "CPU_KV_CACHE_CAP_BYTES", budget)
    admitted = {}
    for name, d in (("unshared", tiny_model_dir("gemma4", "unshared")), ("shared", model_dir)):
        eng = engine(
            d,
            num_kv_blocks=None,
            block_size=4,
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
            sliding_window_blocks=False,  # sharing alone (the window group: test_windows_admit_more)
        )
        for i in range(20):
            eng.add_request(f"r{i}", [2, *range(100 + i, 119 + i)], SamplingParams(max_tokens=2))
        eng.step()  # admits what the blocks allow; each admitted request has its first token, none is done
        admitted[name] = (eng.stats().num_total_blocks, eng.stats().num_running)
        assert eng.stats().num_running == eng.stats().num_total_blocks // 5  # 20 tokens: 5 blocks each
    assert admitted["unshared"][0] == 28 and admitted["shared"][0] == 49  # 28 x 1792 / 1024
    assert admitted["shared"][1] / admitted["unshared"][1] == 9 / 5


def test_window_layers_own_blocks(gemma, model_dir) -> None:
    """The sliding layers (window 8) keep their own block group, sized for the batch (2 sequences,
    16-token chunks: 2 x (2 + 3) + 2 x 4 = 18 blocks and the null block), and give back what falls out
    of the window: long prompts, an audio clip cut by chunks, preemption and a prefix hit equal HF (an
    image is one chunk, longer than these 16 tokens: the other tests here run images on it)."""
    texts = [
        "the quick brown fox jumps over the lazy dog and keeps running",
        "hi",
    ]  # 53 + 24 tokens: 20 blocks
    cases = [case(gemma, t) for t in texts] + [
        case(gemma, "hear <audio> now", audios=[make_audio_array(0.7)])  # 56 + 24 tokens: 20 blocks
    ]
    refs = [hf_generate(gemma[0], c, 24) for c in cases]
    eng = engine(model_dir, num_kv_blocks=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    runner, kv = eng.runner, eng.scheduler.kv
    assert runner.window == 8 and runner.num_window_blocks == 18
    sliding = [w is not None for w in runner.model.cfg.kv_layer_windows()]
    assert sliding == [True, False, True]
    assert [t.shape[1] for t in runner.kv_caches] == [19, 20, 19]
    peak: list[int] = []
    real = runner.execute

    def spy(out):  # type: ignore[no-untyped-def]
        peak.extend(kv.num_window_blocks_held(c.request.request_id) for c in out.chunks if c.num_tokens == 1)
        return real(out)

    runner.execute = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = eng.generate([GenerateRequest(c.prompt, params, c.mm_inputs) for c in cases])
    assert [o.token_ids for o in outs] == refs
    assert max(peak) <= 8 // 4 + 2  # a decoding sequence: its window and the block being filled
    assert eng.stats().num_preemptions > 0  # 20 full blocks cannot hold the first two at once
    again = eng.generate([GenerateRequest(cases[0].prompt, params, [])])
    assert again[0].token_ids == refs[0] and eng.stats().prefix_hit_tokens > 0
    assert_all_free(eng)
    assert kv.num_free_window_blocks == kv.num_window_blocks


def test_windows_admit_more(monkeypatch, model_dir) -> None:
    """Under one KV memory budget (400 blocks of every layer), giving the window layers only what the
    batch can read (4 sequences, 32-token chunks: 36 blocks + the null block) leaves the full layer
    (half of each block's bytes here) 763 blocks: 1.9x the context."""
    budget = 400 * 4 * 1024  # 1024 bytes per token over the three KV-writing layers
    monkeypatch.setattr(kv_cache_sizing, "CPU_KV_CACHE_CAP_BYTES", budget)
    blocks = {}
    for windowed in (False, True):
        eng = engine(
            model_dir,
            num_kv_blocks=None,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=4096,
            sliding_window_blocks=windowed,
        )
        blocks[windowed] = eng.stats().num_total_blocks
        held = sum(t.numel() * t.element_size() for t in eng.runner.kv_caches)
        assert held <= budget
    assert blocks == {False: 400, True: (budget - 37 * 2048) // 2048}


def test_config_without_per_layer_config(model_dir) -> None:
    """A config.json as released (``global_head_dim``, ``num_global_key_value_heads``, no
    ``per_layer_config``) reads as transformers derives it; a shared layer with no producer of its kind
    is refused."""
    import json

    from llm_service.models.gemma4_config import Gemma4TextConfig

    cfg = json.loads((model_dir / "config.json").read_text())
    text = {k: v for k, v in cfg["text_config"].items() if k != "per_layer_config"}
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    plain = Gemma4TextConfig.from_hf_config(model_dir, {**cfg, "text_config": text}, "rope")
    assert plain.layer_head_dims == (16, 32, 16, 16, 32) and plain.layer_kv_heads == (2,) * 5
    keqv = Gemma4TextConfig.from_hf_config(
        model_dir, {**cfg, "text_config": {**text, "attention_k_eq_v": True}}, "rope"
    )
    assert keqv.layer_kv_heads == (2, 1, 2, 2, 1)
    assert keqv.kv_layer_specs() == [(2, 16), (1, 32), (2, 16)]
    lonely = {
        **text,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "num_kv_shared_layers": 1,
    }
    with pytest.raises(ValueError, match="no KV producer"):
        Gemma4TextConfig.from_hf_config(model_dir, {**cfg, "text_config": lonely}, "rope")


def test_shared_layers_run_on_each_chunks_last_row(gemma, model_dir) -> None:
    """Prefill chunks of two prompts and later decodes: layers 0-2 see every row, the KV-shared layers
    3-4 only the last row of each chunk (nothing of theirs is cached), and the answers equal HF's."""
    cases = [
        case(gemma, "a b c d e f g h i j k l m n o p"),
        case(gemma, "<image>what is it", [image(64, 48, 9)]),
    ]
    eng = engine(model_dir, max_num_batched_tokens=96)
    seen: dict[int, list[int]] = {0: [], 3: [], 4: []}
    for i in seen:
        eng.runner.model.layers[i].register_forward_pre_hook(
            lambda _m, args, i=i: seen[i].append(args[0].shape[0])  # type: ignore[misc]
        )
    chunks: list[int] = []
    real = eng.runner.execute

    def spy(out):  # type: ignore[no-untyped-def]
        chunks.append(len(out.chunks))
        return real(out)

    eng.runner.execute = spy  # type: ignore[method-assign]
    assert run(eng, cases) == [hf_generate(gemma[0], c, N) for c in cases]
    assert sum(seen[0]) > sum(chunks)  # the prompts' rows
    assert seen[3] == seen[4] == chunks  # one row per chunk, every step
