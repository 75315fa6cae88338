"""A finished request's last output says where its time in the engine went (queue, prefill,
decode: the LLM pool's stage metrics); no other output carries it, and it never crosses the wire."""

from __future__ import annotations

import pickle
from pathlib import Path

from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams


def test_timing_on_last_output_only_and_a_queued_request_waits_out_the_running_one(
    tiny_vl_dir: Path,
) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_vl_dir), block_size=4, num_kv_blocks=64, max_num_seqs=1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.add_request("a", [5, 6, 7, 8, 9], params)
    eng.add_request("b", [9, 8, 7], params)  # max_num_seqs=1: admitted only once "a" is done
    outs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs[out.request_id].append(out)
    for rid in ("a", "b"):
        *early, last = outs[rid]
        assert len(early) == 2 and all(o.timing is None for o in early)
        t = last.timing
        assert last.finished and t is not None
        assert t.queue >= 0 and t.prefill >= 0 and t.decode >= 0
        assert pickle.loads(pickle.dumps(last)).timing is None  # stays on the replica
    a, b = outs["a"][-1].timing, outs["b"][-1].timing
    assert a is not None and b is not None
    # "b" entered the engine before "a" was scheduled and left the queue only after "a" finished
    assert b.queue >= a.prefill + a.decode
