"""``mmserve serve`` drains on SIGTERM: a stream in flight finishes, new requests are refused, exit 0;
and SIGTERM to its whole process group (systemd's ``KillMode=control-group``) drains it the same way.

A real subprocess (the console script's module, its own embedded Ray) on a free loopback port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.integration.local_app import free_port

ROOT = Path(__file__).resolve().parents[2]
VL = "tiny-qwen2-vl"


def _wait_serving(log: Path, url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the command says it is serving (the whole app is up) and /health answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mmserve serve exited early with {proc.returncode}"
        if "mmserve is serving" in log.read_text(errors="replace"):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"mmserve serve was not serving within {timeout_s}s")


GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds; systemd's TimeoutStopSec is 90


def _write_config(tmp_path: Path) -> Path:
    one = {"num_replicas": 1, "num_cpus": 0.1}
    config = {
        "models_cache_dir": str(tmp_path / "models"),
        "models": [
            {
                "name": VL,
                "tiny": "qwen2-vl",
                "llm": {"max_model_len": 2048, "num_kv_blocks": 256, "deployment": one},
                "encoder": {"deployment": one},
            }
        ],
        "ingress": {"deployment": one},
    }
    (tmp_path / "app.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "app.yaml"


def _serve_cmd(config: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)]
    return [*cmd, "--port", str(port), "--num-cpus", "2"]


def test_sigterm_drains_the_stream_in_flight_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    cmd = _serve_cmd(_write_config(tmp_path), port)
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(
            tmp_path / "serve.log", url, proc, 480
        )  # ≈ 30 s on an idle 2-core machine; minutes when it is shared
        body = {
            "model": VL,
            "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        events: list[dict[str, Any]] = []
        refused_after_sigterm: list[str] = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if any(c["delta"].get("content") for e in events for c in e.get("choices", [])):
                        break
            proc.send_signal(signal.SIGTERM)  # mid-stream
            probe = threading.Thread(target=_probe_refused, args=(url, refused_after_sigterm), daemon=True)
            probe.start()
            done = False
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert done and not [e for e in events if "error" in e], events[-3:]
        finishes = [
            c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")
        ]
        assert finishes == ["length"]
        tokens = sum(1 for e in events for c in e.get("choices", []) if c["delta"].get("content"))
        assert tokens > 1
        assert proc.wait(timeout=180) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        probe.join(timeout=30)
        assert refused_after_sigterm, "a new request was still served after SIGTERM"
        assert "healthz 200" not in refused_after_sigterm, refused_after_sigterm
        text = (tmp_path / "serve.log").read_text()
        assert "draining" in text and "Fatal Python error" not in text and "SIGABRT" not in text
    finally:
        if proc.poll() is None:  # failed midway: drain it (its Ray goes down with it), then insist
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _probe_refused(url: str, out: list[str]) -> None:
    """Once draining, a new request is refused: 503 (admission closed) or no listener at all."""
    body = {"model": VL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
            if r.status_code == 503:
                out.append(f"503 {r.json()['error']['code']}")
                try:  # KubeRay's readiness probe must fail too, so the pod leaves the Service
                    out.append(f"healthz {httpx.get(f'{url}/-/healthz', timeout=10).status_code}")
                except httpx.TransportError as e:
                    out.append(f"healthz {type(e).__name__}")
                return
        except httpx.TransportError as e:
            out.append(type(e).__name__)
            return
        time.sleep(0.2)


def test_sigterm_to_the_process_group_drains_and_leaves_no_ray_process(tmp_path: Path) -> None:
    """What systemd's ``KillMode=control-group`` and ``kill -TERM -PGID`` do: every process of the
    group gets SIGTERM at once. Ray's GCS and raylet share the driver's group; they must outlive the
    drain (which talks to them), then go, with every worker, within the grace period."""
    port = free_port()
    cmd = _serve_cmd(_write_config(tmp_path), port)
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(tmp_path / "serve.log", url, proc, 480)
        body = {"model": VL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        ray_procs = _descendants(proc.pid)
        names = {_comm(pid) for pid in ray_procs}
        assert {"gcs_server", "raylet"} <= names, names
        assert {pid for pid in ray_procs if os.getpgid(pid) == proc.pid}, "nothing of Ray shares the group"
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=GRACE_S)
        print(f"exit {code} {time.monotonic() - started:.1f} s after SIGTERM to the group")
        text = (tmp_path / "serve.log").read_text(errors="replace")
        assert code == 0, text[-3000:]
        assert "draining" in text and "Failed to connect to GCS" not in text, text[-3000:]
        left = _still_running(ray_procs)
        assert not left, f"left behind: {[(pid, _comm(pid)) for pid in left]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (state first), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` (Ray's workers have their own process groups, but are still the
    raylet's children): pid -> start time, so a reused pid is not mistaken for one of them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: dict[int, str] = {}
    stack = [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            fields = _stat(pid)
            if fields is not None:
                out[pid] = fields[19]
                stack.append(pid)
    return out


def _still_running(procs: dict[int, str]) -> list[int]:
    """Of ``procs``, those alive a few seconds on (a process may still be on its way out)."""
    for _ in range(20):
        left = []
        for pid, start in procs.items():
            fields = _stat(pid)
            if fields is not None and fields[19] == start and fields[0] != "Z":
                left.append(pid)
        if not left:
            return []
        time.sleep(0.25)
    return left
