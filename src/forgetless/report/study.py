"""A study's tables and figures (`forgetless study`, continual/study.py): the field's columns (OP and BWT over the
tasks, general-text PPL change) as the mean over orders and as order 1's mean over seeds with intervals that
include the test rows' sampling error, the published rows beside them, the lr grid, the compute plan; R matrices
and accuracy against forgetting."""
from __future__ import annotations

from pathlib import Path

from forgetless.report.figures import colors, plt, r_heatmaps, r_matrices, save
from forgetless.report.kinds import Report, register_report
from forgetless.report.results import RunResult
from forgetless.report.tables import rich_table, sequence_markdown, tasks_text, write_sequence_csv


def interval(stat: dict | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    """'43.2 [38.1, 48.0]' from {mean, lo, hi}; '—' when missing."""
    if not stat or stat.get("mean") is None:
        return "—"
    return f"{fmt.format(scale * stat['mean'])} [{fmt.format(scale * stat['lo'])}, {fmt.format(scale * stat['hi'])}]"


def study_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    """Our rows: the base model untrained, then each arm: the chosen lr; OP, BWT and general PPL change, each as the
    mean over orders with its interval and per order (BWT "—" for a joint arm: 0 by definition); order 1 with its
    intervals where it has more seeds than the others; trainable parameters."""
    study = results.extra["study"]
    main, orders, seeds = study["main_order"], list(study["orders"]), len(results.seeds)
    over = "over_orders" if len(orders) > 1 else "intervals"
    where = "mean over orders" if len(orders) > 1 else f"order {main}"
    extra = len(orders) > 1 and seeds > study["seeds_per_order"]  # order 1's own intervals, over its seeds
    per = " (" + " / ".join(orders) + ")"
    cells = (("op_tasks", "{:.1f}", 1.0, ""), ("bwt_tasks", "{:+.1f}", 1.0, ""), ("general_ppl_change", "{:+.1f}", 100.0, " %"))
    heads = ["method", "lr (chosen on validation)" if study["lr_grid"] else "lr",
             f"OP, {where}", f"BWT, {where}", f"general PPL change, {where}",
             *([f"OP per order{per}", f"BWT per order{per}", f"general PPL change per order{per}"] if len(orders) > 1
               else []),
             *([f"OP, order {main} ({seeds} seeds)", f"BWT, order {main} ({seeds} seeds)"] if extra else []),
             "trainable params"]

    def values(stats: dict | None, per_order: dict, dash: tuple = ()) -> list[str]:
        both = [interval(stats.get(key) if stats else None, fmt, scale).replace("]", "]" + unit, 1)
                if key not in dash else "—" for key, fmt, scale, unit in cells]
        if len(orders) > 1:
            both += ["—" if key in dash else " / ".join(fmt.format(scale * per_order[k][key]) for k in orders)
                     for key, fmt, scale, _ in cells]
        return both

    body = []
    if "base" in study:  # a results file from before the base row has none
        base = study["base"]
        body.append(["base model, untrained", "—",
                     *values(base[over], {k: {"op_tasks": v} for k, v in base["orders"].items()},
                             ("bwt_tasks", "general_ppl_change")),
                     *([interval(base["intervals"]["op_tasks"]), "—"] if extra else []), "0"])
    for label, entry in results.methods.items():
        m = entry.stats  # the study's keys: lr, intervals, over_orders, orders (continual/study.py)
        body.append([label, f"{m['lr']:.3g}", *values(m[over], m["orders"], ("bwt_tasks",) if m.get("joint") else ()),
                     *([interval(m["intervals"]["op_tasks"]), interval(m["intervals"].get("bwt_tasks"), "{:+.1f}")]
                       if extra else []), millions(entry.trainable_params)])
    return heads, body


def spans_zero(stat: dict) -> bool:
    return stat["lo"] <= 0 <= stat["hi"]


def millions(n: int) -> str:
    return f"{n:,}" if n < 1e4 else f"{n / 1e6:.2f} M" if n < 1e8 else f"{n / 1e6:.0f} M"


def seeds_note(results: RunResult) -> str:
    """What the intervals hold: with one seed per order, the test rows' sampling error alone."""
    if len(results.seeds) > 1 or results.extra["study"]["seeds_per_order"] > 1:
        return "they hold the test rows' sampling error and the seeds'"
    return ("one seed per order: they hold the test rows' sampling error only, not the run-to-run (seed) spread; the "
            "joint arm's OP per order, which differs in data order alone, shows that spread")


def uses_old_rows(m: dict, results: dict) -> bool:
    """Whether a study's arm (its entry in results.json) needs rows of the earlier tasks: it trains on them (its own
    mix, else the study's, > 0) or its start of task reads the last task's (EWC's Fisher; `adapt` takes them as
    --retain)."""
    mix = m["options"].get("mix")
    return (results["config"]["adapt"]["mix"] if mix is None else mix) > 0 or m["reads_previous"]


def study_answers(results: dict, points: float = 2.0) -> list[str]:
    """The study's plain answers, from its results.json: which arm gets closest to the joint ceiling (`mtl`) without
    old data and with it (highest mean OP; with: `uses_old_rows`), and which arms keep
    BWT >= -`points` with OP within `points` of the ceiling (on the means; their intervals are in the table)."""
    methods, study = results["methods"], results["study"]
    over = "over_orders" if len(study["orders"]) > 1 else "intervals"
    where = "mean over orders" if over == "over_orders" else f"order {study['main_order']}"
    ceiling = next((label for label, m in methods.items() if m.get("joint")), None)
    if ceiling is None:
        return [f"No joint ceiling (`mtl`) among the arms: nothing to measure the gap to ({where})."]
    top = methods[ceiling][over]["op_tasks"]
    gaps = "paired_over_orders" if over == "over_orders" else "paired"  # each arm's difference from the ceiling
    pairs = study.get("op_differences", {}).get("pairs", {})

    lines = []
    for old in (False, True):
        group = [label for label, m in methods.items() if label != ceiling and uses_old_rows(m, results) == old]
        if group:
            group.sort(key=lambda label: -methods[label][over]["op_tasks"]["mean"])  # ties: the first listed
            best, op = group[0], methods[group[0]][over]["op_tasks"]
            gap = methods[best].get(gaps, {}).get("op_tasks")
            gap_text = f"{op['mean'] - top['mean']:+.1f} points" if not gap or gap.get("mean") is None else \
                f"{interval(gap, '{:+.1f}')} points, paired" + (", not separated from the ceiling" if spans_zero(gap) else "")
            close = [f"`{b}` ({interval(pairs[best][b], '{:+.1f}')})" for b in group[1:]
                     if b in pairs.get(best, {}) and spans_zero(pairs[best][b])]
            lines.append(f"Closest to the ceiling {'with' if old else 'without'} old data: `{best}`, OP {interval(op)} "
                         f"against `{ceiling}`'s {interval(top)}: {gap_text} ({where})" +
                         (f"; not separated from {', '.join(close)}: its OP minus theirs, paired" if close else "") +
                         (f"; `{best}` trains on no old rows: its start of task reads the last task's (EWC's Fisher)"
                          if methods[best]["reads_previous"] else "") + ".")
    kept = [label for label, m in methods.items() if label != ceiling and m[over].get("bwt_tasks")
            and m[over]["bwt_tasks"]["mean"] >= -points and m[over]["op_tasks"]["mean"] >= top["mean"] - points]
    lines.append(f"BWT >= -{points:g} points with OP within {points:g} points of `{ceiling}` (on the means, {where}): "
                 + (", ".join(f"`{label}`" for label in kept) if kept else "none") + ".")
    return lines


def reference_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    heads = ["published (reference, not like-for-like)", "model", "OP", "BWT", "measured on", "source"]
    return heads, [[r["method"], r["model"], f"{r['op']:.1f}", "—" if r["bwt"] is None else f"{r['bwt']:+.1f}", r["tasks"],
                    r["source"]] for r in results.extra["study"]["references"]]


def table(heads: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads), *("| " + " | ".join(r) + " |" for r in body)]


def study_markdown(results: RunResult) -> str:
    study = results.extra["study"]
    cfg = results.extra["config"]
    orders = "; ".join(f"order {k}: {' → '.join(t)}" for k, t in study["orders"].items())
    others = f"other orders: {study['seeds_per_order']} seed(s) each, their means averaged with it in 'mean over " \
             "orders'. " if len(study["orders"]) > 1 else ""
    lines = [f"Study of the `{study['stream']}` stream ({orders}) on `{results.model}`, preset "
             f"{results.preset}, precision {cfg['adapt']['precision']}, {cfg['adapt']['steps']} steps of batch "
             f"{cfg['adapt']['batch_size']} per task, {results.date}.", "",
             f"OP = mean accuracy over the tasks after the last one, BWT = mean change of each earlier task from right "
             f"after learning it to the end (< 0 = forgetting), both over the tasks alone (general ability is its own "
             f"column); general PPL change on held-out general text. Order {study['main_order']}: mean over seeds "
             f"{results.seeds}; {others}Intervals: 95 % "
             f"({study['bootstrap']['how']}; {study['bootstrap']['resamples']} replicates); {seeds_note(results)}. "
             f"lr rule: {study['lr_rule']}.",
             "", *table(*study_rows(results))]
    lines += ["", *(f"- {line}" for line in study_answers(results.to_json()))]
    if "compute" in study:  # results files from before it have none
        spent = study["compute"]
        lines += ["", f"Compute: {spent['arms']} arms (grid points and every order's seeds), {spent['wall_s'] / 3600:.1f} h "
                      f"of arm time (training and scoring, not loading) on {'; '.join(study['machines'])}; code "
                      f"fingerprint(s) {', '.join(spent['codes'])} (forgetless.config.code_fingerprint)."]
    if study["references"]:
        lines += ["", "Published rows, as reference points: other models and scales, some on other task sets (see "
                      "'measured on'); not a like-for-like comparison.", "", *table(*reference_rows(results))]
    else:
        lines += ["", f"No published rows for the `{study['stream']}` stream in the project's sources."]
    paired = [(label, m.stats["paired"]) for label, m in results.methods.items() if "paired" in m.stats]
    if paired:
        lines += ["", f"Paired differences against `{study['paired_with']}` on order {study['main_order']} (same test "
                      "rows and seeds drawn for both):", "",
                  *table(["method", "OP difference", "BWT difference", "general PPL change difference"],
                         [[label, interval(p["op_tasks"], "{:+.1f}"), interval(p.get("bwt_tasks"), "{:+.1f}"),
                           interval(p["general_ppl_change"], "{:+.1f}", 100.0) + " points"] for label, p in paired])]
    grid = [(label, m.stats["lr_grid"]) for label, m in results.methods.items() if "lr_grid" in m.stats]
    if grid:
        lines += ["", f"lr grid on order 1 (seed {study['grid_seed']}), validation rows only: validation OP / BWT per "
                      "lr, the chosen lr in bold, and each other lr's OP minus the chosen one's, paired over the "
                      "validation rows (an interval holding 0: the choice is within their sampling error); + marks "
                      "an lr the edge rule added, 'at the edge' a choice still at an end of the grid:", "",
                  *table(["method", "lr: validation OP / BWT (OP difference from the chosen)"],
                         [[label, "; ".join(grid_point(p) for p in points)] for label, points in grid])]
    lines += ["", f"Order {study['main_order']} in full (the sequence table; its ± is over seeds only):", "",
              sequence_markdown(results)]
    return "\n".join(lines) + "\n"


def grid_point(p: dict) -> str:
    """'**0.003**: 47.5 / -30.7' for the chosen point, '+0.009: 45.0 / -40.1 (-2.5 [-6.0, +1.0])' for an added one."""
    lr = ("+" if p.get("added") else "") + f"{p['lr']:.3g}"
    text = (f"**{lr}**" if p["chosen"] else lr) + f": {p['op_tasks_dev']:.1f} / " + \
        ("—" if p["bwt_tasks_dev"] is None else f"{p['bwt_tasks_dev']:+.1f}")
    if p["chosen"]:
        return text + (" (at the edge)" if p.get("edge") else "")
    return text + (f" ({interval(p['op_vs_chosen'], '{:+.1f}')})" if "op_vs_chosen" in p else "")


def terminal_tables(results: RunResult, title: str, caption: str) -> list:
    """The rich tables `forgetless study` prints: ours, then the published rows (when the stream has some)."""
    tables = []
    heads, body = reference_rows(results)
    published = (heads[:-1], [r[:-1] for r in body])  # without the source column: results.md has it
    for (heads, body), ours in ((study_rows(results), True), (published, False)):
        if body:  # our numbers right-aligned; the published rows' text left
            tables.append(rich_table(heads, body, title if ours else None, caption if ours else None, numbers=ours))
    return tables


def op_vs_bwt(results: RunResult, path: Path):
    """Accuracy (OP) against forgetting (BWT), the mean over orders (the main order where there is one), one point
    per method with its intervals."""
    methods = {label: m.stats for label, m in results.methods.items()}
    study = results.extra["study"]
    over = "over_orders" if len(study["orders"]) > 1 else "intervals"
    color = colors(list(methods))
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for label, m in methods.items():
        op, bwt = m[over]["op_tasks"], m[over].get("bwt_tasks")
        if bwt is None:
            continue
        ax.errorbar(bwt["mean"], op["mean"], xerr=[[bwt["mean"] - bwt["lo"]], [bwt["hi"] - bwt["mean"]]],
                    yerr=[[op["mean"] - op["lo"]], [op["hi"] - op["mean"]]], fmt="o", capsize=3, color=color[label],
                    label=f"{label} (lr {m['lr']:.3g})")
    ax.axvline(0, color="grey", lw=0.8, ls=":")
    name = study["stream"] if "," not in study["stream"] else "task"
    where = f"mean over {len(study['orders'])} orders" if over == "over_orders" else f"order {study['main_order']}"
    ax.set(xlabel="BWT over the tasks (points; < 0 = forgetting)  → better", ylabel="OP: accuracy after the last task (%)  ↑")
    ax.set_title(f"{name} stream, {where}, {len(results.seeds)} seed(s) on order {study['main_order']}\n95 % intervals over "
                 f"test rows{' and seeds' if len(results.seeds) > 1 else ' (one seed: not its spread)'}", fontsize=10)
    ax.legend(fontsize=7)
    save(fig, path)


def study_figures(results: RunResult, out: Path) -> list[Path]:
    """R matrices of the main order and OP against BWT."""
    study = results.extra["study"]
    r_heatmaps(r_matrices(results), out / "r_matrix.png", title=f"R of each method: order {study['main_order']} of the "
               f"{study['stream'] if ',' not in study['stream'] else 'task'} stream, mean over seeds "
               f"{results.seeds}; column 0: general text")
    op_vs_bwt(results, out / "op_vs_bwt.png")
    return [out / "r_matrix.png", out / "op_vs_bwt.png"]


# a study's results are a sequence's (its main order) with `study` beside them: their own table, no frontier
STUDY = register_report(Report("sequence", write_sequence_csv, study_markdown, study_figures, terminal_tables,
                               tasks_text, marks=("study",)))


def plan_markdown(plan: dict) -> str:
    """The compute plan as a table to paste into RESULTS: arms x estimated minutes per method."""
    orders = ", ".join(plan["orders"])
    extra = [s for s in plan["order1_seeds"] if s not in plan["seeds"]]
    lines = [f"Compute plan ({plan['date']}, {plan['threads']} thread(s), precision {plan['precision']}): per method "
             f"the lr grid on order 1 (validation rows only), then orders {orders} with seed(s) {plan['seeds']}"
             + (f" and seeds {extra} on order 1" if extra else "") + f"; {plan['tasks']} tasks of {plan['steps_per_task']} "
             f"steps of batch {plan['batch_size']}. Estimates from steps and scoring timed here (arms already saved: "
             "0 min; the orders' arms count as saved only once the grid has chosen their lr; a choice at an end of the grid "
             "adds grid arms beyond it, counted once the saved arms call for them).", "",
             "| method | lr grid | s / step | s / task besides steps | min / arm (test / validation scoring) | grid arms "
             "(left) | order arms (left) | extra-seed arms (left) | minutes left |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in plan["rows"]:
        lines.append(f"| {r['method']} | {', '.join(r['lrs']) or 'own lr'} | {r['step_s']:.2f} | "
                     f"{r['task_s'] + r['attach_s'] / plan['tasks']:.1f} | {r['arm_min']['test']:.1f} / "
                     f"{r['arm_min']['validation']:.1f} | {r['grid'][0]} ({r['grid'][1]}) | {r['orders'][0]} "
                     f"({r['orders'][1]}) | {r['extra seeds'][0]} ({r['extra seeds'][1]}) | {r['minutes']:.0f} |")
    arms = sum(r[k][0] for r in plan["rows"] for k in ("grid", "orders", "extra seeds"))
    left = sum(r[k][1] for r in plan["rows"] for k in ("grid", "orders", "extra seeds"))
    lines += [f"| scoring before training, once per run | | | | | | | | {plan['before_min']:.0f} |",
              f"| **total: {arms} arms ({left} left)** | | | | | | | | **{plan['total_min']:.0f}** "
              f"(**{plan['total_min'] / 60:.1f} h**) |"]
    return "\n".join(lines) + "\n"
