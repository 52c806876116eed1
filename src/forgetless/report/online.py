"""The online protocol's table (CSV, Markdown, terminal) and figures: prequential loss and retention
against stream position, every arm; and each arm's gain over the frozen base against its forgetting."""
from __future__ import annotations

from pathlib import Path

from forgetless.report.figures import band, colors, plt, save
from forgetless.report.kinds import Report, register_report
from forgetless.report.results import RunResult
from forgetless.report.tables import cell, domains_text, interval_lines, one_table, scaled, seeds_text, write_csv

COLUMNS = [  # (results key, header, format)
    ("prequential_loss", "prequential loss", "{:.4f}"), ("prequential_loss_a", "on A", "{:.4f}"),
    ("prequential_loss_b", "on B", "{:.4f}"), ("gain_vs_frozen", "gain vs frozen", "{:+.4f}"),
    ("gain_vs_dynamic_eval", "gain vs dynamic-eval", "{:+.4f}"), ("canary_ppl_before", "canary PPL before", "{:.3f}"),
    ("canary_ppl_after", "canary PPL after", "{:.3f}"), ("forgetting", "forgetting F", "{:+.4f}"),
    ("updates_per_s", "updates/s", "{:.1f}"), ("wall_s", "wall s", "{:.1f}"),
]
TERMINAL = [("prequential_loss", "preq. loss", "{:.4f}", 1), ("gain_vs_frozen", "vs frozen", "{:+.4f}", 1),
            ("gain_vs_dynamic_eval", "vs dyn-eval", "{:+.4f}", 1), ("forgetting", "F %", "{:+.1f}", 100),
            ("updates_per_s", "upd/s", "{:.0f}", 1)]


def online_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    """Headers and one row per arm."""
    with_std = len(results.seeds) > 1
    columns = COLUMNS
    heads = ["method"] + [h for _, h, _ in columns] + ["trainable params"]
    body = [[name] + [cell(m[k], fmt, with_std) for k, _, fmt in columns] + [f"{m.trainable_params:,}"]
            for name, m in results.methods.items()]
    return heads, body


def online_terminal_rows(results: RunResult) -> tuple[list[str], list[list[str]]]:
    """The columns that fit an 80-column terminal (no std; results.md has every column with its std)."""
    heads = ["method"] + [h for _, h, _, _ in TERMINAL]
    body = [[name] + [cell(scaled(m[k], scale), fmt, False) for k, _, fmt, scale in TERMINAL]
            for name, m in results.methods.items()]
    return heads, body


def online_markdown(results: RunResult) -> str:
    s = results.extra["stream"]
    heads, body = online_rows(results)
    lines = [f"Protocol online, preset {results.preset}: {s['chunks']} chunks of {s['chunk_tokens']} tokens, "
             f"{s['switch_chunk']} from {s['a']}, then {s['b']}; each chunk scored (prequential loss, nats/token) "
             f"before {results.extra['config']['online']['steps_per_chunk']} update(s) on it; canary = "
             f"{s['canary_windows']} held-out windows of A; gains = the baseline's mean prequential loss minus the arm's "
             f"(> 0: better); {seeds_text(results.seeds, results.base_seeds)}, {results.date}.", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    lines += interval_lines(results, [("prequential_loss", "prequential loss", 1.0), ("gain_vs_frozen", "gain vs frozen", 1.0),
                                      ("forgetting", "F %", 100.0)])
    return "\n".join(lines) + "\n"


def write_online_csv(results: RunResult, path: Path):
    write_csv(results, path, COLUMNS)


def online_figure(results: RunResult, path: Path):
    """Prequential loss per chunk (left) and canary loss (right) against tokens streamed, every arm; a dashed
    line where the stream switches from A to B."""
    methods, s = results.methods, results.extra["stream"]
    color = colors(list(methods))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, m in methods.items():
        c = m.stats["curves"]
        band(left, c["position"], c["prequential_loss"], color[name], name)
        band(right, c["canary_position"], c["canary_loss"], color[name], name)
    if 0 < s["switch_chunk"] < s["chunks"]:
        for ax in (left, right):
            ax.axvline(s["switch_chunk"] * s["chunk_tokens"], color="grey", linestyle="--", linewidth=1)
            ax.text(s["switch_chunk"] * s["chunk_tokens"], 1.0, " A → B", transform=ax.get_xaxis_transform(),
                    va="top", fontsize=8, color="grey")
    left.set(xlabel="tokens streamed", ylabel="prequential loss (nats/token)",
             title="Prequential loss: each chunk scored before it is learned")
    right.set(xlabel="tokens streamed", ylabel="canary loss (held-out A, nats/token)  ↓ better", title="Retention")
    left.legend(fontsize=8)
    fig.suptitle(f"Online protocol ({results.preset}, {len(results.seeds)} seed(s))", fontsize=10)
    save(fig, path)


def online_tradeoff(results: RunResult, path: Path):
    """One point per arm (mean ± std over seeds): gain over its frozen base (x, nats/token, → better) against
    forgetting on the canary (y, %, ↓ better), the online analogue of the two-domain scatter."""
    methods = results.methods
    color = colors(list(methods))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, m in methods.items():
        x, y = m.stats["gain_vs_frozen"], m.stats["forgetting"]
        ax.errorbar(x["mean"], 100 * y["mean"], xerr=x["std"] or 0, yerr=100 * (y["std"] or 0), fmt="o",
                    color=color[name], capsize=3, label=f"{name} ({m.trainable_params:,} trainable)")
        ax.annotate(name, (x["mean"], 100 * y["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.margins(x=0.15)
    ax.set(xlabel="gain over the frozen base (mean prequential loss, nats/token)  → better",
           ylabel="forgetting on the canary (% rise of PPL_A)  ↓ better",
           title=f"Online: learning from the stream vs retention ({results.preset}, {len(results.seeds)} seed(s))")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    save(fig, path)


def online_figures(results: RunResult, out: Path) -> list[Path]:
    online_figure(results, out / "online.png")
    online_tradeoff(results, out / "online_tradeoff.png")
    return [out / "online.png", out / "online_tradeoff.png"]


ONLINE = register_report(Report("online", write_online_csv, online_markdown, online_figures,
                                one_table(online_terminal_rows), domains_text))
