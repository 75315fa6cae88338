"""E/P/D's journey without Ray, the pieces its tests share: a real prefill ``LLMServer`` and real decode
ones (``server``), each with a real engine on a tiny model; Serve's handles as shims calling the servers
(``PrefillHandle``, ``DecodeHandle``, ``TwoDecodeHandle``), the direct link a shim calling the prefill
server's ``pull_kv`` (``FlakyLink``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import HandoffWiring, LLMServer
from router.journey.pd_client import PDClient
from tests.unit.router.journey.test_llm_client import FakeLLMHandle

PROMPT = [(7 * i + 3) % 150 + 10 for i in range(37)]  # 37 tokens: 9 full blocks of 4 and a partial one
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
STEP_S = 0.2  # kv_pull_chunks tests: a prefill step takes this much more (a larger model's), so the
# decode replica's pulls, a few event-loop hops each, land between the chunks even on a loaded host


class ActorDiedError(RuntimeError):
    """Named as Ray's: ``replica_gone`` matches it by name."""


class FlakyLink:
    """The decode replica's link to the prefill replica: ``pull_kv`` on it, failing ``fail`` times first."""

    def __init__(self, prefill: LLMServer, fail: int = 0) -> None:
        self.prefill, self.fail, self.calls = prefill, fail, 0

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        assert method in ("pull_kv", "pull_kv_chunks")
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("link lost mid-pull")
        return await getattr(self.prefill, method)(*args)


class PrefillHandle:
    """``prefill.remote(spec)``, whose first ``lose`` calls find the replica dead."""

    def __init__(self, server: LLMServer, lose: int = 0) -> None:
        self.server, self.lose, self.calls = server, lose, 0

    @property
    def prefill(self) -> Any:
        async def call(spec: LLMRequestSpec) -> Any:
            self.calls += 1
            if self.lose:
                self.lose -= 1
                raise ActorDiedError("the prefill replica died")
            return await self.server.prefill(spec)

        return SimpleNamespace(remote=call)

    @property
    def stats(self) -> Any:
        async def call(target: Any) -> Any:
            return self.server.stats(target)

        return SimpleNamespace(remote=call)

    @property
    def abort(self) -> Any:
        return SimpleNamespace(remote=self.server.abort)


class DecodeHandle(FakeLLMHandle):
    """The decode pool's handle, its ``stats`` too."""

    @property
    def stats(self) -> Any:
        async def call(target: Any) -> Any:
            return self.server.stats(target)

        return SimpleNamespace(remote=call)


def make_server(
    model_dir: Path,
    role: str,
    link: Any = None,
    deadline_s: float = 30.0,
    pull_chunks: bool = False,
    num_kv_blocks: int = 64,
) -> LLMServer:
    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 1)

    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16
    )
    wiring = HandoffWiring(
        address, lambda _: link, deadline_s=deadline_s, timeout_s=5.0, pull_chunks=pull_chunks
    )
    return LLMServer(config, "tiny", role=role, handoff=None if role == "both" else wiring)


async def tokens(client: PDClient, rid: str) -> list[int]:
    spec = LLMRequestSpec(rid, list(PROMPT), PARAMS)
    out: list[int] = []
    async for o in client.stream(spec):
        out += o.new_token_ids
    return out


class TwoDecodeHandle(FakeLLMHandle):
    """Two decode replicas behind one handle, routed as ``FreeKVRouter`` routes a hand-off: the first
    one that has not refused it (``KVHandoff.refused_by``), else the first."""

    def __init__(self, first: LLMServer, second: LLMServer) -> None:
        super().__init__(first)
        self.replicas = [first, second]
        self.asked: list[str] = []

    @property
    def submit(self) -> Any:
        def route(spec: LLMRequestSpec) -> Any:
            refused = spec.handoff.refused_by if spec.handoff is not None else ()
            self.server = next((s for s in self.replicas if s.replica_id not in refused), self.replicas[0])
            self.asked.append(self.server.replica_id)
            return super(TwoDecodeHandle, self).submit.remote(spec)

        return SimpleNamespace(remote=route)


def slow_steps(server: LLMServer) -> Any:
    """``server``'s engine, each step ``STEP_S`` slower (a larger model's step time); returns the engine."""
    engine: Any = server.engine
    step = engine.step

    def slow_step() -> Any:
        time.sleep(STEP_S)
        return step()

    engine.step = slow_step
    return engine


def colocated_tokens(model_dir: Path) -> list[int]:
    """``PROMPT``'s greedy tokens from one ``both`` server: what every E/P/D journey must equal."""

    async def run() -> list[int]:
        out: list[int] = []
        async for o in make_server(model_dir, "both").loop.stream("c", list(PROMPT), PARAMS, []):
            out += o.new_token_ids
        return out

    return asyncio.run(run())
