"""Write a complete, loadable HF model directory for a tiny random-weight model of one family: Qwen2-VL,
Qwen2.5-VL, Qwen2-Audio, Gemma 3, Qwen3-VL, Qwen3.5 or Gemma 4, each one ``TinyRecipe`` in ``TINY_RECIPES``.

Same flags give byte-identical files: the tokenizer is trained on the shipped corpus and every weight
is drawn from a generator seeded by ``seed`` and the parameter's name, in a fixed order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from cluster.tiny_model.gemma3 import (
    GEMMA3_CHAT_TEMPLATE,
    build_gemma3,
    gemma3_tokenizer,
    save_gemma3_processor,
)
from cluster.tiny_model.gemma4 import VARIANTS as GEMMA4_VARIANTS
from cluster.tiny_model.gemma4 import (
    build_gemma4,
    gemma4_tokenizer,
    save_gemma4_processor,
)
from cluster.tiny_model.qwen2_audio import build_qwen2_audio, save_qwen2_audio_processor
from cluster.tiny_model.qwen2_vl import (
    build_qwen2_5_vl,
    build_qwen2_vl,
    save_qwen2_5_vl_processor,
    save_qwen2_vl_processor,
)
from cluster.tiny_model.qwen3_5 import build_qwen3_5
from cluster.tiny_model.qwen3_vl import build_qwen3_vl, save_qwen3_vl_processor
from cluster.tiny_model.qwen3_vl_template import QWEN3_VL_CHAT_TEMPLATE
from cluster.tiny_model.released_templates import released_template
from cluster.tiny_model.tokenizer import QWEN2_AUDIO_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE, train_tokenizer


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


# (vocab_size, chat_template) -> tokenizer; (size, tok, variant) -> (HF config, HF model class);
# (out_dir, tok, chat_template) -> None
TokenizerBuilder = Callable[[int, str], PreTrainedTokenizerFast]
BuiltModel = tuple[PretrainedConfig, type[PreTrainedModel]]  # (HF config, HF model class)
ModelBuilder = Callable[[ModelSize, PreTrainedTokenizerFast, str], BuiltModel]
ProcessorSaver = Callable[[str, PreTrainedTokenizerFast, str], None]


@dataclass(frozen=True)
class TinyRecipe:
    """One family's tiny model: everything ``make_tiny_model`` needs. ``name`` and ``model_type`` are the
    family's ``EncoderFamily.name`` and its key in ``ENCODER_FAMILIES`` and ``DECODER_FAMILIES`` (a test
    checks)."""

    name: str  # --family, the config's `tiny`
    model_type: str  # HF model_type of the config ``build`` returns
    chat_template: str  # given to the tokenizer and to the processor
    tokenizer: TokenizerBuilder
    build: ModelBuilder
    save_processor: ProcessorSaver
    norm_jitter: float = 0.0  # noise on norm weights, so that a test sees one loaded into the wrong place
    variants: tuple[str, ...] = ("base",)  # alternative recipes ``build`` takes; "base" first


def base_only(build: Callable[[ModelSize, PreTrainedTokenizerFast], BuiltModel]) -> ModelBuilder:
    """A builder of a family without variants, as a ``ModelBuilder`` (only ever given "base")."""
    return lambda size, tok, variant: build(size, tok)


TINY_RECIPES: dict[str, TinyRecipe] = {
    recipe.name: recipe
    for recipe in (
        TinyRecipe(
            name="qwen2-vl",
            model_type="qwen2_vl",
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
            tokenizer=train_tokenizer,
            build=base_only(build_qwen2_vl),
            save_processor=save_qwen2_vl_processor,
        ),
        TinyRecipe(
            name="qwen2.5-vl",
            model_type="qwen2_5_vl",
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
            tokenizer=train_tokenizer,
            build=base_only(build_qwen2_5_vl),
            save_processor=save_qwen2_5_vl_processor,
            norm_jitter=0.1,
        ),
        TinyRecipe(
            name="qwen2-audio",
            model_type="qwen2_audio",
            chat_template=QWEN2_AUDIO_CHAT_TEMPLATE,
            tokenizer=train_tokenizer,
            build=base_only(build_qwen2_audio),
            save_processor=save_qwen2_audio_processor,
        ),
        TinyRecipe(
            name="gemma3",
            model_type="gemma3",
            chat_template=GEMMA3_CHAT_TEMPLATE,
            tokenizer=gemma3_tokenizer,
            build=base_only(build_gemma3),
            save_processor=save_gemma3_processor,
            norm_jitter=0.1,
        ),
        TinyRecipe(
            name="qwen3-vl",
            model_type="qwen3_vl",
            chat_template=QWEN3_VL_CHAT_TEMPLATE,  # the released one: tools (hermes) included
            tokenizer=train_tokenizer,
            build=base_only(build_qwen3_vl),
            save_processor=save_qwen3_vl_processor,
            norm_jitter=0.1,
        ),
        TinyRecipe(
            name="qwen3.5",
            model_type="qwen3_5",
            chat_template=released_template("qwen3.5"),  # tools (<function=...>) included
            tokenizer=train_tokenizer,
            build=base_only(build_qwen3_5),
            save_processor=save_qwen3_vl_processor,  # transformers maps qwen3_5 to Qwen3-VL's processor
            norm_jitter=0.1,
        ),
        TinyRecipe(
            name="gemma4",
            model_type="gemma4",
            chat_template=released_template("gemma4"),  # tools included
            tokenizer=gemma4_tokenizer,
            build=build_gemma4,
            save_processor=save_gemma4_processor,
            norm_jitter=0.1,
            variants=GEMMA4_VARIANTS,
        ),
    )
}

FAMILIES: tuple[str, ...] = tuple(TINY_RECIPES)


def tiny_recipe(family: str, variant: str = "base") -> TinyRecipe:
    """``family``'s recipe; a ``ValueError`` naming the choices for an unknown family or variant."""
    recipe = TINY_RECIPES.get(family)
    if recipe is None:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if variant not in recipe.variants:
        if len(recipe.variants) == 1:
            raise ValueError(f"family {family!r} has no variants")
        raise ValueError(f"unknown {family} variant {variant!r}; choose one of {', '.join(recipe.variants)}")
    return recipe


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


def make_tiny_model(
    out_dir: str | Path, family: str, size: ModelSize | None = None, variant: str = "base"
) -> Path:
    """Write config.json, model.safetensors, tokenizer and processor files for ``family`` to ``out_dir``
    (``variant``: one of the family's ``TinyRecipe.variants``, e.g. ``cluster.tiny_model.gemma4.VARIANTS``)."""
    recipe = tiny_recipe(family, variant)
    size = size or PRESETS["tiny"]
    if size.hidden_size % size.num_heads or size.num_heads % size.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if size.vision_hidden_size % size.vision_num_heads:
        raise ValueError("vision_hidden_size must divide by vision_num_heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = recipe.tokenizer(size.vocab_size, recipe.chat_template)
    config, model_cls = recipe.build(size, tok, variant)
    assert config.model_type == recipe.model_type, (family, config.model_type)
    model = model_cls(config)
    _init_weights(model, size.seed, norm_jitter=recipe.norm_jitter)
    model.eval()
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    state, seen = {}, set()
    for k, v in model.state_dict().items():  # a tied lm_head is saved once, as its embedding (HF's way)
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            state[k] = v.detach().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    recipe.save_processor(str(out), tok, recipe.chat_template)
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
