"""Which method, when: what a user has -> the method and its exact settings in transformers' `Trainer` and in
`forgetless adapt`, each row with the scale it was measured at and its section of the results (docs/results/).
`forgetless methods` prints it, `forgetless adapt` takes its default method from it, the README shows it as a
decision table and docs/methods.md its numbers (scripts/sync_docs.py).

The rows on a stream of tasks are generated from the standard study (`forgetless study standard`) once its
summary `STUDY` exists (`python scripts/guide_evidence.py STUDY_FOLDER` writes it from the study's results.json);
until then the hand-written row marked `stream` below stands for its side."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RESULTS = "docs/results"  # the results' pages; a row's evidence is RESULTS/PAGE.md#anchor
STUDY = Path(__file__).with_name("guide_study.json")  # the standard study's summary (`summary`), when it has run


@dataclass(frozen=True)
class Advice:
    situation: str  # what the user has and wants
    method: str     # a method spec (`forgetless adapt --method`, `forgetless.attach`)
    old_data: bool  # the user has rows of what the model should keep (--retain, forgetless.data.mix)
    scale: str      # where it was measured: model, data or stream, budget, seeds
    evidence: str   # what was measured there (docs/methods.md shows it)
    section: str    # its section of the results: "PAGE.md#anchor", PAGE a page of docs/results/
    stream: bool = False  # a stream of tasks: replaced by the standard study's row once it has run


MEASURED = [
    Advice("old data (a sample of what the model should keep), one new domain", "seq-lora", True,
           "SmolLM2-135M-Instruct, 4-task stream, 3 seeds",
           "measured on a stream (a study of one domain with old rows is still to run): BWT +14.7 points (95 % +7.1 "
           "to +22.3) over the same LoRA without replay (20 % old rows), learning accuracy -0.2 (-3.3 to +3.0); "
           "seed-only intervals on 50 test rows per task; general-text perplexity still rose 24.6 % (replaying "
           "tasks does not protect general text). For one domain seq-lora and lora are the same",
           "real-models.md#replay-on-three-seeds-sequential-lora-with-20--of-each-batch-from-the-earlier-tasks-"
           "2026-11-25"),
    Advice("old data, and the least forgetting at a given adaptation", "ewc-distill[beta=0.5;mix=0.3;lam=300]", True,
           "byte-level GPT (0.84 M), one spelling pair, 200 steps",
           "at lr 1e-3 (the byte GPT's; on a pretrained model it starts at 5e-5, untested there); the KL term acts on "
           "the old rows, EWC's Fisher is taken on them; beta, mix, lam and lr chosen in 7 rounds of search on these "
           "windows: on 3 fresh bases forgetting 1.04 % at adaptation 0.923 held out, 1.55 % on validation (every "
           "seed < 2 %); over all 6 seeds 2 are above 2 % on validation. Re-tune on your own validation rows",
           "two-domain.md#ewc-with-distillation-and-apn-local-with-replay-2026-11-25"),
    Advice("old general text, a general-purpose model whose general perplexity must hold", "neutral", True,
           "SmolLM2-135M-Instruct, prose -> First Folio, 1 seed",
           "an l1 term on the adapters' output acts on the old rows; lr chosen there on validation windows: adapts "
           "at LoRA's pace (G 0.671 vs 0.627), old-text perplexity -3.3 % where LoRA's rose 0.7 %, but it replays "
           "old rows (LoRA did not) and trains 58x LoRA's parameters; on a 4-task stream (2 seeds, before its input "
           "scaling and lr were set) general perplexity +1.6 / +2.2 % where LoRA's rose 23-33 %, its tasks "
           "forgetting like LoRA's; the gates open on old text too",
           "real-models.md#neutral-residues-at-loras-pace-on-a-pretrained-model-input-scale-and-lr-2026-11-26-"
           "one-seed"),
    Advice("no old data, one new domain", "full[lr=5e-5]", False,
           "SmolLM2-135M-Instruct, prose -> First Folio, 1 seed, 32 steps of batch 8",
           "longer training untested; 18 held-out windows of the old text: forgetting -0.7 % at 5e-5, +4.8 % at "
           "1e-4, +16.1 % at 2e-4; LoRA (1e-3, 3e-3) was worse on both axes",
           "real-models.md#a-pair-where-fine-tuning-forgets-past-its-default-lr-general-prose--shakespeares-first-"
           "folio-on-smollm2-135m-2026-11-25-one-seed"),
    Advice("no old data, a stream of tasks, few trainable parameters", "moram[lr=5e-3]", False,
           "SmolLM2-135M-Instruct, 4-task stream, 3 seeds",
           "BWT -5.1 +/- 4.3 vs LoRA's -17.8 +/- 2.0 (its lr chosen after seeing test scores; LoRA at its default "
           "lr only); learning accuracy not resolved (-1.7, -15.5 to +12.2); not distinguishable from replay, "
           "which needs old data; grows 460,800 parameters per task",
           "real-models.md#seeds-1-and-2-sequential-lora-against-moramlr5e-3-2026-11-25", stream=True),
]


# ---- rows from a study ------------------------------------------------------------------------------
def study_rows(results: dict, section: str) -> list[Advice]:
    """A study's results.json (or its `summary`) -> its rows: with old data and without, the arm with the highest
    OP (mean over orders) among those that need earlier tasks' rows (report.study.uses_old_rows: replay, EWC's
    Fisher) and among those that do not, beside the joint ceiling and the runner-up (OP paired over the same rows);
    its method is the arm (at the lr the study chose, and the mix it trained at); none for a group the study did not
    run."""
    from forgetless.methods.base import MethodSpec, parse_method_specs
    from forgetless.report.study import uses_old_rows
    methods, study = results["methods"], results["study"]
    over = "over_orders" if len(study["orders"]) > 1 else "intervals"
    ceiling = [label for label, m in methods.items() if m["joint"]]
    rows = []
    for old in (True, False):
        group = [label for label, m in methods.items() if label not in ceiling and uses_old_rows(m, results) == old]
        group.sort(key=lambda label: -methods[label][over]["op_tasks"]["mean"])  # ties keep the study's order
        if not group:
            continue
        m = methods[group[0]]
        stat = m[over]
        parts = [f"OP {interval(stat['op_tasks'])}", *([f"BWT {interval(stat['bwt_tasks'], '+')}"] if
                                                       stat.get("bwt_tasks") else []),
                 f"general perplexity {interval(stat['general_ppl_change'], '+', 100)} %"]
        where = "mean over orders" if over == "over_orders" else f"order {study['main_order']}"
        text = f"{', '.join(parts)} ({where}; lr {m['lr']:.3g}"
        text += f", chosen on validation rows{edge_text(m)})" if study.get("lr_grid") else ", its own)"
        text += grid_text(m)
        text += f"; {m['trainable_params'] / 1e6:.2f} M trainable parameters on the last task" if m.get(
            "trainable_params") else ""
        text += "".join(f"; the ceiling {c}: OP {interval(methods[c][over]['op_tasks'])}" for c in ceiling)
        if len(group) > 1:
            runner = methods[group[1]][over]
            gap = study["op_differences"]["pairs"][group[0]][group[1]]
            text += (f"; next {group[1]}: OP {interval(runner['op_tasks'])} (paired difference "
                     f"{interval(gap, '+')}{', not separated' if gap['lo'] <= 0 else ''}), "
                     f"general perplexity {interval(runner['general_ppl_change'], '+', 100)} %")
        if m["reads_previous"]:
            text += "; it trains on no old rows: each task's start reads the last task's rows (its Fisher)"
        (spec,) = parse_method_specs(m["arm"])
        if old and m["options"].get("mix") is None:  # the study's mix, which adapt would otherwise set (REPLAY)
            spec = MethodSpec(spec.name, {**spec.options, "mix": f"{results['config']['adapt']['mix']:g}"})
        rows.append(Advice("old data (rows of the earlier tasks), a stream of tasks" if old else
                           "no old data, a stream of tasks", spec.label, old, scale(results), text, section, stream=True))
    return rows


def edge_text(m: dict) -> str:
    """', at the grid's top end: a higher lr was not tried' where the chosen lr is still at an end of its grid."""
    points = m.get("lr_grid") or []
    chosen = next((p for p in points if p["chosen"]), None)
    if chosen is None or not chosen.get("edge"):
        return ""
    end = "top" if chosen["lr"] == max(p["lr"] for p in points) else "bottom"
    return f", at the grid's {end} end: a {'higher' if end == 'top' else 'lower'} lr was not tried"


def grid_text(m: dict) -> str:
    """What the lr grid adds for a user who must keep general text: another lr tied with the chosen one on validation
    OP (the rule takes the lower), and the nearest lower lr within the validation rows' sampling error of it (its
    paired OP difference holds 0) where validation general perplexity rose less."""
    points = m.get("lr_grid") or []
    chosen = next((p for p in points if p["chosen"]), None)
    if chosen is None or chosen.get("general_ppl_change_dev") is None:
        return ""

    def ppl(p: dict) -> str:
        return (f"validation general perplexity rose {100 * p['general_ppl_change_dev']:+.1f} % against "
                f"{100 * chosen['general_ppl_change_dev']:+.1f} %")
    others = [p for p in points if not p["chosen"] and p.get("general_ppl_change_dev") is not None]
    tied = [p for p in others if p.get("op_tasks_dev") is not None and chosen.get("op_tasks_dev") is not None
            and abs(p["op_tasks_dev"] - chosen["op_tasks_dev"]) <= 1e-9]
    text = "".join(f"; tied on validation OP with lr {p['lr']:.3g} (ties go to the lower lr), where {ppl(p)}"
                   for p in tied)
    near = [p for p in others if p not in tied and p["lr"] < chosen["lr"] and p.get("op_vs_chosen")
            and p["op_vs_chosen"]["hi"] >= 0 and p["general_ppl_change_dev"] < chosen["general_ppl_change_dev"]]
    if near:
        lower = max(near, key=lambda p: p["lr"])
        text += (f"; at lr {lower['lr']:.3g}, within the validation rows' sampling error of it (OP "
                 f"{interval(lower['op_vs_chosen'], '+')}), {ppl(lower)}")
    return text


def interval(stat: dict, sign: str = "", scale: float = 1.0) -> str:
    """'43.2 [38.1, 48.0]' from {mean, lo, hi}; sign '+' prints signs."""
    return "{0:{s}.1f} [{1:{s}.1f}, {2:{s}.1f}]".format(*(scale * stat[k] for k in ("mean", "lo", "hi")), s=sign)


def scale(results: dict) -> str:
    """The scale a study ran at: model, stream and orders, preset and budget per task, seeds."""
    study, adapt = results["study"], results["config"]["adapt"]
    extra = len(study["order1_seeds"]) - study["seeds_per_order"]
    return (f"{results['model']}, {study['stream'] if ',' not in study['stream'] else 'a task'} stream, "
            f"{len(study['orders'])} order(s) of {len(next(iter(study['orders'].values())))} tasks, preset "
            f"{results['preset']} ({adapt['steps']} steps of batch {adapt['batch_size']} per task, "
            f"{adapt['precision']}), {study['seeds_per_order']} seed(s) per order"
            + (f", {extra} more on order 1" if extra > 0 else ""))


PROVENANCE = ("forgetless_version", "git_commit", "device", "torch", "precision", "date")


def summary(results: dict, command: str, made: dict) -> dict:
    """The part of a study's results.json the guide reads, with where it came from: `command` (the study's),
    `made` (how this summary was made: its command, commit, machine, date)."""
    keep = ("method", "options", "arm", "lr", "joint", "reads_previous", "trainable_params", "intervals",
            "over_orders")
    return {"guide_summary": {"study_command": command, **made},
            **{k: results[k] for k in ("model", "preset", "seeds", *PROVENANCE) if k in results},
            "config": {"adapt": results["config"]["adapt"]},
            "study": {k: results["study"][k] for k in ("stream", "orders", "main_order", "seeds_per_order",
                                                         "order1_seeds", "lr_grid", "lr_rule", "op_differences")},
            "methods": {label: {**{k: m[k] for k in keep if k in m},  # of the grid: the choice, the others' gap to it
                                **({"lr_grid": [{k: p.get(k) for k in ("lr", "chosen", "edge", "op_tasks_dev",
                                                                      "op_vs_chosen", "general_ppl_change_dev")}
                                                for p in m["lr_grid"]]}
                                   if "lr_grid" in m else {})}
                        for label, m in results["methods"].items()}}


def guide_rows(study: dict | None) -> list[Advice]:
    """`MEASURED` with `study`'s rows (a `summary`): each replaces the hand-written stream row of its side (old data
    or not), or where that side has none, follows its first row (which stays `forgetless adapt`'s default)."""
    if study is None:
        return MEASURED
    generated = {a.old_data: a for a in study_rows(study, study["guide_summary"]["section"])}
    rows = []
    for a in MEASURED:  # a hand-written stream row gives way to the study's row of its side
        rows.append(generated.pop(a.old_data) if a.stream and a.old_data in generated else a)
    for old, advice in generated.items():  # the sides without one
        first = next(i for i, a in enumerate(rows) if a.old_data == old)
        rows.insert(first + 1, advice)
    return rows


GUIDE = guide_rows(json.loads(STUDY.read_text()) if STUDY.exists() else None)


# ---- settings -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    attach: str     # the spec for forgetless.attach, without lr and mix (in Trainer they do not act)
    lr: float       # TrainingArguments(learning_rate=...)
    mix: float      # forgetless.data.mix(new, old, mix): the fraction of old rows in the batches
    previous: bool  # ForgetlessCallback(adapted, previous=old): its start of task reads old rows (EWC's Fisher)


def settings(advice: Advice) -> Settings:
    """What `forgetless adapt --data` trains the row's method at (preset real; with --retain where the row has old
    data), as Trainer takes it."""
    from forgetless.continual.user_adapt import data_config
    from forgetless.methods.base import MethodSpec, parse_method_specs
    from forgetless.presets import build_config
    cfg = build_config("real")
    (spec,) = parse_method_specs(advice.method)
    method = spec.build(cfg.methods.get(spec.name))
    adapt = data_config(method, cfg.adapt, advice.old_data)
    bare = MethodSpec(spec.name, {k: v for k, v in spec.options.items() if k.split(".")[-1] not in ("lr", "mix")})
    return Settings(bare.label, adapt.lr, adapt.mix, method.needs_previous)


def short(value: float) -> str:
    """1e-3, 5e-5, 0.2: as a user types it."""
    if value >= 0.01 or value == 0:
        return f"{value:g}"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def trainer_text(s: Settings) -> str:
    """The row's settings in Trainer, as code."""
    parts = [f'attach(model, "{s.attach}")', f"learning_rate={short(s.lr)}"]
    parts += [f"mix(new, old, {short(s.mix)})"] if s.mix else ["train_dataset=new"]
    return ", ".join(f"`{p}`" for p in parts + (["previous=old"] if s.previous else []))


def cli_text(advice: Advice) -> str:
    """The row's `forgetless adapt` flags (the spec's lr and mix act there)."""
    method = f"'{advice.method}'" if "[" in advice.method else advice.method
    return f"`--method {method}" + (" --retain old.txt`" if advice.old_data else "`")


def advice_for(has_old_data: bool) -> Advice:
    """The first row for a user with (or without) old data: `forgetless adapt`'s default."""
    return next(a for a in GUIDE if a.old_data == has_old_data)

