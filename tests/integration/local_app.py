"""A module's Ray (the session's shared one, or a cluster of the module's own), ended however the
module ends, and the whole app started on it as `mmserve serve` would, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from openai import OpenAI


def free_port() -> int:
    """A loopback port nothing listens on, outside Ray's worker ports and the kernel's ephemeral range
    (``cluster.bench.local_cluster.free_port``, which the benchmark's clusters use too). A port the kernel
    handed out (bind to 0) is from the range Ray's processes draw from while the app starts: once one
    of them took it before the ingress bound it (EADDRINUSE, the module's start failed)."""
    from cluster.bench.local_cluster import free_port as free_loopback_port

    return free_loopback_port()


def seed_tiny_models(config: dict[str, Any]) -> None:
    """Each ``tiny:`` model of an AppConfig dict copied into its ``models_cache_dir`` from this test
    process's own (tests/tiny_dirs.py, made once per process), where cluster/model_dirs.py would have
    the first replica generate it: the bytes are the same (the generator is deterministic), but then no
    replica imports the generator (transformers' modeling modules; at most ~1 CPU-s over what a replica
    imports anyway) nor makes the model's other replicas wait on its lock while it writes. The apps of tests/integration/e2e/, test_deploy_cli.py and
    test_graceful_drain.py still generate theirs on their replicas."""
    import shutil
    from pathlib import Path

    from tests.tiny_dirs import tiny_model_dir

    root = Path(str(config.get("models_cache_dir", "~/.cache/mmserve/models"))).expanduser()
    for model in config.get("models", []):
        target = root / f"tiny-{model.get('tiny')}"
        if model.get("tiny") and not model.get("path") and not (target / "model.safetensors").exists():
            shutil.copytree(tiny_model_dir(model["tiny"]), target, dirs_exist_ok=True)


_INIT_TRIES = 3


def _children() -> set[int]:
    from cluster.bench.procs import descendants, list_procs

    return descendants(list_procs(), os.getpid())


def _init_ray(address: str, init: dict[str, Any]) -> None:
    """``ray.init``, again where a busy host missed Ray's fixed 30 s wait for the raylet to register
    (chaos_node.start_head and LocalRayCluster.start_head try again too): what a failed try started
    is ended first."""
    import ray

    for attempt in range(1, _INIT_TRIES + 1):
        before = _children()
        try:
            ray.init(address=address, **{"namespace": "mmserve", **init})
            return
        except Exception as e:
            ray.shutdown()
            for pid in _children() - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if address != "local" or "timed out during startup" not in str(e) or attempt == _INIT_TRIES:
                raise


# The session's one local Ray (docs/testing.md, "One Ray per session"): every module whose own_ray is a
# plain local one (no settings but ``num_cpus`` and ``log_to_driver``) runs on it, one after the other;
# a module's Serve apps, actors and placement groups end with the module. SESSION_CPUS logical CPUs,
# the most any module asks for; a module that asks for fewer gets the rest held by an idle actor.
SESSION_CPUS = 4
_SHAREABLE = {"num_cpus", "log_to_driver"}
_SESSION: dict[str, Any] = {}  # "open": the session Ray runs; "cleaned": what modules left behind


def session_ray_open() -> bool:
    import ray

    if _SESSION.get("open") and not ray.is_initialized():
        _SESSION.pop("open")  # a module shut it down itself: the next one starts it again
    return bool(_SESSION.get("open"))


def close_session_ray() -> None:
    """The session Ray (and a shared app on it) ended, before a module that starts its own cluster,
    and at the end of the integration tests."""
    close_shared_app()
    if session_ray_open():
        import ray
        from ray import serve

        _SESSION.pop("open")
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def session_ray_cleanups() -> list[str]:
    """What modules left running on the session Ray, which their end removed: one line each."""
    return list(_SESSION.get("cleaned", []))


@contextmanager
def _session_ray(num_cpus: int) -> Iterator[None]:
    import ray

    from cluster.serve_env import apply_serve_env

    close_shared_app()
    if not session_ray_open():
        if ray.is_initialized():
            ray.shutdown()  # a Ray no module owns (``ray.put`` starts one): not this session's
        apply_serve_env()  # every module on it runs with `mmserve serve`'s Serve settings
        _init_ray("local", {"num_cpus": SESSION_CPUS, "include_dashboard": False})
        _SESSION["open"] = True
    holder = _hold_cpus(SESSION_CPUS - num_cpus)
    module = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]  # the one that started it
    try:
        yield
    finally:
        _end_module(holder, module)


def _hold_cpus(cpus: float) -> Any:
    """An idle actor holding ``cpus`` of the session's logical CPUs: the module sees the budget it
    asked for (an actor, not a placement group: test_encoder_tp checks that every group is removed)."""
    import ray

    if cpus <= 0:
        return None

    @ray.remote(num_cpus=cpus)
    class HeldCPUs:
        def ready(self) -> bool:
            return True

    holder = HeldCPUs.remote()  # type: ignore[attr-defined]
    ray.get(holder.ready.remote(), timeout=120)
    return holder


def _end_module(holder: Any, module: str) -> None:
    """Serve shut down; the holder and whatever else the module left (actors, placement groups) ended
    and waited for, each named in the session's cleanups. A cleanup that fails ends the session Ray:
    the next module starts a fresh one."""
    import gc

    import ray
    from ray import serve
    from ray._private.state import state
    from ray._private.worker import global_worker
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if not session_ray_open():
        return

    def cleaned(what: str) -> None:
        _SESSION.setdefault("cleaned", []).append(f"{module}: {what}")

    try:
        serve.shutdown()
        if holder is not None:
            ray.kill(holder)
        gone = {holder._actor_id.hex()} if holder is not None else set()
        for actor_id, a in state.actor_table(None).items():
            if a["State"] != "DEAD" and actor_id not in gone:
                cleaned(f"actor {a['ActorClassName']} {a['Name']!r}")
                _kill(actor_id)
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg["state"] != "REMOVED":
                cleaned(f"placement group {pg['name']!r} {pg['state']}")
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
        _wait_all_dead(state)
        gc.collect()
        held = global_worker.core_worker.get_all_reference_counts()
        if held:  # in the object store until their holders (module globals?) let them go: named only
            cleaned(f"{len(held)} object references the test process still holds (not freed)")
    except Exception as e:
        cleaned(f"cleanup failed ({e!r}): the session Ray restarted")
        _SESSION.pop("open", None)
        ray.shutdown()


def _kill(actor_id: str) -> None:
    """``ray.kill`` of an actor by its id (an unnamed actor the module dropped its handle to)."""
    import ray
    from ray._private.worker import global_worker

    global_worker.core_worker.kill_actor(ray.ActorID(bytes.fromhex(actor_id)), True)


def _wait_all_dead(state: Any, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while any(a["State"] != "DEAD" for a in state.actor_table(None).values()):
        if time.monotonic() > deadline:
            raise TimeoutError("actors still alive after the module's end")
        time.sleep(0.1)


@contextmanager
def own_ray(address: str = "local", **init: Any) -> Iterator[None]:
    """Ray for one test module, ended however the module ends, also when the start fails or Serve's
    shutdown raises (the next module's ``ray.init`` then does not fail with "called ray.init twice").
    A plain local one (``num_cpus``, ``log_to_driver`` at most) is the session's shared Ray, its
    Serve and actors ended after the module; any other (another address, other settings) is the
    module's own, started after the session Ray is ended."""
    import ray
    from ray import serve

    if address == "local" and set(init) <= _SHAREABLE:
        with _session_ray(int(init.get("num_cpus", 2))):
            yield
        return
    close_session_ray()  # one Ray per process: the session's ends here (a shared app on it too)
    if address == "local":
        init = {"num_cpus": 2, "include_dashboard": False, **init}
    _init_ray(address, init)
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


TEST_SHUTDOWN_WAIT_LOOP_S = 0.1


@contextmanager
def shutdown_wait_loop(seconds: float | None = TEST_SHUTDOWN_WAIT_LOOP_S) -> Iterator[None]:
    """Serve's ``graceful_shutdown_wait_loop_s`` for the deployments built inside: the driver makes
    each deployment's config (``serve.run`` of ``build_app``), from ``DeploymentConfig``'s defaults.
    A stopping replica sleeps this long before it first counts its in-flight requests (then again
    every this long). Serve stops an app's deployments group by group (the ingress, then the pools,
    then the cache index), each group after its wait: Serve's 2 s made a module's teardown ~9 s of
    mostly sleeping, 0.1 s ~4 s. ``None``: Serve's default (a module that scales a pool down under
    load keeps it: routers learn of a stopping replica during that wait)."""
    from ray.serve._private.config import DeploymentConfig

    if seconds is None:
        yield
        return
    field = DeploymentConfig.model_fields["graceful_shutdown_wait_loop_s"]
    default = field.default
    field.default = seconds
    DeploymentConfig.model_rebuild(force=True)
    try:
        yield
    finally:
        field.default = default
        DeploymentConfig.model_rebuild(force=True)


@contextmanager
def local_app(
    config: dict[str, Any], num_cpus: int = 2, shutdown_wait_loop_s: float | None = TEST_SHUTDOWN_WAIT_LOOP_S
) -> Iterator[OpenAI]:
    """``config`` (an AppConfig dict without port; its ``ingress`` settings kept, but HTTP direct)
    served on a free port, on the session's Ray (``own_ray``); yields its client, and ends the app on
    the way out. ``num_cpus``: Ray's
    logical CPUs (a scheduling budget: an app of many models' fractional replicas needs more than
    the machine's 2, although they mostly idle; short of it, a replica waits to be scheduled forever
    and the requests routed to it hang). ``shutdown_wait_loop_s``: ``shutdown_wait_loop``'s."""
    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    port = free_port()
    seed_tiny_models(config)
    ingress = {**config.get("ingress", {}), "http_mode": "direct"}  # the config's other ingress settings kept
    cfg = AppConfig.model_validate({**config, "port": port, "ingress": ingress})
    apply_serve_env()  # what `mmserve serve` runs with, before Ray starts its processes
    with own_ray(num_cpus=num_cpus):
        with shutdown_wait_loop(shutdown_wait_loop_s):
            start(cfg)
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)


_SHARED: dict[str, Any] = {}  # the shared app open now: its key, what it yields, its ExitStack


def shared_app(key: str, config: dict[str, Any], num_cpus: int = 2) -> OpenAI:
    """``local_app(config)`` once for the modules that ask for it by ``key``: the first starts it, the
    next ones get its client. tests/integration/conftest.py runs those modules one after the other
    (``SHARED_APPS``) and ends the app after the last of them; ``own_ray`` ends it too (one Ray per
    process). Each module reads the app's counters as differences, so the modules share it safely."""
    if _SHARED.get("key") == key:
        return _SHARED["client"]  # type: ignore[no-any-return]
    close_shared_app()
    stack = ExitStack()
    client = stack.enter_context(local_app(config, num_cpus))
    _SHARED.update(key=key, client=client, stack=stack)
    return client


def shared_app_key() -> str | None:
    return _SHARED.get("key")


def close_shared_app() -> None:
    if _SHARED:
        stack = _SHARED["stack"]
        _SHARED.clear()
        stack.close()
