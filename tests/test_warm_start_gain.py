"""benchmarks/warm_start_gain.py: warm folds learn the other half first."""

from __future__ import annotations

import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_warm_fold_learns_the_other_half():
    sys.path.insert(0, str(BENCH))
    try:
        import warm_start_gain
    finally:
        sys.path.pop(0)
    body = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2
    prompts, outputs = [[1, 2, 3], [4, 5, 6]], [[7] + body, [8] + body]
    f = warm_start_gain.fold({}, prompts, outputs, slice(0, 1), slice(1, 2))
    assert f["warm"]["mal"] > f["cold"]["mal"]  # the warm half already holds the whole answer
    assert f["tokens"] == len(outputs[0])
    same = [{"tokens": 1, "cold": {"mal": 2.0}}, {"tokens": 3, "cold": {"mal": 4.0}}]
    assert warm_start_gain.pooled(same, "cold", "mal") == 3.5
