"""Statistics over seeds that every protocol, report and experiment shares: mean, std and the 95 % interval
of the mean, the per-seed values behind them, bands along curves and means of nested diagnostics."""
from __future__ import annotations

import math
import statistics


T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
# Student t quantile 97.5 % for df 1..30 (beyond: the normal's 1.96)


def mean_std(values: list[float | None]) -> dict:
    """Mean and sample std over seeds, and with >= 2 seeds `ci95`, the half-width of the 95 % interval of
    the mean (Student t); None (a metric that does not exist for this run) stays None."""
    if any(v is None for v in values):
        return {"mean": None, "std": None}
    n = len(values)
    if n < 2:
        return {"mean": statistics.fmean(values), "std": 0.0}
    std = statistics.stdev(values)
    t = T_975[n - 2] if n - 1 <= len(T_975) else statistics.NormalDist().inv_cdf(0.975)
    return {"mean": statistics.fmean(values), "std": std, "ci95": t * std / math.sqrt(n)}


def per_seed(runs: list[dict], metrics: list[str]) -> dict[str, dict]:
    """{seed: {metric: value}} for the `metrics` a run has: the values behind `mean_std`, kept in results.json so
    methods can be compared seed by seed (paired), e.g. along their trade-off curves (report/frontier.py)."""
    return {str(r["seed"]): {m: r[m] for m in metrics if m in r} for r in runs}


def band(per_step: list[tuple[float, ...]]) -> dict:
    """Mean and std at every step of a curve, from the values of each seed there."""
    return {"mean": [statistics.fmean(v) for v in per_step],
            "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_step]}


def mean_nested(items: list):
    """Elementwise mean over seeds of numbers, lists and dicts of them; None (not measured) where any is None."""
    first = items[0]
    if isinstance(first, dict):
        return {k: mean_nested([i[k] for i in items]) for k in first}
    if isinstance(first, list):
        return [mean_nested(list(v)) for v in zip(*items)]
    return None if any(i is None for i in items) else statistics.fmean(items)
