"""What one request and its reply cost between two Serve replicas, by transport:
``python -m cluster.bench_transport``.

A caller replica sends ``--calls`` small requests (an LLM request spec's size: 120 prompt ids) to a
callee replica and awaits each reply, one at a time and 32 at a time, through a Serve handle (with the
transport settings `mmserve serve` runs, cluster/serve_env.py) and through a direct link
(router/direct_link.py). It prints wall time per call and CPU time per call summed over every process
of the machine (read from /proc before and after), which is the cost the app pays on a CPU box.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from cluster.bench_procs import list_procs
from cluster.serve_env import apply_serve_env

SPEC = {"request_id": "x" * 36, "prompt_token_ids": list(range(120)), "max_tokens": 16, "temperature": 0.0}


def machine_cpu_s() -> float:
    """User + system CPU seconds of every process now alive (kernel threads aside)."""
    return sum(p.cpu_s for p in list_procs().values())


def build(num_cpus: float) -> Any:
    from ray import serve

    from cluster.direct_served import DirectServed

    class Callee(DirectServed):
        DIRECT_METHODS = {"submit": "submit"}  # noqa: RUF012

        async def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
            return {"request_id": spec["request_id"], "channel_id": "c"}

    class Caller:
        def __init__(self, callee: Any) -> None:
            from cluster.direct_served import direct_link

            self.callee = callee
            self.link = direct_link(callee)

        async def run(self, transport: str, calls: int, concurrency: int) -> float:
            async def one(i: int) -> None:
                spec = dict(SPEC, request_id=f"{i:036d}")
                if transport == "serve":
                    await self.callee.submit.remote(spec)
                else:
                    await self.link.call("submit", spec)

            gate = asyncio.Semaphore(concurrency)

            async def gated(i: int) -> None:
                async with gate:
                    await one(i)

            start = time.perf_counter()
            await asyncio.gather(*(gated(i) for i in range(calls)))
            return time.perf_counter() - start

    opts = {"ray_actor_options": {"num_cpus": num_cpus}}
    callee = serve.deployment(Callee).options(**opts).bind()
    return serve.deployment(Caller).options(**opts).bind(callee)


async def measure(handle: Any, calls: int, rounds: int) -> list[tuple[str, int, float, float]]:
    rows = []
    for transport in ("serve", "direct"):
        await handle.run.remote(transport, 100, 8)  # connect, warm up
    for _ in range(rounds):
        for transport in ("serve", "direct"):
            for concurrency in (1, 32):
                before = machine_cpu_s()
                wall = await handle.run.remote(transport, calls, concurrency)
                cpu = machine_cpu_s() - before
                rows.append((transport, concurrency, 1000 * wall / calls, 1000 * cpu / calls))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench_transport", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=600, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-cpus", type=int, default=2, help="the local Ray's CPUs")
    args = p.parse_args(argv)
    apply_serve_env()
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, namespace="mmserve-bench")

    async def go() -> list[tuple[str, int, float, float]]:
        # Serve and its handles live on this loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0).
        try:
            handle = serve.run(build(0.1), name="bench-transport", route_prefix=None)
            return await measure(handle, args.calls, args.rounds)
        finally:
            await serve.shutdown_async()

    try:
        rows = asyncio.run(go())
    finally:
        ray.shutdown()
    print("| transport | concurrency | wall ms per call | CPU-ms per call (all processes) |")
    print("| :--- | ---: | ---: | ---: |")
    for transport, concurrency, wall_ms, cpu_ms in rows:
        name = "Serve handle" if transport == "serve" else "direct link"
        print(f"| {name} | {concurrency} | {wall_ms:.3f} | {cpu_ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
