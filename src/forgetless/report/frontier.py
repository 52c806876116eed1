"""Trade-off frontiers: a method run at several values of one option (`--sweep`, `--lrs`, or arms like
lora[lr=1e-4]) is a curve, not a point. Two-domain: forgetting F against adaptation gain G; sequence:
BWT against LA (accuracy on each task just after learning it). Beside the figure, each curve's operating
points: the best G at F <= 5 % and <= 2 %, the best F at G >= 0.9 (two-domain), the best BWT at LA within
1 point of the best LA of all arms (sequence), so methods are compared at matched adaptation. The arm is
chosen on validation data where the run has it (windows, or an instruction stream's validation rows) and
reported on the held-out data. And per lr curve, F (BWT) read at G = 0.9 (at the best LA - 1) along each
seed's own curve, with paired differences between the curves: methods at equal adaptation, no arm chosen.
"""
from __future__ import annotations

from pathlib import Path

from forgetless.stats import mean_std
from forgetless.report.figures import colors, plt, save
from forgetless.report.kinds import report_for
from forgetless.report.results import MethodEntry, RunResult

F_LIMITS, G_TARGET, LA_MARGIN = (5.0, 2.0), 0.9, 1.0
MAX_PAIRED = 6  # paired differences between every two lr curves up to this many curves (15 pairs)


class Frontier:
    """A protocol's trade-off frontier: its axes, operating points and matched reading (a report declares it)."""
    adaptation_on_y = False   # the adaptation axis is y (else x; the other is retention)
    x_name, at_format = "", "g"

    def axes(self, results: RunResult) -> tuple[tuple[str, str, float], tuple[str, str, float]]:
        """((x key, x label, scale), (y key, y label, scale))."""
        raise NotImplementedError

    def points(self, arms: list[tuple], top: float, chosen_on: str) -> dict:
        """A curve's operating points from its arms (label, x, y, x held-out, y held-out; choices on x, y)."""
        raise NotImplementedError

    def at(self, results: RunResult, key: str, scale: float) -> float:
        """The adaptation (`key`, times `scale`) at which `matched` reads every curve's retention."""
        raise NotImplementedError

    def undefined(self, results: RunResult) -> str | None:
        """The axis some arm has no value of (e.g. BWT, in a sequence of one task): no frontier then."""
        for key, _, _ in self.axes(results):
            if any(m.stats.get(key, {}).get("mean") is None for m in results.methods.values()):
                return key
        return None

    def what(self, results: RunResult) -> str:
        """The retention's name in the matched tables."""
        raise NotImplementedError

    def guides(self, ax):
        """Reference lines on the figure."""


class GainFrontier(Frontier):
    """Two-domain: forgetting F (x) against adaptation gain G (y); the best G at F <= 5 % and <= 2 %, the best F at
    G >= 0.9; F read at G = 0.9."""
    adaptation_on_y, x_name = True, "G"

    def axes(self, results):
        return ("forgetting", "forgetting F on A (%)  ← better", 100.0), ("adaptation_gain", "adaptation gain G  ↑ better", 1.0)

    def points(self, arms, top, chosen_on):
        row = {f"best_g_at_f_le_{limit:g}": best([(g, g_test, label) for label, f, g, _, g_test in arms
                                                  if f <= limit], max, chosen_on) for limit in F_LIMITS}
        row[f"best_f_at_g_ge_{G_TARGET:g}"] = best([(f, f_test, label) for label, f, g, f_test, _ in arms
                                                    if g >= G_TARGET], min, chosen_on)
        return row

    def at(self, results, key, scale):
        return G_TARGET

    def what(self, results):
        return "F %"

    def guides(self, ax):
        for limit in F_LIMITS:
            ax.axvline(limit, color="grey", lw=0.6, ls=":")
        ax.axhline(G_TARGET, color="grey", lw=0.6, ls=":")


class AccuracyFrontier(Frontier):
    """Task sequence: BWT (y) against LA (x); the best BWT at LA within 1 point of the best LA of all arms; BWT read
    at that LA."""
    x_name, at_format = "LA", ".2f"

    def axes(self, results):
        bwt = "bwt_tasks" if "bwt_tasks" in next(iter(results.methods.values())).stats else "bwt"
        return ("la", "LA: accuracy on each task after learning it (%)  → better", 1.0), (bwt, f"{bwt} (< 0 = forgetting)  ↑ better", 1.0)

    def points(self, arms, top, chosen_on):
        return {"best_bwt_at_matched_la": best([(b, b_test, label) for label, la, b, _, b_test in arms
                                                if la >= top - LA_MARGIN], max, chosen_on)}

    def at(self, results, key, scale):
        return max(scale * m.stats[key]["mean"] for m in results.methods.values() if key in m.stats) - LA_MARGIN

    def what(self, results):
        return self.axes(results)[1][1].split(" ")[0]


GAIN, ACCURACY = GainFrontier(), AccuracyFrontier()


def frontier_of(results: RunResult) -> Frontier:
    """The frontier its report declares (report/kinds.py)."""
    return report_for(results).frontier


def curves(results: RunResult) -> dict[str, list[tuple[str, str, MethodEntry]]]:
    """'lora, lr' -> [(value, arm label, arm)] sorted by value, for every method run at >= 2 values of one
    option (its arm without that option counts, at its own value or the protocol's for lr and mix). The
    arms of one method that share every other option make one lr curve ('adapter[bottleneck=512], lr');
    an arm in no lr curve joins the curve of its one option ('lora, r')."""
    adapt = results.adapt
    explicit = {label: options_of(label) for label in results.methods}

    def point(label: str, option: str):
        m = results.methods[label]
        value = explicit[label][1].get(option, m.options.get(option))
        value = adapt.get(option) if value is None else value
        return None if value is None else (compact(value), label, m)

    def collect(groups: dict, key: str, labels: list[str], option: str):
        points = [p for p in (point(label, option) for label in labels) if p is not None]
        if len({number(v) if number(v) != float("inf") else v for v, _, _ in points}) >= 2:
            groups[key] = sorted(points, key=lambda p: number(p[0]))

    out, by_rest = {}, {}
    for label, (name, options) in explicit.items():
        rest = ";".join(f"{k}={v}" for k, v in options.items() if k != "lr")
        by_rest.setdefault((name, rest), []).append(label)
    for (name, rest), labels in by_rest.items():
        collect(out, f"{name}[{rest}], lr" if rest else f"{name}, lr", labels, "lr")
    in_lr = {label for points in out.values() for _, label, _ in points}
    single = {}
    for label, (name, options) in explicit.items():
        if label not in in_lr and len(options) == 1:
            single.setdefault((name, next(iter(options))), []).append(label)
    for (name, option), labels in single.items():
        plain = [name] if name in results.methods and option != "lr" else []
        collect(out, f"{name}, {option}", plain + labels, option)
    return out


def options_of(label: str) -> tuple[str, dict]:
    """'adapter[bottleneck=512;lr=3e-4]' -> ('adapter', {'bottleneck': '512', 'lr': '3e-4'})."""
    name, _, rest = label.partition("[")
    options = dict(item.partition("=")[::2] for item in rest.rstrip("]").split(";") if item)
    return name, options


def every_arm(results: RunResult) -> dict[str, list[tuple[str, str, MethodEntry]]]:
    """The curves, then every arm in none of them as a one-point group under its own label."""
    groups = curves(results)
    in_curves = {label for points in groups.values() for _, label, _ in points}
    return {**groups, **{label: [("", label, m)] for label, m in results.methods.items() if label not in in_curves}}


def operating_points(results: RunResult, frontier: Frontier | None = None) -> dict[str, dict]:
    """Per curve (and per method run at one setting): its best arms at matched forgetting or adaptation."""
    frontier = frontier or frontier_of(results)
    (xk, _, xs), (yk, _, ys) = frontier.axes(results)
    groups = every_arm(results)
    stats = {label: m.stats for label, m in results.methods.items()}
    dev = all(f"{xk}_dev" in m and f"{yk}_dev" in m for m in stats.values())
    chosen_on = "validation" if dev else "held-out"
    xc, yc = (f"{xk}_dev", f"{yk}_dev") if dev else (xk, yk)  # choices are made on validation windows
    top = max(m[xc]["mean"] for m in stats.values())
    out = {}
    for key, points in groups.items():
        arms = [(label, xs * stats[label][xc]["mean"], ys * stats[label][yc]["mean"], xs * stats[label][xk]["mean"],
                 ys * stats[label][yk]["mean"]) for _, label, _ in points]
        out[key] = frontier.points(arms, top, chosen_on)
    return out


def matched(results: RunResult, frontier: Frontier | None = None) -> dict:
    """Every lr curve's retention read at one adaptation, per seed along that seed's own curve (linear between the
    two arms around it, extrapolated past an end and counted): F at G = 0.9 (two-domain), BWT at the best arm's
    LA - 1 (sequence), on held-out and on validation values; with paired differences between curves (up to
    MAX_PAIRED curves). {} when no curve has per-seed values (runs before they were saved). The best LA
    is over every arm of the run, on a curve or not, as for the operating points."""
    frontier = frontier or frontier_of(results)
    (xk, _, xs), (yk, _, ys) = frontier.axes(results)
    (ak, a_scale), (rk, r_scale) = ((yk, ys), (xk, xs)) if frontier.adaptation_on_y else ((xk, xs), (yk, ys))
    lr_curves = {key: [m.per_seed for _, _, m in points] for key, points in curves(results).items()
                 if key.endswith(", lr") and all(m.per_seed is not None for _, _, m in points)}
    out = {}
    for split in ("", "_dev"):
        a, r = ak + split, rk + split
        arms = [seeds for curve in lr_curves.values() for seeds in curve]
        if not arms or not all(a in v and r in v for seeds in arms for v in seeds.values()):
            continue
        at = frontier.at(results, a, a_scale)
        readings = {key: read_along(ms, a, r, a_scale, r_scale, at) for key, ms in lr_curves.items()}
        keys = list(readings)
        pairs = [(one, other) for i, one in enumerate(keys) for other in keys[i + 1:]] if len(keys) <= MAX_PAIRED else []
        out["held_out" if not split else "validation"] = {
            "at": at, "curves": {k: {"value": mean_std(list(v["values"].values())), **v} for k, v in readings.items()},
            "paired": {f"{one} − {other}": mean_std([readings[one]["values"][s] - readings[other]["values"][s]
                                                     for s in readings[one]["values"] if s in readings[other]["values"]])
                       for one, other in pairs}}
    return out


def read_along(arms: list[dict], x: str, y: str, xs: float, ys: float, at: float) -> dict:
    """{'values': {seed: metric y (times ys) where metric x (times xs) = at}, 'extrapolated': how many seeds'
    curves do not reach `at`, 'beyond': {seed: how far `at` lies past that seed's curve}, 'not_monotone': how
    many seeds' x does not grow (or fall) steadily along `arms` (their per-seed values, in lr order)}. A seed's
    curve is its arms ordered by x (for a curve whose x does not grow with the lr, neighbours in x, not in lr:
    such a reading may join two lrs that are not neighbours, hence the count)."""
    seeds = set.intersection(*(set(m) for m in arms))
    values, beyond, not_monotone = {}, {}, 0
    for seed in sorted(seeds):
        along = [m[seed][x] for m in arms]
        steps = [b - a for a, b in zip(along, along[1:])]
        not_monotone += not (all(d >= 0 for d in steps) or all(d <= 0 for d in steps))
        points = sorted((xs * m[seed][x], ys * m[seed][y]) for m in arms)
        (x0, y0), (x1, y1) = next((pair for pair in zip(points, points[1:]) if at <= pair[1][0]), points[-2:])
        values[seed] = y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
        if not points[0][0] <= at <= points[-1][0]:
            beyond[seed] = min(abs(at - points[0][0]), abs(at - points[-1][0]))
    return {"values": values, "extrapolated": len(beyond), "beyond": beyond, "not_monotone": not_monotone}


def best(candidates: list[tuple[float, float, str]], pick, chosen_on: str) -> dict | None:
    """The best candidate (score on the split choices use, held-out value, arm) by its first entry:
    {'value': held-out value, 'chosen_value', 'chosen_on', 'arm'}; None when no arm qualifies."""
    if not candidates:
        return None
    chosen, value, arm = pick(candidates, key=lambda c: c[0])
    return {"value": value, "arm": arm, "chosen_value": chosen, "chosen_on": chosen_on}


def frontier_figure(results: RunResult, path: Path, frontier: Frontier | None = None) -> bool:
    """Every arm as a point (± std over seeds both ways); the arms of one sweep joined in order of value."""
    if not curves(results):
        return False
    frontier = frontier or frontier_of(results)
    (xk, xlabel, xs), (yk, ylabel, ys) = frontier.axes(results)
    groups = every_arm(results)
    color = colors(list(groups))
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for key, points in groups.items():
        ms, curve = [m.stats for _, _, m in points], len(points) > 1
        x, y = [xs * m[xk]["mean"] for m in ms], [ys * m[yk]["mean"] for m in ms]
        ax.errorbar(x, y, xerr=[xs * m[xk]["std"] for m in ms], yerr=[ys * m[yk]["std"] for m in ms],
                    marker="o" if curve else "s", linestyle="-" if curve else "none", capsize=2, color=color[key],
                    label=key)
        for (value, _, _), px, py in zip(points, x, y):
            if curve:
                ax.annotate(value, (px, py), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color[key])
    frontier.guides(ax)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"Trade-off frontier ({results.preset}, "
                                               f"{len(results.seeds)} seed(s); bars: ± std over seeds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    save(fig, path)
    return True


def frontier_markdown(points: dict[str, dict]) -> list[str]:
    """The operating points as a Markdown table ('—': no arm qualifies)."""
    heads = list(next(iter(points.values())))
    names = {f"best_g_at_f_le_{limit:g}": f"best G at F ≤ {limit:g} %" for limit in F_LIMITS}
    names |= {f"best_f_at_g_ge_{G_TARGET:g}": f"best F % at G ≥ {G_TARGET:g}",
              "best_bwt_at_matched_la": f"best BWT at LA ≥ best LA − {LA_MARGIN:g}"}
    chosen_on = {cell["chosen_on"] for row in points.values() for cell in row.values() if cell}
    lines = ["", f"Operating points (arm means on held-out windows; arms chosen on {' and '.join(sorted(chosen_on)) or 'no'} "
             "windows; '—': no arm qualifies):", "",
             "| method | " + " | ".join(names[h] for h in heads) + " |", "|" + "---|" * (len(heads) + 1)]
    for key, row in points.items():
        cells = ["—" if row[h] is None else f"{row[h]['value']:.3g} (`{row[h]['arm']}`)" for h in heads]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def matched_markdown(results: RunResult, frontier: Frontier | None = None) -> list[str]:
    """The readings of `matched` as Markdown: per curve mean ± 95 % interval, then the paired differences."""
    frontier = frontier or frontier_of(results)
    splits, what = results.extra["matched"], frontier.what(results)
    ats = ", ".join(f"{frontier.x_name} = {v['at']:{frontier.at_format}} ({k.replace('_', '-')})"
                    for k, v in splits.items())
    heads = list(splits)

    def table(title: str, first: str, part: str, cell) -> list[str]:
        return ["", title, "", f"| {first} | " + " | ".join(h.replace("_", "-") for h in heads) + " |",
                "|" + "---|" * (len(heads) + 1)] + \
            [f"| {key} | " + " | ".join(cell(splits[h][part][key]) for h in heads) + " |" for key in splits[heads[0]][part]]

    lines = table(f"At matched adaptation: {what} read at {ats} along each seed's lr curve (linear between the two lrs "
                  "around it; `+n` = n seeds extrapolated past the curve's end; `!n` = n seeds whose adaptation is not "
                  "monotone in the lr, so the reading may join lrs that are not neighbours), mean (95 % interval "
                  "over seeds):",
                  "curve", "curves", lambda reading: interval(reading["value"]) + reading_marks(reading))
    if splits[heads[0]]["paired"]:
        lines += table(f"Paired differences of those readings, seed by seed (each seed's own bases, one per base "
                       f"kind), {what}:", "curves", "paired", lambda stat: interval(stat, sign=True))
    return lines


def interval(stat: dict, sign: bool = False) -> str:
    """'15.61 (14.35 to 16.87)'; signed for differences: '+5.06 (+3.58 to +6.54)'."""
    fmt = "{:+.2f}" if sign else "{:.2f}"
    text = fmt.format(stat["mean"])
    if stat.get("ci95") is None:
        return text
    return f"{text} ({fmt.format(stat['mean'] - stat['ci95'])} to {fmt.format(stat['mean'] + stat['ci95'])})"


def reading_marks(reading: dict) -> str:
    """' +n' (seeds extrapolated) and ' !n' (seeds not monotone in the lr) after a reading."""
    marks = f" +{reading['extrapolated']}" if reading["extrapolated"] else ""
    return marks + (f" !{reading['not_monotone']}" if reading.get("not_monotone") else "")


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")


def compact(value) -> str:
    """An option value as a sweep writes it: 0.001 -> '1e-3' (so a curve's labels share one format)."""
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}" if float(f"{mantissa}e{exponent}") == value else f"{value:g}"
    return str(value)


def same(a, b) -> bool:
    return number(str(a)) == number(str(b)) if number(str(a)) != float("inf") else str(a) == str(b)
