"""Paired ratios to a reference, with a confidence interval: what tells 2% from noise.

Serving waves and soak segments run every method on the same requests at
nearly the same moment, so the ratio of a method's figure to the
reference's in one wave cancels most of the machine's drift. Their
geometric mean is the ratio reported, and a Student t interval on the log
ratios says whether it is told from 1.0.
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student t quantiles by degrees of freedom (1..30; beyond, 1.96).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ratio_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """Geometric mean of paired per-wave ratios and its 95% confidence interval
    (t interval on the log ratios; ``None`` bounds from fewer than two waves)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    t = T95[len(logs) - 2] if len(logs) - 1 <= len(T95) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
