"""The decoder's fused ops give HF's bits, not just close values (greedy equality rests on it)."""

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from llm_service.models.qwen2 import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 128), (33, 4, 64), (300, 896)])
def test_rms_norm_is_hf_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    ours, hf = RMSNorm(shape[-1], 1e-6), Qwen2RMSNorm(shape[-1], eps=1e-6)
    w = torch.randn(shape[-1], generator=g)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    ours, hf = ours.to(dtype), hf.to(dtype)
    with torch.no_grad():
        a, b = ours(x), hf(x)
    assert a.dtype == b.dtype == dtype
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (48, 64), (300, 896)])
def test_qwen3_5_norms_are_hf_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Qwen3.5's zero-centred norm (``1 + weight``) and its gated norm (``weight * norm(x) * silu(z)``)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from llm_service.models.qwen3_5 import GatedRMSNorm, ZeroCenteredRMSNorm

    g = torch.Generator().manual_seed(shape[0])
    x, z = ((torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g)
    pairs = [
        (ZeroCenteredRMSNorm(shape[-1], 1e-6), Qwen3_5RMSNorm(shape[-1], eps=1e-6)),
        (GatedRMSNorm(shape[-1], 1e-6), Qwen3_5RMSNormGated(shape[-1], eps=1e-6)),
    ]
    for ours, hf in pairs:
        with torch.no_grad():
            ours.weight.copy_(w)
            hf.weight.copy_(w)
        ours, hf = ours.to(dtype), hf.to(dtype)
        args = (x,) if isinstance(ours, ZeroCenteredRMSNorm) else (x, z)
        with torch.no_grad():
            a, b = ours(*args), hf(*args)
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), type(ours).__name__
