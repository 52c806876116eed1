"""Task-sequence metrics from an accuracy matrix (docs/DESIGN.md §3, MoRAM / TRACE style).

R[t][i] = score on task i after training through task t; row 0 is the base before any new task
and task 0 is the base's own domain, so R is (T+1) x (T+1). Higher scores are better.
"""
from __future__ import annotations

from forgetless.errors import ForgetlessError

DEV_METRICS = ["op_tasks_dev", "bwt_tasks_dev", "forgetting_tasks_dev", "la_dev"]  # of R on validation data


def check(R: list[list[float]]) -> int:
    T = len(R) - 1
    if T < 1 or any(len(row) != T + 1 for row in R):
        raise ForgetlessError(f"R must be a square (T+1) x (T+1) matrix with T >= 1, got {len(R)} rows")
    return T


def overall_performance(R) -> float:
    """OP = mean_i R[T][i]: every task, scored after the last one."""
    T = check(R)
    return sum(R[T]) / (T + 1)


def backward_transfer(R, first: int = 0) -> float | None:
    """BWT = mean_{first<=i<T} (R[T][i] - R[i][i]); negative = forgetting (the MoRAM source prints the
    drop as a positive number). first=1 leaves out column 0 (e.g. general ability): the tasks' own BWT
    as TRACE and MoRAM report it (None with no earlier task)."""
    T = check(R)
    return sum(R[T][i] - R[i][i] for i in range(first, T)) / (T - first) if T > first else None


def forgetting(R, first: int = 0) -> float | None:
    """mean_{first<=i<T} (max_{i<=t<T} R[t][i] - R[T][i]): how far each task fell from its best."""
    T = check(R)
    return sum(max(R[t][i] for t in range(i, T)) - R[T][i] for i in range(first, T)) / (T - first) if T > first else None


def forward_transfer(R) -> float | None:
    """FWT = mean_{i>=2} (R[i-1][i] - R[0][i]): what earlier tasks did for a task before it was trained.
    Task 1 has no earlier task (its term R[0][1] - R[0][1] is 0 by construction), so it is left out;
    with one task there is no FWT (None)."""
    T = check(R)
    return sum(R[i - 1][i] - R[0][i] for i in range(2, T + 1)) / (T - 1) if T > 1 else None


def learning_accuracy(R) -> float:
    """LA = mean_{i>=1} R[i][i]: each new task right after learning it (plasticity)."""
    T = check(R)
    return sum(R[i][i] for i in range(1, T + 1)) / T


def clipped_drop(R, first: int = 1) -> float | None:
    """mean_{first<=i<T} max(0, R[i][i] - R[T][i]): the drop of each task, gains counted as no drop."""
    T = check(R)
    return sum(max(0.0, R[i][i] - R[T][i]) for i in range(first, T)) / (T - first) if T > first else None


def sequence_metrics(R, joint: bool = False) -> dict:
    """OP, BWT (GEM sign), bwt_drop = -BWT (the MoRAM / TRACE sign: positive = forgetting), forgetting,
    FWT and LA; and over the new tasks 1..T alone (task 0, the base's domain, left out, as TRACE and
    MoRAM report): op_tasks, bwt_tasks, forgetting_tasks, and bwt_drop_clipped (drops, gains as 0).

    `joint`: R of a joint arm (mtl, METHOD[joint=true]), which learns tasks 1..T at once: row 0 is the
    model before, rows 1..T all hold the one state after joint training (each task's "right after
    learning it" is that state). So OP and op_tasks are the joint model's scores, LA = op_tasks, and
    bwt_tasks, forgetting_tasks and bwt_drop_clipped are 0 by definition (nothing is learned after a
    task); column 0 keeps its real change (bwt, forgetting: the base's domain, never trained on). FWT
    (a task's score before it is learned) does not exist for a joint arm: None.

    Cells may be None (not scored: an instruction arm with data.r_cells "metrics" scores the diagonal and the
    last row); forgetting and FWT, which need the others, are then None."""
    T, bwt = check(R), backward_transfer(R)
    whole = all(v is not None for row in R for v in row)  # else only the diagonal and the last row were scored
    return {"op": overall_performance(R), "bwt": bwt, "bwt_drop": -bwt, "forgetting": forgetting(R) if whole else None,
            "fwt": None if joint or not whole else forward_transfer(R), "la": learning_accuracy(R),
            "op_tasks": sum(R[T][1:]) / T, "bwt_tasks": backward_transfer(R, 1),
            "forgetting_tasks": forgetting(R, 1) if whole else None, "bwt_drop_clipped": clipped_drop(R, 1)}


def dev_metrics(R) -> dict:
    """The task metrics of R scored on validation data (where choices are made), as `name_dev`."""
    return {name: sequence_metrics(R)[name.removesuffix("_dev")] for name in DEV_METRICS}
