"""``mmserve serve``: an embedded single-node Ray, the whole app, HTTP on 127.0.0.1:8000."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.config import AppConfig, ModelConfig, default_config
from cluster.one_machine import check_cpu_affinity, one_machine_defaults, pd_pools, pin_pool
from cluster.pool_engine_flag import add_pool_engine_argument, apply_pool_engine
from cluster.serve_drain import Stop, drain, hold_sigterm_for_ray, ray_started, take_signals
from cluster.serve_env import apply_serve_env

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the app on an embedded single-node Ray (Ctrl-C stops it)")
    p.add_argument("--config", help="AppConfig YAML (see cluster/deploy/serve-cpu.yaml for its `args`)")
    p.add_argument("--model", help="serve this HF model directory instead of the tiny defaults")
    p.add_argument("--model-name", help="the name clients send as `model` (default: the directory name)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--num-state-snapshots", type=int, default=None, help="hybrid models: snapshot slots")
    p.add_argument(
        "--snapshot-interval-blocks",
        type=int,
        default=None,
        help="hybrid models: a state snapshot every this many prompt blocks (0: prompt ends only)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--mm-encoder-tp-size", type=int, default=None)
    p.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default=None)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the embedded Ray")
    p.add_argument(
        "--encoder-threads",
        type=int,
        default=None,
        help="torch threads of each encoder replica's tower (encoder.torch_threads; default 1 under Ray)",
    )
    p.add_argument(
        "--llm-threads",
        type=int,
        default=None,
        help="torch threads of each LLM replica's model (llm.torch_threads; default 1 under Ray)",
    )
    p.add_argument(
        "--encoder-step-embeds",
        type=int,
        default=None,
        help="an encoder step ends once it holds this many embeddings (encoder.encoder_step_embeds)",
    )
    p.add_argument(
        "--overlap-prefill",
        action="store_true",
        default=None,
        help="hand each media item to the LLM as its encode ends (preprocess.overlap_prefill): the LLM "
        "prefills up to the first item still encoding meanwhile",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        default=None,
        help="E/P/D: each model's LLM runs as a prefill pool and a decode pool (llm.pools), each of "
        "the llm deployment's options, the KV moved between them (docs/disaggregation.md)",
    )
    add_pool_engine_argument(p)
    p.add_argument(
        "--cpu-affinity",
        action="append",
        default=None,
        metavar="POOL=CORES",
        help="pin a pool's replicas to cores (deployment.cpu_affinity), for every model; POOL: ingress, "
        "encoder, llm, prefill, decode; CORES: 0-3, 0,2 or one set per replica 0|1; repeatable",
    )
    p.add_argument(
        "--http-mode",
        choices=["direct", "proxy"],
        default=None,
        help="direct (default here): the ingress replicas serve HTTP themselves; proxy: through Serve's proxy",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key (Authorization: Bearer KEY; tenant `default`); default: $MMSERVE_API_KEY",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="YAML/JSON mapping API key -> tenant name: each tenant has its own uuids and prefix cache",
    )
    p.add_argument(
        "--operator-api-key",
        default=None,
        help="the key that alone sees /stats (counters across tenants) where API keys are on; "
        "default: $MMSERVE_OPERATOR_API_KEY",
    )
    p.add_argument(
        "--metrics-export-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (default: a port Ray picks)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a chat template for every model served, in place of its checkpoint's (vLLM's --chat-template): "
        "a .jinja file's path or the template text; e.g. cluster/data/*_tool_chat_template.jinja (docs/tools.md)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls (hermes, qwen3_xml, gemma4, pythonic); default: its family's",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="split the answer's thinking into the `reasoning` field (qwen3, gemma4, or auto: the family's "
        "own); default: off, as in vLLM (docs/reasoning.md)",
    )
    p.set_defaults(func=_cmd_serve)


def config_from_args(args: argparse.Namespace) -> AppConfig:
    if args.config:
        cfg = AppConfig.from_yaml(args.config)
    elif args.model:
        from pathlib import Path

        name = args.model_name or Path(args.model).name
        cfg = AppConfig(models=[ModelConfig(name=name, path=args.model)])
    else:
        cfg = default_config()
    data = cfg.model_dump()
    if args.host:
        data["host"] = args.host
    if args.port:
        data["port"] = args.port
    api_key = getattr(args, "api_key", None) or os.environ.get("MMSERVE_API_KEY")
    if api_key:
        data["ingress"]["api_key"] = api_key
    operator_key = getattr(args, "operator_api_key", None) or os.environ.get("MMSERVE_OPERATOR_API_KEY")
    if operator_key:
        data["ingress"]["operator_api_key"] = operator_key
    if getattr(args, "api_keys_file", None):
        from pathlib import Path

        from router.http.auth import load_keys_file

        keys_file = str(Path(args.api_keys_file).resolve())  # replicas do not run in this directory
        load_keys_file(keys_file)  # fail here, with the reason, rather than in every ingress replica
        data["ingress"]["api_keys_file"] = keys_file
    one_machine_defaults(cfg, data)
    if args.http_mode:
        data["ingress"]["http_mode"] = args.http_mode
    for m in data["models"]:
        for key in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_kv_blocks",
            "num_state_snapshots",
            "snapshot_interval_blocks",
            "dtype",
        ):
            if getattr(args, key) is not None:
                m["llm"][key] = getattr(args, key)
        if args.mm_encoder_tp_size is not None:
            m["encoder"]["mm_encoder_tp_size"] = args.mm_encoder_tp_size
        if args.mm_encoder_tp_mode is not None:
            m["encoder"]["mm_encoder_tp_mode"] = args.mm_encoder_tp_mode
        if getattr(args, "llm_threads", None) is not None:
            m["llm"]["torch_threads"] = args.llm_threads
        if getattr(args, "encoder_threads", None) is not None:
            m["encoder"]["torch_threads"] = args.encoder_threads
        if getattr(args, "encoder_step_embeds", None) is not None:
            m["encoder"]["encoder_step_embeds"] = args.encoder_step_embeds
        if getattr(args, "overlap_prefill", None):
            m["preprocess"]["overlap_prefill"] = True
        if getattr(args, "chat_template", None) is not None:
            m["chat_template"] = args.chat_template  # read (if a file) and checked by the config
        if getattr(args, "tool_call_parser", None) is not None:
            m["tool_call_parser"] = args.tool_call_parser
        if getattr(args, "reasoning_parser", None) is not None:
            m["reasoning_parser"] = args.reasoning_parser
        if getattr(args, "pd", None) and not m["llm"]["pools"]:
            m["llm"]["pools"] = pd_pools(m["llm"]["deployment"])
    for flag in getattr(args, "cpu_affinity", None) or ():
        pin_pool(data, flag)
    apply_pool_engine(data, getattr(args, "pool_engine", None) or ())
    return AppConfig.model_validate(data)


def start(
    cfg: AppConfig,
    num_cpus: int | None = None,
    blocking: bool = False,
    metrics_export_port: int | None = None,
    on_ray_started: Callable[[], None] | None = None,
) -> DeploymentHandle:
    """Start Ray (if needed) and the app; returns the ingress handle. ``on_ray_started`` runs between
    the two (``mmserve serve`` takes SIGTERM back there from the handlers ``ray.init`` installs)."""
    if "ray" not in sys.modules and _is_loopback(cfg.host):
        # An embedded single-node Ray serving loopback keeps its own sockets on loopback too; Ray
        # otherwise binds its GCS and raylet to the machine's routable address. Ray reads this flag
        # when it is first imported, hence before the import below.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not _ray_running():
        apply_serve_env()  # read by Serve's processes, which the embedded Ray starts below
    import ray
    from ray import serve

    from cluster.app import build_app

    if not ray.is_initialized():
        extra = {} if metrics_export_port is None else {"_metrics_export_port": metrics_export_port}
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="mmserve", **extra)
    if on_ray_started is not None:
        on_ray_started()
    # Direct HTTP: the ingress replicas listen on host:port themselves; Serve starts no proxy.
    proxy = "Disabled" if cfg.ingress.http_mode == "direct" else "HeadOnly"
    serve.start(proxy_location=proxy, http_options={"host": cfg.host, "port": cfg.port})
    return serve.run(build_app(cfg), name="mmserve", route_prefix="/", blocking=blocking)


class PortInUse(SystemExit):
    """The HTTP port is taken: ``mmserve serve`` stops before starting anything."""


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another server holds, naming it. The ingress replicas bind with ``SO_REUSEPORT``
    (several replicas share a node's port), and the kernel would let a second ``mmserve serve`` of
    the same user share it too, splitting connections between two unrelated servers; a plain bind
    (no ``SO_REUSEPORT``) fails on any socket bound there, so it tells."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as e:
            raise PortInUse(
                f"mmserve: cannot serve on {host}:{port}: {e.strerror} (another server is listening "
                f"there?). Stop it, or choose another port with --port."
            ) from e


def _ray_running() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return bool(ray.is_initialized())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        cfg = config_from_args(args)
    except ValidationError as e:  # a config error: the model and the setting, without a traceback
        print(f"mmserve: the config is not valid: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        check_cpu_affinity(cfg, os.sched_getaffinity(0))
    except ValueError as e:
        print(f"mmserve: the config is not valid: {e}", file=sys.stderr, flush=True)
        return 2
    check_port_free(cfg.host, cfg.port)
    # Installed before Ray starts, so no Ray or Serve process inherits them: SIGTERM (Kubernetes,
    # systemd, docker stop) and Ctrl-C both drain instead of dying mid-request.
    take_signals()
    hold_sigterm_for_ray()
    try:
        start(cfg, args.num_cpus, metrics_export_port=args.metrics_export_port, on_ray_started=ray_started)
        names = ", ".join(m.name for m in cfg.models)
        print(f"mmserve is serving {names} on http://{cfg.host}:{cfg.port}/v1 (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except Stop as why:
        print(f"mmserve: {why}: draining (in-flight requests finish, new ones get 503)", flush=True)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # if Ray never came up
    return drain()
