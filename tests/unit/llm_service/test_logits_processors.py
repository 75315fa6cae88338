"""The sampler's processors against transformers' own logits processors (or a hand-computed case
where transformers has none), and the batched sampler's guarantees: greedy rows are the raw argmax,
seeded rows do not depend on the batch around them, random rows sample from the right distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    MinLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from llm_service.logits_processors import GrammarMasks, process_logits
from llm_service.output_counts import OutputCounts
from llm_service.sampler import NoAllowedToken, SamplerState, _filter, sample
from llm_service.sampling_batch import SamplingBatch
from llm_service.sampling_params import SamplingParams

V = 64


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset({0})


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers_over_prompt_and_output() -> None:
    logits, row = _logits(1), Row([3, 5, 5, 9], [9, 17, 40])
    got = process_logits(logits, [SamplingParams(repetition_penalty=1.3)], [row])
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_min_tokens_equals_transformers_min_length() -> None:
    logits, row = _logits(1), Row([3, 4], [7, 8], frozenset({0, 5}))
    got = process_logits(logits, [SamplingParams(min_tokens=3, max_tokens=8)], [row])
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    want = MinLengthLogitsProcessor(len(row.prompt_token_ids) + 3, [0, 5])(ids, logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    done = Row([3, 4], [7, 8, 9], frozenset({0, 5}))  # three generated: the stop tokens are back
    assert torch.equal(process_logits(logits, [SamplingParams(min_tokens=3, max_tokens=8)], [done]), logits)


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(1)
    bias = {(4,): 5.0, (10,): -100.0, (63,): 0.5}
    got = process_logits(
        logits, [SamplingParams(logit_bias=tuple((k[0], v) for k, v in bias.items()))], [Row([1])]
    )
    want = SequenceBiasLogitsProcessor(bias)(torch.tensor([[1]]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits, row = _logits(1), Row([7, 7, 7], [2, 2, 2, 11])
    got = process_logits(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [row])
    want = logits.clone()
    want[0, 2] -= 0.5 + 3 * 0.25
    want[0, 11] -= 0.5 + 0.25
    torch.testing.assert_close(got, want)  # token 7 (prompt only) untouched


def test_min_p_equals_transformers_after_temperature() -> None:
    logits = _logits(3)
    params = [SamplingParams(temperature=0.7, min_p=p) for p in (0.05, 0.2, 0.0)]
    scaled = (logits - logits.amax(-1, keepdim=True)) / 0.7
    got = _filter(scaled, params)
    for i, p in enumerate((0.05, 0.2)):
        hf = MinPLogitsWarper(p)(
            torch.zeros(1, 1), TemperatureLogitsWarper(0.7)(None, logits[i : i + 1].clone())
        )
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(hf[0]))
    assert torch.isfinite(got[2]).all()


def test_rows_mixed_in_one_batch_get_only_their_own_processors() -> None:
    logits = _logits(4)
    rows = [Row([1, 2], [3]), Row([4], [4, 4]), Row([5]), Row([6], [7])]
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(),
        SamplingParams(logit_bias=((9, 3.0),)),
    ]
    got = process_logits(logits, params, rows)
    for i in range(4):
        alone = process_logits(logits[i : i + 1], [params[i]], [rows[i]])
        torch.testing.assert_close(got[i : i + 1], alone, rtol=0, atol=0)
    assert torch.equal(got[2], logits[2])


def test_greedy_rows_are_the_raw_argmax_bit_for_bit_beside_processed_rows() -> None:
    logits = _logits(6)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1, seed=1)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    rows = [Row([1])] * 6
    tokens, _ = sample(logits, params, gens, rows)
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_a_seeded_row_samples_the_same_whatever_the_batch() -> None:
    logits = _logits(5)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=5)
    alone, _ = sample(logits[2:3], [seeded], [torch.Generator().manual_seed(5)], [Row([1])])
    shared = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0)] * 2 + [seeded] + [SamplingParams(temperature=0.5)] * 2
    gens = [shared, shared, torch.Generator().manual_seed(5), shared, shared]
    batch, _ = sample(logits, params, gens, [Row([1])] * 5)
    assert batch[2] == alone[0]


def test_random_rows_sample_from_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 4000
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits.expand(4000, V), params, [gen] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).float() / 4000
    # top_p=0.9 keeps {0, 1, 2} (mass before token 3 is 0.95 >= 0.9): renormalised 0.5/0.95 ...
    torch.testing.assert_close(counts[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03, rtol=0)
    assert counts[3:].sum() == 0


def test_a_grammar_mask_leaves_only_allowed_tokens_and_an_empty_one_is_named() -> None:
    logits = _logits(2)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 3  # only token 35
    tokens, _ = sample(
        logits, [SamplingParams()] * 2, [torch.Generator()] * 2, None, GrammarMasks(bitmask, [1])
    )
    assert tokens == [int(logits[0].argmax()), 35]
    bitmask[1, 1] = 0
    with pytest.raises(NoAllowedToken) as e:
        sample(logits, [SamplingParams()] * 2, [torch.Generator()] * 2, None, GrammarMasks(bitmask, [1]))
    assert e.value.rows == [1]


def test_min_tokens_yields_to_a_grammar_that_allows_only_a_stop_token() -> None:
    logits = _logits(1)
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    bitmask[0, 0] = 1  # only token 0, the stop token
    params = [SamplingParams(min_tokens=5, max_tokens=9)]
    tokens, _ = sample(logits, params, [torch.Generator()], [Row([1])], GrammarMasks(bitmask, [0]))
    assert tokens == [0]


def _full_sort_top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, sorted whole (the sampler's rows before its partial sort)."""
    sorted_x, order = torch.sort(x, descending=True, dim=-1)
    probs = sorted_x.softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop[:, 0] = False
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


@pytest.mark.parametrize(
    "scale", [8.0, 0.01], ids=["peaked: nucleus in the candidates", "flat: sorted whole"]
)
def test_top_p_over_a_large_vocabulary_keeps_the_same_nucleus_as_a_full_sort(scale) -> None:
    x = torch.randn(6, 20_000, generator=torch.Generator().manual_seed(1)) * scale
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.5, 0.9, 0.95, 0.99, 0.3, 0.999)]
    got = _filter(x, params)
    for i, p in enumerate(params):
        want = _full_sort_top_p(x[i : i + 1], p.top_p)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want[0])), p.top_p


@pytest.mark.parametrize("rounds", [8, 1], ids=["by rejection", "rounds spent: sorted nucleus"])
def test_top_p_by_rejection_samples_the_renormalised_nucleus(monkeypatch, rounds) -> None:
    """Nucleus {0, 1} (the mass before token 2 is 0.7 >= 0.5): a first draw of 2 or 3 (p = 0.3) is
    rejected and drawn again among the tokens more likely than it; with one round those rows take the
    sorted nucleus. Either way the tokens follow 0.4 / 0.7, 0.3 / 0.7, and ties at the edge are kept."""
    monkeypatch.setattr("llm_service.draw.TOP_P_ROUNDS", rounds)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 6000
    tokens, _ = sample(logits.expand(6000, V), params, [torch.Generator().manual_seed(1)] * 6000)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).float() / 6000
    torch.testing.assert_close(counts[:2], torch.tensor([0.4, 0.3]) / 0.7, atol=0.025, rtol=0)
    assert counts[2:].sum() == 0
    tie = torch.log(torch.tensor([[0.3, 0.3, 0.3, 0.1] + [1e-9] * (V - 4)]))
    tied, _ = sample(tie.expand(3000, V), params[:3000], [torch.Generator().manual_seed(2)] * 3000)
    assert set(tied) == {0, 1, 2} if rounds > 1 else set(tied) <= {0, 1, 2}


def test_counts_kept_across_steps_equal_a_recount_from_the_whole_history() -> None:
    """The engine's path (``SamplerState``: counts added token by token, a slot per request id) gives
    the same logits as counting each row's whole output afresh, through new tokens, a request whose
    output was reset, and a released id whose slot another request takes."""
    state = SamplerState()
    params = [
        SamplingParams(repetition_penalty=1.4),
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(),
    ]
    rows = [Row([1, 2], [3]), Row([4], [4, 5]), Row([6])]
    keys = ["a", "b", "c"]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for step in range(6):
        logits = _logits(3, seed=step)
        batch = SamplingBatch.reuse(state.batch, params, V, logits.device)
        counts = state.counts or OutputCounts(V, logits.device)
        state.counts = counts
        kept = process_logits(logits, params, rows, None, batch, counts, keys)
        torch.testing.assert_close(kept, process_logits(logits, params, rows), rtol=0, atol=0)
        tokens, _ = sample(logits, params, gens, rows, None, state, keys)
        for row, t in zip(rows, tokens, strict=True):
            row.output_token_ids.append(t)
        if step == 2:
            rows[1].output_token_ids = [9]  # reset: shorter than what was counted
        if step == 3:
            state.release("a")
            keys[0], rows[0] = "d", Row([7], [8, 8])
    assert state.batch is SamplingBatch.reuse(state.batch, params, V, torch.device("cpu"))
    assert state.batch is not SamplingBatch.reuse(
        state.batch, [*params[:2], SamplingParams()], V, torch.device("cpu")
    )


def test_a_bitmask_allows_exactly_its_set_bits_on_every_row_or_some() -> None:
    """Token ``t`` is allowed by bit ``t % 32`` of word ``t // 32`` (xgrammar's layout), checked bit
    by bit against the words, at a vocabulary that ends inside a word."""
    vocab, words = 1000, 32
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=torch.Generator().manual_seed(3)
    )
    want = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]
    )
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    every = process_logits(logits, [SamplingParams()] * 3, None, GrammarMasks(bitmask, [0, 1, 2]))
    assert torch.equal(torch.isfinite(every), want)
    assert torch.equal(every[want], logits[want])
    some = process_logits(logits, [SamplingParams()] * 3, None, GrammarMasks(bitmask, [2, 0]))
    assert torch.equal(some[[0, 2]], every[[0, 2]]) and torch.equal(some[1], logits[1])
