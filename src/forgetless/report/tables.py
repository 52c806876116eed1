"""results.json -> results.csv and results.md (one row per method)."""
from __future__ import annotations

import csv
from pathlib import Path

from forgetless.report.results import RunResult

COLUMNS = [  # (results key, header, format)
    ("ppl_a_before", "PPL_A before", "{:.3f}"), ("ppl_a_after", "PPL_A after", "{:.3f}"),
    ("ppl_b_before", "PPL_B before", "{:.3f}"), ("ppl_b_after", "PPL_B after", "{:.3f}"),
    ("forgetting", "forgetting F", "{:+.4f}"), ("adaptation_gain", "gain G", "{:.3f}"),
    ("acc_a_after", "acc_A after", "{:.4f}"), ("acc_b_after", "acc_B after", "{:.4f}"),
    ("wall_s", "wall s", "{:.1f}"),
]


def cell(stat: dict, fmt: str, with_std: bool) -> str:
    if stat["mean"] is None:
        return "n/a"
    text = fmt.format(stat["mean"])
    return f"{text} ± {fmt.format(stat['std']).lstrip('+')}" if with_std else text


def rows(results: RunResult) -> list[list[str]]:
    with_std = len(results.seeds) > 1
    out = []
    for name, m in results.methods.items():
        share = m.trainable_params / m.total_params
        out.append([name] + [cell(m[k], fmt, with_std) for k, _, fmt in COLUMNS]
                   + [f"{m.trainable_params:,} ({share:.1%})", f"{m.peak_rss_mb:.0f}"])
    return out


def headers() -> list[str]:
    return ["method"] + [h for _, h, _ in COLUMNS] + ["trainable params", "peak RSS MB"]


def terminal_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    """The columns a user reads first, narrow enough for a 100-column terminal (F in %, trainable
    params without their share); results.md has them all."""
    with_std = len(results.seeds) > 1
    body = [[name, cell(scaled(m.stats["forgetting"], 100), "{:+.1f}", with_std),
             cell(m.stats["adaptation_gain"], "{:.3f}", with_std), cell(m.stats["ppl_b_after"], "{:.3f}", with_std),
             f"{m.trainable_params:,}"] for name, m in results.methods.items()]
    return ["method", "F %", "gain G", "PPL_B after", "trainable params"], body


def scaled(stat: dict, factor: float) -> dict:
    return {k: None if v is None else factor * v for k, v in stat.items()}


def seeds_text(seeds: list[int], base_seeds: int | None = 1) -> str:
    """Which seeds the numbers cover and which variance their ± includes."""
    if len(seeds) == 1:
        return f"one seed ({seeds[0]}): no std"
    if base_seeds and base_seeds > 1:
        bases = sorted({s % base_seeds for s in seeds})  # arm seed s adapts base s mod base_seeds
        if len(bases) == len(seeds):
            return (f"seeds {seeds} (mean ± std over seeds, each seed on its own pretrained base: {len(bases)} bases, "
                    f"pretraining seeds {bases})")
        return f"seeds {seeds} (mean ± std over seeds on {len(bases)} pretrained bases: seed s adapts base s mod {base_seeds})"
    return f"seeds {seeds} (mean ± std over adaptation seeds on one pretrained base)"


def interval_lines(results: RunResult, keys: list[tuple[str, str, float]]) -> list[str]:
    """A table of 95 % intervals of the mean (`ci95` of each stat) for `keys` (key, header, scale); none with
    one seed or from files written before intervals existed."""
    methods = results.methods
    if len(results.seeds) < 2 or not any("ci95" in (m.get(k) or {}) for m in methods.values() for k, _, _ in keys):
        return []
    lines = ["", f"95 % intervals of the mean (Student t over {len(results.seeds)} seeds; "
                 f"{seeds_text(results.seeds, results.base_seeds).split('(', 1)[1].rstrip(')')}):", "",
             "| method | " + " | ".join(h for _, h, _ in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for name, m in methods.items():
        cells = [f"{scale * m[k]['mean']:.4g} ± {scale * m[k]['ci95']:.2g}" if (m.get(k) or {}).get("ci95") is not None
                 else "—" for k, _, scale in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def rich_table(heads: list[str], body: list[list[str]], title: str | None = None, caption: str | None = None,
               numbers: bool = True):
    """A rich table for the terminal: the first column (the method) keeps the width of its labels (up to 24
    characters) however narrow the terminal; other cells wrap at their spaces ("41.67 ±" over "0.00") rather than
    lose digits. `numbers`: the other columns right-aligned."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, caption=caption)
    labels = max((len(r[0]) for r in body), default=0)
    for i, h in enumerate(heads):
        table.add_column(h, justify="right" if numbers and i else "left", overflow="fold",
                         min_width=None if i else min(max(labels, len(h)), 24))
    for r in body:
        table.add_row(*map(escape, r))  # method specs such as ewc[lam=1e4] look like markup
    return table


def one_table(rows_of):
    """A report's `terminal`: one rich table of `rows_of(results)`'s (headers, rows)."""
    return lambda results, title, caption: [rich_table(*rows_of(results), title, caption)]


def domains_text(results: RunResult) -> str:
    """'A=x → B=y': what a two-domain or online run learned."""
    return f"A={results.extra['domains']['a']} → B={results.extra['domains']['b']}"


def tasks_text(results: RunResult) -> str:
    """'a → b → c': what a task sequence learned."""
    return " → ".join(results.extra["tasks"])


def markdown(results: RunResult) -> str:
    domains = results.extra["domains"]
    lines = [f"Protocol {results.protocol}, preset {results.preset}, domains "
             f"A = `{domains['a']}`, B = `{domains['b']}`, {seeds_text(results.seeds, results.base_seeds)}, "
             f"{results.date}.", "",
             "| " + " | ".join(headers()) + " |", "|" + "---|" * len(headers())]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    lines += interval_lines(results, [("forgetting", "F %", 100.0), ("adaptation_gain", "G", 1.0),
                                      ("ppl_b_after", "PPL_B after", 1.0)])
    if results.extra.get("pretraining"):
        lines += ["", "Pretraining on A with each optimizer (mean ± std over pretraining seeds):", "",
                  "| optimizer | final held-out PPL_A | training loss, last 100 steps | wall s |", "|---|---|---|---|"]
        lines += [f"| {name} | {cell(r['final_ppl_a'], '{:.3f}', True)} | {cell(r['final_loss'], '{:.4f}', True)} | "
                  f"{cell(r['wall_s'], '{:.0f}', True)} |" for name, r in results.extra["pretraining"].items()]
    return "\n".join(lines) + "\n"


def write_csv(results: RunResult, path: Path, columns: list | None = None):
    """One row per arm: mean and std of each column's stat (default: the two-domain `COLUMNS`), then sizes."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        keys = [k for k, *_ in (columns or COLUMNS)]
        writer.writerow(["method"] + [f"{k}_{s}" for k in keys for s in ("mean", "std")]
                        + ["trainable_params", "total_params", "peak_rss_mb"])
        for name, m in results.methods.items():
            writer.writerow([name] + [m[k][s] for k in keys for s in ("mean", "std")]
                            + [m.trainable_params, m.total_params, m.peak_rss_mb])


SEQUENCE_COLUMNS = [("op", "OP", "{:.2f}"), ("op_tasks", "OP tasks 1..T", "{:.2f}"), ("bwt", "BWT (GEM)", "{:+.2f}"),
                    ("bwt_drop", "drop (MoRAM BWT)", "{:+.2f}"), ("bwt_tasks", "BWT tasks", "{:+.2f}"),
                    ("bwt_drop_clipped", "drop clipped (tasks)", "{:.2f}"),
                    ("forgetting", "forgetting", "{:.2f}"), ("forgetting_tasks", "forgetting tasks", "{:.2f}"),
                    ("la", "LA", "{:.2f}"), ("fwt", "FWT", "{:+.2f}"),
                    ("general_ppl_change", "general PPL change", "{:+.1%}"), ("wall_s", "wall s", "{:.1f}")]


def sequence_columns(results: RunResult) -> list[tuple[str, str, str]]:
    """The columns this results.json has (older files lack later additions such as bwt_drop)."""
    first = next(iter(results.methods.values()))
    return [c for c in SEQUENCE_COLUMNS if c[0] in first]


def sequence_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    with_std = len(results.seeds) > 1
    columns = sequence_columns(results)
    heads = ["method"] + [h for _, h, _ in columns] + ["trainable params"]
    body = [[name] + [cell(m[k], fmt, with_std) for k, _, fmt in columns] + [f"{m.trainable_params:,}"]
            for name, m in results.methods.items()]
    return heads, body


SEQUENCE_TERMINAL = ["method", "OP", "OP tasks 1..T", "BWT (GEM)", "BWT tasks", "LA", "FWT", "general PPL change",
                     "trainable params"]


def sequence_terminal_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    """The sequence columns that fit a terminal (those this run has; on instruction streams the task-only
    OP and BWT replace those with general ability as task 0); results.md has them all."""
    heads, body = sequence_rows(results)
    wanted = [h for h in SEQUENCE_TERMINAL if h in heads]
    if "OP tasks 1..T" in heads:
        wanted = [h for h in wanted if h not in ("OP", "BWT (GEM)")]
    keep = [heads.index(h) for h in wanted]
    return [heads[i] for i in keep], [[r[i] for i in keep] for r in body]


def sequence_markdown(results: RunResult) -> str:
    heads, body = sequence_rows(results)
    tasks = " -> ".join(f"`{t}`" for t in results.extra["tasks"])
    lines = [f"Protocol sequence, preset {results.preset}, tasks {tasks}, "
             f"{seeds_text(results.seeds, results.base_seeds)}, score: {results.extra['score']}; BWT (GEM sign) < 0 = forgetting; "
             f"drop = -BWT, the sign of the MoRAM source's BWT column (> 0 = forgetting); "
             f"{results.date}.", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    lines += interval_lines(results, [(k, h, 1.0) for k, h in (("op_tasks", "OP tasks 1..T"), ("bwt_tasks", "BWT tasks"),
                                                               ("la", "LA")) if k in next(iter(results.methods.values()))])
    for name, m in results.methods.items():
        rows = "rows 1..T = after learning all tasks at once (a joint arm: bwt_tasks 0, FWT n/a by definition)" \
            if m.stats.get("joint") else "row t = after task t"
        r = m.stats["r_matrix"]
        lines += ["", f"R matrix of `{name}` ({rows}, column i = task i):", "",
                  "| after \\ task | " + " | ".join(str(i) for i in range(len(r))) + " |", "|" + "---|" * (len(r) + 1)]
        lines += [f"| {t} | " + " | ".join("–" if v is None else f"{v:.2f}" for v in row) + " |" for t, row in enumerate(r)]
    return "\n".join(lines) + "\n"


def write_sequence_csv(results: RunResult, path: Path):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        keys = [k for k, _, _ in sequence_columns(results)]
        writer.writerow(["method"] + [f"{k}_{s}" for k in keys for s in ("mean", "std")] + ["trainable_params", "total_params"])
        for name, m in results.methods.items():
            writer.writerow([name] + [m[k][s] for k in keys for s in ("mean", "std")] + [m.trainable_params, m.total_params])
