"""The real server, started once per test run: ``pie-media serve`` under uvicorn in a
subprocess on 127.0.0.1 (a free port), serving the tiny Qwen3-VL, Gemma-4 and CSM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
READY_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    state_dir: Path
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(
    tmp: Path,
    *extra: str,
    models: tuple[str, ...] = ("tiny", "tiny-gemma4"),
    env: dict[str, str] | None = None,
) -> Server:
    port = free_port()
    log = tmp / "server.log"
    args = [
        sys.executable,
        "-m",
        "api.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--media-dir",
        str(tmp / "state"),
        "--log-level",
        "warning",
        *extra,
    ]
    for m in models:
        args += ["--model", m]
    from fixtures.paths import cache_root

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        # compiled inferlet components are shared with tests/inferlets (no second compile)
        "PIE_MEDIA_INFERLET_CACHE_DIR": str(cache_root()),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(f"http://127.0.0.1:{port}", proc, tmp / "state", log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"server not ready in {READY_TIMEOUT_S} s:\n{server.log_text()[-4000:]}")


def scrape_metrics(server: Server) -> dict[str, float]:
    """``name{labels}`` -> value of every sample on the server's /metrics."""
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric_sample(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` carrying all of ``labels`` (None: none)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for key, value in metrics.items():
        if key.startswith(name + "{") and all(w in key for w in want):
            return value
    return None


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The real-time admission rule (speech.admission) refuses streams by measured frame
    # time, which on a busy CI machine is anyone's guess: tests of it start their own server.
    s = start_server(
        tmp_path_factory.mktemp("serve"),
        "--speech-realtime-safety",
        "off",
        models=("tiny", "tiny-gemma4", "tiny-csm"),
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.v1, api_key="unused-on-loopback", max_retries=0, timeout=120)
