"""Load a decoder's weights from the model directory's safetensors files (HF names)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from llm_service.models.qwen2 import Qwen2ForCausalLM

# Where the language model sits inside each HF checkpoint layout (tried in order).
LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def _local_name(key: str, extra: tuple[str, ...] = ()) -> str | None:
    """``extra``: the decoder's own top-level modules beyond these (``extra_weight_prefixes``)."""
    if key in LM_HEADS:
        return "lm_head.weight"
    for prefix in LM_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            if rest.startswith(("embed_tokens.", "layers.", "norm.", *extra)):
                return rest
            return None
    return None


def load_weights(model: Qwen2ForCausalLM, model_dir: str | Path) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    extra = tuple(getattr(model, "extra_weight_prefixes", ()))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _local_name(key, extra)
                if name is None or name not in params:
                    continue
                with torch.no_grad():
                    params[name].copy_(st.get_tensor(key))
                loaded.add(name)
    if model.cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
