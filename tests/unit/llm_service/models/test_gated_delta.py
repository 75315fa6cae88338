"""Gated DeltaNet's kernels (``llm_service/models/gated_delta.py``) against transformers' reference
functions for Qwen3.5: the chunked rule (short chunks unpadded, several 64-token blocks, a saved
state to start from), the states it reads at cut points inside its blocks (against HF's rule run on
the prefix up to the cut), and the tap-sum causal conv against HF's conv1d path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from llm_service.models.gated_delta import causal_conv, chunk_rule, l2norm

H, DK, DV = 4, 16, 8


def inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(H, n, DK, generator=gen)) for _ in range(2))
    v = torch.randn(H, n, DV, generator=gen)
    g = -F.softplus(torch.randn(H, n, generator=gen))  # log decays, as the layer makes them
    beta = torch.rand(H, n, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.1
    return q, k, v, g, beta, state


def hf_rule(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """HF's chunked rule on one sequence (it scales q itself and takes ``[B, L, H, d]``)."""
    out, final = hf.torch_chunk_gated_delta_rule(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        g.t()[None],
        beta.t()[None],
        initial_state=state[None],
        output_final_state=True,
    )
    return out[0].transpose(0, 1), final[0]


@pytest.mark.parametrize("n", [1, 5, 48, 64, 65, 130])
def test_chunk_rule_equals_hf(n: int) -> None:
    q, k, v, g, beta, state = inputs(n, seed=n)
    out, final, _ = chunk_rule(q * DK**-0.5, k, v, g, beta, state)
    ref_out, ref_final = hf_rule(q, k, v, g, beta, state)
    assert out.shape == (H, n, DV)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("n", "cuts"), [(48, [1, 16, 47]), (130, [16, 64, 65, 100, 128])])
def test_states_at_cuts_equal_the_rule_run_to_the_cut(n: int, cuts: list[int]) -> None:
    q, k, v, g, beta, state = inputs(n, seed=7)
    out, final, at_cuts = chunk_rule(q * DK**-0.5, k, v, g, beta, state, cuts)
    assert len(at_cuts) == len(cuts)
    for cut, got in zip(cuts, at_cuts, strict=True):
        part = slice(0, cut)
        _, want = hf_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # reading states at cuts leaves the outputs and the final state as they are
    out_plain, final_plain, _ = chunk_rule(q * DK**-0.5, k, v, g, beta, state)
    assert torch.equal(out, out_plain) and torch.equal(final, final_plain)


@pytest.mark.parametrize("n", [1, 3, 40])
def test_causal_conv_equals_hf_conv1d(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    channels, kernel = 24, 4
    x = torch.randn(n, channels, generator=gen)
    state = torch.randn(channels, kernel - 1, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    out, full = causal_conv(x, state, weight)
    # HF pads with zeros on the left; prepending the state instead is the cached continuation
    ref = hf.causal_conv1d_fn(full[None], weight, activation="silu")[0, :, kernel - 1 :]
    torch.testing.assert_close(out, ref.t(), atol=1e-6, rtol=1e-5)
    assert torch.equal(full[:, n:], torch.cat([state, x.t()], dim=1)[:, -(kernel - 1) :])
