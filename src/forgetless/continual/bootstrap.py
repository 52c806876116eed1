"""Intervals for an instruction stream's OP, BWT and general-PPL change that include both sources of error:
the test rows (a finite sample of each task) and the training seeds.

Each arm keeps the outcome of every scored test row after every task (`r_hits`) and the general text's loss
per window (`general_window_loss`; continual/instruct.py). One bootstrap replicate draws each task's test rows
with replacement (the same draw for every seed, order and method: they all score the same rows, so that is
the sample whose error we want), the general text's windows likewise, and then, within each group of runs
(an order of the stream), its seeds with replacement. A statistic is the mean over a group's drawn seeds,
averaged over the groups; its interval is the 2.5 and 97.5 percentiles of the replicates. With one seed per
group the interval holds the rows' error alone; with few seeds the seed part is a small-sample bootstrap
(it tends to be narrow). Differences between methods use the same draws for both (paired).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from forgetless.errors import ForgetlessError

RESAMPLES, LEVEL = 2000, 0.95
METRICS = ("op_tasks", "bwt_tasks", "la", "general_ppl_change")  # the field's: OP and BWT over the tasks


@dataclass
class Runs:
    """One method on one order of the stream: its seeds' scored rows."""
    tasks: list[str]                # task names, in this order's training order (R's columns 1..T)
    hits: list[np.ndarray]          # per task column: (S, T+1, n), the rows' outcomes (1/0, NaN: not scored) after each task
    before_loss: np.ndarray         # (W,) general text's loss per window before training
    after_loss: np.ndarray          # (S, W) after the last task

    @classmethod
    def of(cls, arms: list[dict], tasks: list[str]) -> "Runs":
        """From instruction arms (the seeds of one method on one order); a row not scored after some task
        (data.r_cells "metrics") is NaN there: the statistics read only the diagonal and the last row."""
        def outcomes(row, i):
            n = len(arms[0]["r_hits"][-1][i])
            return [np.nan] * n if row is None or row[i] is None else [float(c == "1") for c in row[i]]
        hits = [np.array([[outcomes(row, i) for row in a["r_hits"]] for a in arms]) for i in range(len(tasks))]
        return cls(list(tasks), hits, np.array(arms[0]["general_window_loss"][0]),
                   np.array([a["general_window_loss"][-1] for a in arms]))

    @property
    def seeds(self) -> int:
        return self.hits[0].shape[0]

    def before(self) -> "Runs":
        """The untrained model as a run: every task's rows as scored before training, after every task too (its
        OP is the base's accuracy, its BWT and general-PPL change 0)."""
        T = len(self.tasks)
        return Runs(self.tasks, [h[:1, [0] * (T + 1), :] for h in self.hits], self.before_loss, self.before_loss[None])


@dataclass
class Draws:
    """The replicates' draws, made once per key and shared by every method (so differences are paired)."""
    resamples: int = RESAMPLES
    seed: int = 0
    made: dict = field(default_factory=dict)

    def indices(self, key: str, n: int) -> np.ndarray:
        """(resamples, n) draws with replacement from 0..n-1, the same for the same (key, n)."""
        if (key, n) not in self.made:
            rng = np.random.default_rng([self.seed, zlib.crc32(key.encode()), n])
            self.made[key, n] = rng.integers(0, n, (self.resamples, n))
        return self.made[key, n]


def replicates(runs: Runs, draws: Draws, group: str) -> dict[str, np.ndarray]:
    """Metric -> (resamples,) its value in each replicate: rows and windows drawn, then this group's seeds."""
    per_seed = seed_values(runs, draws)                                   # metric -> (B, S)
    picks = draws.indices(f"seeds of {group}", runs.seeds)                # (B, S)
    return {m: np.take_along_axis(v, picks, 1).mean(1) for m, v in per_seed.items()}


def seed_values(runs: Runs, draws: Draws | None) -> dict[str, np.ndarray]:
    """Metric -> (B, S) per replicate and seed (draws None: the observed rows once, B = 1)."""
    cols = []
    for name, hits in zip(runs.tasks, runs.hits):                         # hits (S, T+1, n)
        rows = draws.indices(f"rows of {name}", hits.shape[2]) if draws else np.arange(hits.shape[2])[None]
        cols.append(100.0 * hits[:, :, rows].mean(-1))                    # (S, T+1, B)
    R = np.stack(cols, -1).transpose(2, 0, 1, 3)                          # (B, S, T+1, T)
    T = R.shape[-1]
    last, diag = R[:, :, T, :], R[:, :, np.arange(1, T + 1), np.arange(T)]  # (B, S, T) each
    windows = draws.indices("general windows", len(runs.before_loss)) if draws else \
        np.arange(len(runs.before_loss))[None]                            # (B, W)
    change = np.exp(runs.after_loss[:, windows].mean(-1) - runs.before_loss[windows].mean(-1)) - 1  # (S, B)
    out = {"op_tasks": last.mean(-1), "la": diag.mean(-1), "general_ppl_change": change.T}
    if T > 1:
        out["bwt_tasks"] = (last[..., :-1] - diag[..., :-1]).mean(-1)
    return out


def observed(groups: dict[str, Runs]) -> dict[str, float]:
    """Metric -> its value on the rows as scored: the mean over each group's seeds, averaged over groups."""
    values = [seed_values(runs, None) for runs in groups.values()]
    return {m: float(np.mean([v[m].mean() for v in values])) for m in values[0]}


def intervals(groups: dict[str, Runs], draws: Draws, level: float = LEVEL) -> dict[str, dict]:
    """Metric -> {mean, lo, hi}: the observed value and its percentile interval over the replicates, for the
    mean over `groups` (order -> that method's runs on it) of each group's mean over seeds."""
    return summary(observed(groups), mean_replicates(groups, draws), level)


def paired(a: dict[str, Runs], b: dict[str, Runs], draws: Draws, level: float = LEVEL) -> dict[str, dict]:
    """Metric -> {mean, lo, hi} of A − B, both on the same draws (their groups must have the same seeds)."""
    if {k: r.seeds for k, r in a.items()} != {k: r.seeds for k, r in b.items()}:
        raise ForgetlessError("a paired difference needs both methods run on the same orders and seeds")
    seen_a, seen_b = observed(a), observed(b)
    rep_a, rep_b = mean_replicates(a, draws), mean_replicates(b, draws)
    return summary({m: seen_a[m] - seen_b[m] for m in seen_a if m in seen_b},
                   {m: rep_a[m] - rep_b[m] for m in rep_a if m in rep_b}, level)


def mean_replicates(groups: dict[str, Runs], draws: Draws) -> dict[str, np.ndarray]:
    reps = [replicates(runs, draws, group) for group, runs in groups.items()]
    return {m: np.mean([r[m] for r in reps], 0) for m in reps[0]}


def summary(seen: dict[str, float], reps: dict[str, np.ndarray], level: float) -> dict[str, dict]:
    tail = 100 * (1 - level) / 2
    return {m: {"mean": seen[m], "lo": float(np.percentile(reps[m], tail)), "hi": float(np.percentile(reps[m], 100 - tail))}
            for m in seen}
