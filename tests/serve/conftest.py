"""Real OpenAI-compatible servers on 127.0.0.1, shared by the whole test session.

Two servers start side by side through ``python -m lookahead_vllm.serve``
(the ``lookahead-vllm-serve`` console script): ``plain`` (no speculation)
and ``lookahead`` (``--speculative-model lookahead``). Each gets a free
port, a log file and a start timeout; the finalizer stops the process group
it started (SIGINT, then SIGKILL), whatever the tests did.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420
MAX_MODEL_LEN = 1024
# Load thresholds low enough that the concurrency test crosses them (profile knobs).
LOOKAHEAD_CONFIG = '{"lookahead": {"_profile": {"load_shrink_above": 2, "load_stop_at": 4}}}'


def server_env(**extra: str) -> dict[str, str]:
    """Environment for a server subprocess: this checkout first on the path, 1 thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # INFO: tests read the servers' log lines (a benchmark imported into this process may set WARNING).
    env.update({"OMP_NUM_THREADS": "1", "VLLM_LOG_STATS_INTERVAL": "2", "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "INFO"})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server needs its engine process
    env.pop("LOOKAHEAD_VLLM_STATS_DIR", None)  # each server makes its own
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


def start_server(name: str, model: str, args: list[str], log_dir: Path) -> Server:
    port = free_port()
    log = log_dir / f"{name}.log"
    cmd = [
        sys.executable, "-m", "lookahead_vllm.serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", *args,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=REPO, start_new_session=True
        )
    return Server(name, proc, port, log, model)


def wait_healthy(servers: list[Server]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} server exited with {s.proc.returncode}:\n{s.log_text()[-4000:]}")
            if s.healthy():
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"servers not healthy after {START_TIMEOUT_S} s: {[s.name for s in pending]}")
        time.sleep(1)


# Package scope: the servers stop when tests/serve ends (idle vLLM CPU workers still spin, ~30%
# of a core each, and the rest of the suite ran beside them when they lived for the session).
@pytest.fixture(scope="package")
def servers(smollm2_dir, tmp_path_factory) -> dict[str, Server]:
    log_dir = tmp_path_factory.mktemp("servers")
    started: list[Server] = []
    try:
        started.append(start_server("plain", smollm2_dir, [], log_dir))
        started.append(start_server(
            "lookahead", smollm2_dir,
            ["--speculative-model", "lookahead", "--additional-config", LOOKAHEAD_CONFIG,
             "--per-request-spec-decode-metrics", "summary"],
            log_dir,
        ))
        wait_healthy(started)
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="package")
def plain(servers) -> Server:
    return servers["plain"]


@pytest.fixture(scope="package")
def lookahead(servers) -> Server:
    return servers["lookahead"]
