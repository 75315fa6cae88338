"""Write a complete, loadable HF model directory for a tiny random-weight Qwen2-VL, Qwen2.5-VL, Qwen2-Audio,
Gemma 3, Qwen3-VL, Qwen3.5 or Gemma 4.

Same flags give byte-identical files: the tokenizer is trained on the shipped corpus and every weight
is drawn from a generator seeded by ``seed`` and the parameter's name, in a fixed order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.tiny_model.gemma3 import build_gemma3, gemma3_tokenizer, save_gemma3_processor
from cluster.tiny_model.gemma4 import build_gemma4, gemma4_tokenizer, save_gemma4_processor
from cluster.tiny_model.qwen3_5 import build_qwen3_5
from cluster.tiny_model.qwen3_vl import build_qwen3_vl, save_qwen3_vl_processor
from cluster.tiny_model.qwen_vl import qwen_token_ids, qwen_vl_config
from cluster.tiny_model.tokenizer import QWEN2_AUDIO_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE, train_tokenizer

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen2-audio", "gemma3", "qwen3-vl", "qwen3.5", "gemma4")
VL_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int = 1024
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vision_depth: int = 2  # vision blocks (Qwen2-VL, Qwen2.5-VL) or audio encoder layers (Qwen2-Audio)
    vision_hidden_size: int = 32  # vision embed_dim or audio d_model
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64  # vision MLP width (embed_dim * mlp_ratio) or audio ffn dim
    max_position_embeddings: int = 4096
    seed: int = 0


PRESETS: dict[str, ModelSize] = {
    "tiny": ModelSize(),
    "small": ModelSize(
        vocab_size=4096,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        vision_depth=6,
        vision_hidden_size=256,
        vision_num_heads=4,
        vision_intermediate_size=1024,
    ),
    # A tiny LLM behind a vision tower deep and wide enough that, as in real VLMs, encoding an image
    # is most of a cold single-image request's TTFT (README, "The encoder-heavy preset"): for
    # benchmarks of what the encoder's cost changes (encoder cache hits, overlap with prefill). The
    # LLM's heads are 32 wide, the narrowest vLLM's CPU attention takes, so vLLM serves it too.
    "encoder-heavy": ModelSize(
        hidden_size=128,
        intermediate_size=256,
        vision_depth=12,
        vision_hidden_size=320,
        vision_num_heads=5,
        vision_intermediate_size=1280,
    ),
}


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (t, h, w) in Qwen2-VL's 2:3:3 proportion."""
    half = head_dim // 2
    t = max(1, round(half * 2 / 8))
    h = (half - t) // 2
    return [t, h, half - t - h]


def _text_config(size: ModelSize, bos: int, eos: int, pad: int) -> dict:
    return {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": False,
    }


def _build_qwen2_vl(size: ModelSize, tok):  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = qwen_token_ids(tok)
    text = _text_config(size, ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    head_dim = size.hidden_size // size.num_heads
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": _mrope_section(head_dim),
    }
    vision = {
        "depth": size.vision_depth,
        "embed_dim": size.vision_hidden_size,
        "hidden_size": size.hidden_size,
        "num_heads": size.vision_num_heads,
        "mlp_ratio": size.vision_intermediate_size // size.vision_hidden_size,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = qwen_vl_config(Qwen2VLConfig, "Qwen2VLForConditionalGeneration", text, vision, tok)
    return config, Qwen2VLForConditionalGeneration


def _fullatt_block_indexes(depth: int) -> list[int]:
    """Every second block attends over whole frames, the others in windows (a real 32-block tower: 7, 15, 23, 31)."""
    return list(range(1, depth, 2)) or [0]


def _build_qwen2_5_vl(size: ModelSize, tok):  # type: ignore[no-untyped-def]
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = qwen_token_ids(tok)
    text = _text_config(size, ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    head_dim = size.hidden_size // size.num_heads
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": _mrope_section(head_dim),
    }
    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "intermediate_size": size.vision_intermediate_size,
        "num_heads": size.vision_num_heads,
        "out_hidden_size": size.hidden_size,
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,  # 4x4 merged tokens per window, as in the released checkpoints
        "fullatt_block_indexes": _fullatt_block_indexes(size.vision_depth),
        "tokens_per_second": 2,  # the released checkpoints' value (transformers' default is 4)
    }
    config = qwen_vl_config(Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration", text, vision, tok)
    return config, Qwen2_5_VLForConditionalGeneration


def _build_qwen2_audio(size: ModelSize, tok):  # type: ignore[no-untyped-def]
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    ids = qwen_token_ids(tok)
    text = _text_config(size, ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"])
    text["model_type"] = "qwen2"
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    audio = {
        "d_model": size.vision_hidden_size,
        "encoder_layers": size.vision_depth,
        "encoder_attention_heads": size.vision_num_heads,
        "encoder_ffn_dim": size.vision_intermediate_size,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    }
    config = Qwen2AudioConfig(
        audio_config=audio,
        text_config=text,
        audio_token_index=ids["<|AUDIO|>"],
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
    )
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    return config, Qwen2AudioForConditionalGeneration


_BUILDERS = {
    "qwen2-vl": _build_qwen2_vl,
    "qwen2.5-vl": _build_qwen2_5_vl,
    "qwen2-audio": _build_qwen2_audio,
    "qwen3-vl": build_qwen3_vl,
    "qwen3.5": build_qwen3_5,
    "gemma3": build_gemma3,
    "gemma4": build_gemma4,
}


def _init_weights(model: torch.nn.Module, seed: int, norm_jitter: float = 0.0) -> None:
    """Deterministic init, independent of transformers' own init code and of parameter creation order.

    Matrices get N(0, 1/fan_in) so activations keep unit scale through the random network and logits
    are spread out (greedy argmax far from ties); norms start at 1 (plus ``norm_jitter`` noise, so a
    test sees a norm weight loaded into the wrong place), biases at small values.
    """
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            if "norm" in name.split(".")[-2] or name.endswith(("ln_q.weight", "layer_norm.weight")):
                if name.endswith("weight"):
                    p.copy_(1.0 + norm_jitter * torch.randn(p.shape, generator=gen))
                else:
                    p.zero_()
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's MoE router: gains
                p.copy_(1.0 + norm_jitter * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "embed_tokens" in name or "embed_positions" in name or "position_embedding_table" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def _save_processor(family: str, out: Path, tok) -> None:  # type: ignore[no-untyped-def]
    if family in ("qwen3-vl", "qwen3.5"):  # transformers maps qwen3_5 to Qwen3-VL's processor
        save_qwen3_vl_processor(str(out), tok, QWEN2_VL_CHAT_TEMPLATE)
        return
    if family == "gemma3":
        save_gemma3_processor(str(out), tok)
        return
    if family == "gemma4":
        save_gemma4_processor(str(out), tok)
        return
    if family in VL_FAMILIES:
        from transformers import (
            Qwen2_5_VLProcessor,
            Qwen2VLImageProcessor,
            Qwen2VLProcessor,
            Qwen2VLVideoProcessor,
        )

        # Fewer pixels than a real checkpoint allows, so one image costs at most 1024 embeddings.
        # Qwen2.5-VL's released checkpoints use these same image/video processor classes.
        limits = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1024}
        proc_cls = Qwen2VLProcessor if family == "qwen2-vl" else Qwen2_5_VLProcessor
        proc = proc_cls(
            image_processor=Qwen2VLImageProcessor(**limits),
            video_processor=Qwen2VLVideoProcessor(**limits),
            tokenizer=tok,
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
        )
    else:
        from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

        proc = Qwen2AudioProcessor(
            feature_extractor=WhisperFeatureExtractor(feature_size=128),
            tokenizer=tok,
            chat_template=QWEN2_AUDIO_CHAT_TEMPLATE,
        )
    proc.save_pretrained(str(out))


def make_tiny_model(
    out_dir: str | Path, family: str, size: ModelSize | None = None, variant: str = "base"
) -> Path:
    """Write config.json, model.safetensors, tokenizer and processor files for ``family`` to ``out_dir``
    (``variant``: a family's alternative recipe, Gemma 4's ``cluster.tiny_model.gemma4.VARIANTS``)."""
    if variant != "base" and family != "gemma4":
        raise ValueError(f"family {family!r} has no variants")
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(_BUILDERS)}")
    size = size or PRESETS["tiny"]
    if size.hidden_size % size.num_heads or size.num_heads % size.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if size.vision_hidden_size % size.vision_num_heads:
        raise ValueError("vision_hidden_size must divide by vision_num_heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family == "gemma3":
        tok = gemma3_tokenizer(size.vocab_size)
    elif family == "gemma4":
        tok = gemma4_tokenizer(size.vocab_size)
    else:
        template = QWEN2_VL_CHAT_TEMPLATE if family in VL_FAMILIES else QWEN2_AUDIO_CHAT_TEMPLATE
        tok = train_tokenizer(size.vocab_size, template)
    if family == "gemma4":
        config, model_cls = build_gemma4(size, tok, variant)
    else:
        config, model_cls = _BUILDERS[family](size, tok)
    model = model_cls(config)
    _init_weights(
        model,
        size.seed,
        norm_jitter=0.1 if family in ("qwen2.5-vl", "gemma3", "qwen3-vl", "qwen3.5", "gemma4") else 0.0,
    )
    model.eval()
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    state, seen = {}, set()
    for k, v in model.state_dict().items():  # a tied lm_head is saved once, as its embedding (HF's way)
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            state[k] = v.detach().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _save_processor(family, out, tok)
    (out / "mmserve_tiny.json").write_text(
        json.dumps(
            {
                "family": family,
                **dataclasses.asdict(size),
                **({"variant": variant} if variant != "base" else {}),
            },
            indent=2,
            sort_keys=True,
        )
    )
    return out
