"""What one request and its reply cost between two Serve replicas, by transport:
``python -m cluster.bench.transport``.

A caller replica sends ``--calls`` small requests (an LLM request spec's size: 120 prompt ids) to a
callee replica and awaits each reply, one at a time and 32 at a time, through:

- a Serve handle (with the transport settings `mmserve serve` runs, cluster/serve_env.py);
- the direct link (mmcore/link/direct_link.py) on ZeroMQ with CURVE (encrypted), the default;
- the direct link on ZeroMQ with PLAIN (authenticated, in clear: ``MMSERVE_LINK_ENCRYPT=0``);
- the link it replaced (length + pickle frames on asyncio streams, a token in clear), kept here
  only to compare against (``_OldLinkServer``, ``_OldLink``).

Every link body is ``frame_dumps`` (Ray's in-band cloudpickle), as in the app. It prints wall time
per call and CPU time per call summed over every process of the machine (read from /proc before and
after), which is the cost the app pays on a CPU box.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import pickle
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, cast

from cluster.bench.procs import list_procs
from cluster.serve_env import apply_serve_env

if TYPE_CHECKING:
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    from mmcore.link.frames import Dumps

SPEC = {"request_id": "x" * 36, "prompt_token_ids": list(range(120)), "max_tokens": 16, "temperature": 0.0}
TRANSPORTS = {
    "serve": "Serve handle (gRPC, `cluster/serve_env.py`)",
    "old": "old link (length + pickle on asyncio streams)",
    "plain": "ZeroMQ link, PLAIN (authenticated, in clear)",
    "curve": "ZeroMQ link, CURVE (encrypted; the default)",
}


OldHandler = Callable[..., Awaitable[object]]  # an async function, called with the call's arguments


class _Link(Protocol):
    async def call(self, method: str, *args: object) -> object: ...


class _OldLinkServer:
    """The replaced transport's server, as it was (token hello, then length + pickle frames)."""

    def __init__(self, handlers: dict[str, OldHandler], token: str, dumps: Dumps) -> None:
        self.handlers, self.token, self.dumps = handlers, token, dumps

    async def address(self, host: str) -> tuple[str, int]:
        if not hasattr(self, "_server"):
            self._server = await asyncio.start_server(self._serve, host, 0)
        return host, int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (size,) = struct.unpack("!H", await reader.readexactly(2))
        if not hmac.compare_digest(await reader.readexactly(size), self.token.encode()):
            writer.close()
            return
        with_tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                seq, method, args = await _old_read(reader)
                assert isinstance(method, str) and isinstance(args, tuple)  # what _OldLink.call sends
                task = asyncio.get_running_loop().create_task(self._run(writer, seq, method, args))
                with_tasks.add(task)
                task.add_done_callback(with_tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _run(
        self, writer: asyncio.StreamWriter, seq: int, method: str, args: tuple[object, ...]
    ) -> None:
        try:
            reply = (seq, True, await self.handlers[method](*args))
        except Exception as e:
            reply = (seq, False, e)
        body = self.dumps(reply)
        writer.write(struct.pack("!I", len(body)) + body)


async def _old_read(reader: asyncio.StreamReader) -> tuple[int, object, object]:
    """One frame: ``(seq, method, args)`` to the server, ``(seq, ok, value)`` back."""
    (size,) = struct.unpack("!I", await reader.readexactly(4))
    return cast("tuple[int, object, object]", pickle.loads(await reader.readexactly(size)))  # our peer's


class _OldLink:
    """The replaced transport's client: calls multiplexed by sequence number on one connection."""

    def __init__(self, locate: Callable[[], Awaitable[tuple[str, int]]], token: str, dumps: Dumps) -> None:
        self.locate, self.token, self.dumps = locate, token, dumps
        self.waiting: dict[int, asyncio.Future[object]] = {}
        self.seq = 0
        self.writer: asyncio.StreamWriter | None = None
        self.lock: asyncio.Lock | None = None

    async def call(self, method: str, *args: object) -> object:
        if self.writer is None:
            self.lock = self.lock or asyncio.Lock()
            async with self.lock:
                if self.writer is None:
                    host, port = await self.locate()
                    reader, writer = await asyncio.open_connection(host, port)
                    writer.write(struct.pack("!H", len(self.token)) + self.token.encode())
                    self.pump = asyncio.get_running_loop().create_task(self._read(reader))
                    self.writer = writer
        self.seq += 1
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.waiting[self.seq] = fut
        body = self.dumps((self.seq, method, args))
        self.writer.write(struct.pack("!I", len(body)) + body)
        return await fut

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            seq, ok, value = await _old_read(reader)
            fut = self.waiting.pop(seq)
            if ok:
                fut.set_result(value)
            else:
                assert isinstance(value, BaseException)  # what the server's handler raised
                fut.set_exception(value)


def machine_cpu_s() -> float:
    """User + system CPU seconds of every process now alive (kernel threads aside)."""
    return sum(p.cpu_s for p in list_procs().values())


def build(num_cpus: float, plain_keys: bytes, token: str) -> serve.Application:
    from ray import serve

    from cluster.replica_links import DirectServed
    from mmcore.link.direct_link import LinkKeys, LinkServer
    from mmcore.link.on_ray import frame_dumps

    class Callee(DirectServed):
        DIRECT_METHODS = {"submit": "submit"}  # noqa: RUF012

        def __init__(self) -> None:
            from cluster.bench.transport import _OldLinkServer  # by reference, not pickled by value

            self.plain = LinkServer(
                {"submit": self.submit}, LinkKeys.from_bytes(plain_keys), dumps=frame_dumps
            )
            self.old = _OldLinkServer({"submit": self.submit}, token, frame_dumps)

        async def submit(self, spec: dict[str, object]) -> dict[str, object]:
            return {"request_id": spec["request_id"], "channel_id": "c"}

        async def address(self, which: str) -> tuple[str, int]:
            import ray

            return await getattr(self, which).address(ray.util.get_node_ip_address())

    class Caller:
        def __init__(self, callee: DeploymentHandle) -> None:
            from cluster.bench.transport import _OldLink
            from cluster.replica_links import direct_link
            from mmcore.link.direct_link import DirectLink

            self.callee = callee
            self.links: dict[str, _Link] = {
                "curve": direct_link(callee),  # the cluster's keys: CURVE unless MMSERVE_LINK_ENCRYPT=0
                "plain": DirectLink(lambda: self._at("plain"), LinkKeys.from_bytes(plain_keys), frame_dumps),
                "old": _OldLink(lambda: self._at("old"), token, frame_dumps),
            }

        async def _at(self, which: str) -> tuple[str, int]:
            host, port = await self.callee.address.remote(which)
            return str(host), int(port)

        async def run(self, transport: str, calls: int, concurrency: int) -> float:
            async def one(i: int) -> None:
                spec = dict(SPEC, request_id=f"{i:036d}")
                if transport == "serve":
                    await self.callee.submit.remote(spec)
                else:
                    await self.links[transport].call("submit", spec)

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


async def measure(handle: DeploymentHandle, calls: int, rounds: int) -> list[tuple[str, int, float, float]]:
    rows = []
    for transport in TRANSPORTS:
        await handle.run.remote(transport, 100, 8)  # connect, warm up
    for _ in range(rounds):
        for transport in TRANSPORTS:
            for concurrency in (1, 32):
                before = machine_cpu_s()
                wall = await handle.run.remote(transport, calls, concurrency)
                cpu = machine_cpu_s() - before
                rows.append((transport, concurrency, 1000 * wall / calls, 1000 * cpu / calls))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.transport", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=600, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-cpus", type=int, default=2, help="the local Ray's CPUs")
    args = p.parse_args(argv)
    apply_serve_env()
    import secrets

    import ray
    from ray import serve

    from mmcore.link.direct_link import LinkKeys

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, namespace="mmserve-bench")
    plain_keys = LinkKeys.generate(encrypt=False).to_bytes()

    async def go() -> list[tuple[str, int, float, float]]:
        # Serve and its handles live on this loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0).
        try:
            app = build(0.1, plain_keys, secrets.token_urlsafe(32))
            handle = serve.run(app, name="bench-transport", route_prefix=None)
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
        print(f"| {TRANSPORTS[transport]} | {concurrency} | {wall_ms:.3f} | {cpu_ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
