"""benchmarks/bench_kernels.py parses and, without CUDA, exits with a clear message (it measures nothing on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def test_bench_kernels_exits_cleanly_without_cuda(monkeypatch, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "k.json"
    assert bench.main(["--out", str(out), "--plot", str(tmp_path / "k.png")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()
    args = bench.parse_args(["--nodes", "16", "--contexts", "512", "--batch", "4"])
    assert (args.nodes, args.contexts, args.batch) == ([16], [512], 4)


def test_bench_kernels_plot_writes_png(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [{"config": c, "nodes": n, "context": x, "batch": 1, "tree_us": 10.0 * n, "baseline_us": 8.0 * n}
            for c in ("smollm2-135m", "llama-8b") for n in (1, 16) for x in (512, 2048)]
    bench.plot(rows, tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 1000
