"""The sampler's CPU cost per step: ``python -m cluster.bench.sampler``.

A batch of 32 rows (and other sizes) at a vocabulary of the tiny models (1024) and of a real Qwen
checkpoint (151,936): all greedy, all random (temperature + top-p), and the mixed batch apps send
(greedy, seeded, top-k/top-p/min-p, penalties over a 64-token history, logit_bias, min_tokens, a
grammar mask on a quarter of the rows). Prints CPU-ms per step (``time.thread_time``, one torch
thread as the engine runs on CPU) and each against all-greedy. The engine step around it (the model's
forward) is not included: ``--engine`` adds a decode step of the tiny model at the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from llm_service.logits_processors import GrammarMasks
from llm_service.sampler import sample
from llm_service.sampling_params import SamplingParams


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset({0})


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=40, min_p=0.05),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(temperature=0.6, logit_bias=((5, 2.0), (9, -5.0))),
        SamplingParams(min_tokens=100, max_tokens=200),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def _time(fn: Callable[[], object], steps: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(steps):
        t = time.thread_time()
        fn()
        samples.append(time.thread_time() - t)
    return statistics.median(samples) * 1e3


def bench(batch: int, vocab: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    rows = [Row(list(range(i, i + 200)), list(range(i, i + 64))) for i in range(batch)]
    shared = torch.Generator().manual_seed(0)  # the engine's default generator: the unseeded rows'
    words = (vocab + 31) // 32
    masks = GrammarMasks(
        torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32), list(range(0, batch, 4))
    )
    cases: dict[str, tuple[list[SamplingParams], GrammarMasks | None]] = {
        "all greedy": ([SamplingParams()] * batch, None),
        "all random (T, top-p)": ([SamplingParams(temperature=0.8, top_p=0.9)] * batch, None),
        "mixed": (mixed_params(batch), None),
        "mixed + grammar (1/4 rows)": (mixed_params(batch), masks),
    }
    out: dict[str, float] = {}
    for name, (params, grammar) in cases.items():
        gens = [shared if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

        def step(
            params: list[SamplingParams] = params,
            grammar: GrammarMasks | None = grammar,
            gens: list[torch.Generator] = gens,
        ) -> object:
            return sample(logits, params, gens, rows, grammar)

        out[name] = _time(step, steps)
    return out


def engine_step_ms(model_dir: str, batch: int, params: list[SamplingParams], steps: int) -> float:
    """CPU-ms of one decode step of ``batch`` requests (the tiny model's forward and the sampler)."""
    from llm_service.config import EngineConfig
    from llm_service.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=batch, num_kv_blocks=1024))
    for i, p in enumerate(params):
        eng.add_request(
            f"r{i}",
            [(7 * i + j) % 900 + 20 for j in range(64)],
            replace(p, max_tokens=steps + 8, min_tokens=min(p.min_tokens, steps), ignore_eos=True),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # the prefills
    samples = []
    for _ in range(steps):
        t = time.thread_time()
        eng.step()
        samples.append(time.thread_time() - t)
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--engine", help="also time whole decode steps of this model directory (e.g. a tiny model)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.engine:
        print("| batch | engine decode step | CPU-ms / step | x all greedy |")
        print("|---:|---|---:|---:|")
        for b in args.batch:
            greedy = engine_step_ms(args.engine, b, [SamplingParams()] * b, args.steps)
            mixed = engine_step_ms(args.engine, b, mixed_params(b), args.steps)
            print(f"| {b} | all greedy | {greedy:.2f} | 1.00 |")
            print(f"| {b} | mixed | {mixed:.2f} | {mixed / greedy:.2f} |")
        print()
    print("| batch | vocab | case | CPU-ms / step | x all greedy |")
    print("|---:|---:|---|---:|---:|")
    for b in args.batch:
        for v in args.vocab:
            res = bench(b, v, args.steps)
            base = res["all greedy"]
            for name, ms in res.items():
                print(f"| {b} | {v} | {name} | {ms:.3f} | {ms / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
