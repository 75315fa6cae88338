"""``mmserve serve`` drains on SIGTERM: a stream in flight finishes, new requests are refused, exit 0.

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


def test_sigterm_drains_the_stream_in_flight_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
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
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(tmp_path / "app.yaml")]
    cmd += ["--port", str(port), "--num-cpus", "2"]
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
                return
        except httpx.TransportError as e:
            out.append(type(e).__name__)
            return
        time.sleep(0.2)
