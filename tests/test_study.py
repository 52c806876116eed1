"""`forgetless study`: named streams and orders, the validation split, the lr grid and its rule, bootstrap
intervals over test rows and seeds, the table with published rows, the figures and the compute plan, on a tiny
random Llama and a fake two-task stream written to tmp_path."""
import json
import re
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from forgetless.cli import app
from forgetless.continual import bootstrap
from forgetless.continual.instruct import load_stream, scored_on, split_dev
from forgetless.continual import instruct
from forgetless.config import stable_hash
from forgetless.continual.plan import saved_arm
from forgetless.continual.study import (choose, fit_budget, grid_lrs, next_point, parse_budget, parse_grid, plan_study,
                                       run_order, run_study)
from forgetless.data.instructions import Example, InstructionTask, load_task
from forgetless.data.streams import EDGE_STEPS, STREAMS, pick_orders, stream_orders
from forgetless.device import machine_text
from forgetless.errors import ForgetlessError
from forgetless.guide import MEASURED, Settings, cli_text, guide_rows, settings, study_rows, summary
from forgetless.methods.base import parse_method_specs
from forgetless.presets import build_config
from forgetless.report import write_report
from forgetless.report.references import references
from forgetless.report.study import plan_markdown, seeds_note, study_answers, study_markdown, terminal_tables
from forgetless.report.study import study_rows as table_rows
from tiny_lm import tiny_llama, tiny_tokenizer
from tiny_results import round_trips

pytestmark = pytest.mark.usefixtures("one_thread")


def write_task(folder, name, labels, train=24, test=10):
    """A classification task whose answer follows the item number; its last training prompt repeats an earlier one
    (so the validation split must leave it out) and its first test prompt repeats a training one (left out of test)."""
    rows = [{"prompt": f"{name} item {i}: which one?", "answer": labels[(7 * i) % len(labels)]} for i in range(train)]
    rows[-1] = dict(rows[0])
    tests = [{"prompt": f"{name}  item 3: which one?", "answer": rows[3]["answer"]}] + \
        [{"prompt": f"{name} item {i}: which one?", "answer": labels[(7 * i) % len(labels)]} for i in range(500, 500 + test)]
    (folder / name).mkdir()
    for part, records in (("train", rows), ("test", tests)):
        (folder / name / f"{part}.json").write_text(json.dumps(records))
    (folder / name / "labels.json").write_text(json.dumps(labels))
    return str(folder / name)


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    a, b = write_task(folder, "colors", ["red", "green", "blue"]), write_task(folder, "sizes", ["small", "large"])
    (folder / "general.txt").write_text(" ".join(f"The river flows past mill {i}; bread is baked at dawn."
                                                 for i in range(250)))
    cfg = build_config("real", {"model": {"block_size": 32}, "adapt": {"steps": 2, "batch_size": 4, "ckpt_every": 2,
                                                                       "warmup": 1},
                                "data": {"general": str(folder / "general.txt"), "eval_windows": 4, "train_examples": 0,
                                         "test_rows": 0, "dev_rows": 5, "held_out_tasks": []}})
    return {"folder": folder, "a": a, "b": b, "cfg": cfg, "spec": f"{a},{b};{b},{a}", "tok": tiny_tokenizer()}


@pytest.fixture(scope="module")
def study(stream, tmp_path_factory):
    """The whole study: a 2-point grid of lora and mtl on order 1, both orders, a second seed on order 1."""
    out = tmp_path_factory.mktemp("study")
    tok, orders = stream["tok"], stream_orders(stream["spec"])
    lm = tiny_llama(tok.vocab_size)
    results = run_study(lm, tok, stream["cfg"], parse_method_specs("lora,mtl"), stream["spec"], orders, orders["1"],
                        [0], [0, 1], parse_grid(["x1,x3"]), out, "real", "tiny", resamples=300)
    return {"results": results, "out": out, "lm": lm, "files": write_report(results, out)}


def test_named_streams_are_the_papers_orders_and_bad_names_are_one_line():
    assert STREAMS["standard"] == {"1": ["dbpedia", "amazon", "yahoo", "agnews"], "2": ["dbpedia", "amazon", "agnews", "yahoo"],
                                   "3": ["yahoo", "amazon", "agnews", "dbpedia"]}
    assert STREAMS["trace"] == {"1": ["FOMC", "ScienceQA", "NumGLUE-cm", "NumGLUE-ds"]}
    assert pick_orders("standard", "3,1") == {"1": STREAMS["standard"]["1"], "3": STREAMS["standard"]["3"]}
    assert stream_orders("a.json,b.json;b.json,a.json") == {"1": ["a.json", "b.json"], "2": ["b.json", "a.json"]}
    with pytest.raises(ForgetlessError, match="unknown stream 'nope'"):
        stream_orders("nope")
    with pytest.raises(ForgetlessError, match="stream standard has orders 1, 2, 3; got --orders '4'"):
        pick_orders("standard", "4")
    with pytest.raises(ForgetlessError, match="same tasks"):
        stream_orders("a.json,b.json;a.json,c.json")


def test_validation_rows_are_neither_trained_on_nor_test_rows(stream):
    norm = lambda examples: {" ".join(ex.prompt.split()) for ex in examples}  # noqa: E731
    loaded = load_stream(scored_on_config(stream, stream["a"]), stream["tok"])
    task, dev = loaded.tasks[0], loaded.dev[0]
    full = load_task(stream["a"])
    assert len(full.test) == 10  # the test prompt that repeats a training prompt (up to spaces) is left out
    assert [ex.prompt for ex in dev.test] == [ex.prompt for ex in full.train[-5:-1]]  # the repeated prompt too
    assert not norm(dev.test) & norm(task.train) and not norm(dev.test) & norm(task.test)
    assert not norm(task.train) & norm(task.test) and len(task.train) == len(full.train) - 5
    graded = scored_on(loaded, "validation")  # an lr grid's arms score these rows in place of the test rows
    assert graded.tasks[0].test == dev.test and graded.tasks[0].train == task.train and not graded.held_out
    assert graded.general.windows is loaded.general.dev_windows
    made = InstructionTask("made", [Example(f"q{i}", "y") for i in range(6)], [Example("q5", "y")], ["y", "n"])
    assert [ex.prompt for ex in split_dev(made, 2)[1].test] == ["q4"]  # q5 is a test prompt: never a validation row
    with pytest.raises(ForgetlessError, match="needs them: give --data-dev-rows"):
        scored_on(load_stream(build_config("real", {"data": {**data_of(stream), "dev_rows": 0}}), stream["tok"]),
                  "validation")


def scored_on_config(stream, *tasks):
    return build_config("real", {"model": {"block_size": 32}, "data": {**data_of(stream), "tasks": list(tasks)}})


def data_of(stream):
    d = stream["cfg"].data
    return {"general": d.general, "eval_windows": 4, "dev_rows": d.dev_rows, "held_out_tasks": [], "tasks": [stream["a"]]}


def test_the_lr_grid_and_its_rule_ties_going_to_the_lower_lr(stream):
    assert choose([(1e-3, 50.0), (3e-4, 50.0), (3e-3, 40.0)]) == 3e-4                 # a tie: the lower lr
    assert choose([(1e-3, 50.0), (3e-4, 50.0 - 1e-12), (3e-3, 40.0)]) == 3e-4         # within 1e-9 is a tie
    assert choose([(1e-3, 50.0), (3e-4, 49.0), (3e-3, 40.0)]) == 1e-3                 # else the best
    cfg = stream["cfg"]
    lora, mtl, replay, moram = parse_method_specs("lora,mtl,seq-lora[mix=0.2],moram[lr=5e-3]")
    assert grid_lrs(parse_grid(None), lora, cfg) == [0.000333, 0.001, 0.003]          # lora's own 1e-3 x 1/3, 1, 3
    assert grid_lrs(parse_grid(None), mtl, cfg) == [1.67e-05, 5e-05, 0.00015]          # the preset's 5e-5 for full weights
    grid = parse_grid(["seq-lora[mix=0.2]=1e-4,3e-4", "moram=x1,x2"])
    assert grid_lrs(grid, replay, cfg) == [1e-4, 3e-4] and grid_lrs(grid, moram, cfg) == [0.005, 0.01]
    assert grid_lrs(grid, lora, cfg) == [0.000333, 0.001, 0.003]                      # the default for the others
    assert grid_lrs(parse_grid(["2e-4,1e-4"]), mtl, cfg) == [1e-4, 2e-4]
    assert parse_grid(["none"]) is None
    for bad in (["x"], ["fast"], ["1e-3,-1"], ["lora="]):
        with pytest.raises(ForgetlessError, match="--lr-grid"):
            parse_grid(bad)


def test_a_choice_at_an_end_of_the_grid_extends_it_a_step_at_a_time():
    start = [3.33e-4, 1e-3, 3e-3]
    assert next_point([(3.33e-4, 40.0), (1e-3, 47.0), (3e-3, 46.0)], start) is None            # inside: chosen
    assert next_point([(3.33e-4, 40.0), (1e-3, 46.5), (3e-3, 47.5)], start) == 0.009           # top end: x3 beyond
    assert next_point([(3.33e-4, 50.0), (1e-3, 46.5), (3e-3, 47.5)], start) == pytest.approx(1.11e-4)  # bottom end
    assert next_point([(3.33e-4, 47.0), (1e-3, 47.0), (3e-3, 40.0)], start) == pytest.approx(1.11e-4)  # tie: lower
    top = [(3.33e-4, 40.0), (1e-3, 46.5), (3e-3, 47.5), (9e-3, 48.0)]
    assert next_point(top, start) == 0.027 and next_point([*top, (0.027, 49.0)], start) is None  # EDGE_STEPS == 2
    assert next_point([*top, (0.027, 47.0)], start) is None                                    # inside again
    assert EDGE_STEPS == 2


def synthetic(rng, p, seed_sd, seeds, rows=100, tasks=2):
    """Runs of a method whose seed s answers test item j right iff u_j < p + delta_s: items drawn once (shared by
    the seeds), seeds' offsets delta_s ~ N(0, seed_sd); the true OP is 100 p."""
    delta = rng.normal(0, seed_sd, seeds)
    hits = []
    for _ in range(tasks):
        right = rng.random(rows)[None, :] < p + delta[:, None]                      # (S, n)
        hits.append(np.repeat(right[:, None, :], tasks + 1, 1))                     # (S, T+1, n): rows alike, BWT 0
    return bootstrap.Runs([str(i) for i in range(tasks)], hits, np.full(8, 2.0), np.full((seeds, 8), 2.0))


def coverage(rng, seed_sd, seeds, rows_only=False, reps=150):
    inside = 0
    for rep in range(reps):
        runs = synthetic(rng, 0.6, seed_sd, seeds)
        if rows_only:  # the seeds averaged first: an interval blind to their variance
            runs = bootstrap.Runs(runs.tasks, [h.mean(0, keepdims=True) for h in runs.hits], runs.before_loss,
                                  runs.after_loss[:1])
        op = bootstrap.intervals({"1": runs}, bootstrap.Draws(250, seed=rep))["op_tasks"]
        inside += op["lo"] <= 60.0 <= op["hi"]
    return inside / reps


def test_bootstrap_intervals_cover_the_truth_with_rows_and_seeds():
    """95 % intervals on synthetic runs of known variance: near 95 % coverage from the rows alone and from rows and
    seeds together; an interval blind to the seeds covers far less often (so the check can fail)."""
    rng = np.random.default_rng(0)
    assert 0.88 <= coverage(rng, 0.0, 1) <= 0.99
    assert 0.86 <= coverage(rng, 0.15, 10) <= 0.99
    assert coverage(rng, 0.15, 10, rows_only=True) <= 0.84
    runs = synthetic(rng, 0.6, 0.0, 1)
    same = bootstrap.paired({"1": runs}, {"1": runs}, bootstrap.Draws(100))["op_tasks"]
    assert same == {"mean": 0.0, "lo": 0.0, "hi": 0.0}  # paired: the same draws for both


def test_the_study_chooses_on_validation_then_runs_every_order(study, stream):
    results, out = study["results"], study["out"]
    grid = json.loads((out / "grid" / "results.json").read_text())
    assert grid["scored"] == "validation" and grid["held_out_tasks"] == []
    arm = json.loads((out / "grid" / "arms" / "lora[lr=0.001]" / "seed0.json").read_text())
    assert [len(h) for h in arm["r_hits"][0]] == [4, 4]                              # validation rows, not the 10 test rows
    for label, m in results["methods"].items():
        points = m["lr_grid"]  # x1, x3 and what the edge rule added: a choice inside, or EDGE_STEPS points at its end
        start = [p["lr"] for p in points if not p["added"]]
        assert len(start) == 2 and sum(p["chosen"] for p in points) == 1
        assert m["lr"] == choose([(p["lr"], p["op_tasks_dev"]) for p in points])
        lrs, pick = [p["lr"] for p in points], m["lr"]
        assert lrs == sorted(lrs) and all((p["lr"] not in start) == p["added"] for p in points)
        beyond = sum(lr > max(start) for lr in lrs) if pick == lrs[-1] else sum(lr < min(start) for lr in lrs)
        assert pick not in (lrs[0], lrs[-1]) or beyond == EDGE_STEPS
        assert next(p for p in points if p["chosen"])["edge"] == (pick in (lrs[0], lrs[-1]))
        for p in points:  # each point's OP minus the chosen one's, paired on the validation rows
            diff = p["op_vs_chosen"]
            assert diff["mean"] == pytest.approx(p["op_tasks_dev"] - m["lr_grid"][lrs.index(pick)]["op_tasks_dev"])
            assert diff == {"mean": 0.0, "lo": 0.0, "hi": 0.0} if p["chosen"] else diff["lo"] <= diff["mean"] <= diff["hi"]
        assert m["arm"] == next(p["arm"] for p in points if p["chosen"])
        assert m["orders"]["1"]["seeds"] == [0, 1] and m["orders"]["2"]["seeds"] == [0]
        assert m["orders"]["2"]["tasks"] == [stream["b"], stream["a"]]
        saved = [json.loads((out / f"order{k}" / "arms" / m["arm"] / f"seed{s}.json").read_text())
                 for k, s in (("1", 0), ("1", 1), ("2", 0))]
        assert all(len(h) == 10 for a in saved for row in a["r_hits"] for h in row)  # every test row, scored
        for key in ("op_tasks", "bwt_tasks", "general_ppl_change"):  # point estimates = R's metrics (PPL: to float32)
            assert m["intervals"][key]["mean"] == pytest.approx(m[key]["mean"], abs=1e-5)
            assert m["intervals"][key]["lo"] <= m["intervals"][key]["mean"] <= m["intervals"][key]["hi"]
        over = m["over_orders"]["op_tasks"]["mean"]
        assert over == pytest.approx((m["orders"]["1"]["op_tasks"] + m["orders"]["2"]["op_tasks"]) / 2)
    assert results["methods"]["mtl"]["intervals"]["bwt_tasks"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}  # joint arm
    assert results["methods"]["lora"]["paired"]["vs"] == "mtl" and "paired" not in results["methods"]["mtl"]
    assert results["study"]["lr_rule"].startswith("the grid point with the highest validation OP")
    spent, arms = results["study"]["compute"], [json.loads(f.read_text()) for f in out.glob("*/arms/*/seed*.json")]
    assert spent["arms"] == len(arms) and spent["wall_s"] == pytest.approx(sum(a["wall_s"] for a in arms))
    assert spent["codes"] == sorted({a["code"] for a in arms}) and f"Compute: {len(arms)} arms" in study_markdown(
        study["results"])
    assert results["study"]["references"] == []
    assert all(round_trips(folder / "results.json") for folder in (out, out / "grid", out / "order1", out / "order2"))


def test_the_table_prints_published_rows_as_references(study):
    results = study["results"].with_keys(study={**study["results"]["study"], "stream": "standard",
                                                "references": references("standard")})
    text = study_markdown(results)
    assert "| MTL | T5-large | 80.0 |" in text and "| InfLoRA | LLaMA-2-7B-chat | 79.6 |" in text
    assert "not a like-for-like comparison" in text and f"| lora | {results['methods']['lora']['lr']:.3g} |" in text
    ours, published = terminal_tables(results, "study", "caption")
    assert [c.header for c in ours.columns][:2] == ["method", "lr (chosen on validation)"] and ours.row_count == 3
    assert list(ours.columns[0].cells)[0] == "base model, untrained" and list(ours.columns[-1].cells)[0] == "0"
    base, R = results["study"]["base"], results["methods"]["mtl"]["orders"]["1"]["r_matrix"]
    assert base["intervals"]["op_tasks"]["mean"] == pytest.approx(np.mean(R[0][1:]))  # the base's scores: row 0 of R
    assert base["over_orders"]["op_tasks"]["mean"] == pytest.approx(np.mean(list(base["orders"].values())))
    lora = results["methods"]["lora"]
    heads, rows = table_rows(results)  # every metric as the mean over orders and per order; order 1's 2 seeds too
    row = dict(zip(heads, next(r for r in rows if r[0] == "lora")))
    assert row["BWT, mean over orders"].startswith(f"{lora['over_orders']['bwt_tasks']['mean']:+.1f} [")
    assert row["general PPL change per order (1 / 2)"] == " / ".join(
        f"{100 * lora['orders'][k]['general_ppl_change']:+.1f}" for k in ("1", "2"))
    assert row["BWT, order 1 (2 seeds)"].startswith(f"{lora['intervals']['bwt_tasks']['mean']:+.1f} [")
    joint = dict(zip(heads, next(r for r in rows if r[0] == "mtl")))  # the ceiling's BWT is 0 by definition: a dash
    assert joint["BWT, mean over orders"] == joint["BWT per order (1 / 2)"] == "—"
    assert text.split("| lora |")[1].splitlines()[0].endswith(f" {lora['trainable_params']:,} |")  # tiny: under 10k
    assert published.row_count == 8 and list(published.columns[2].cells)[-1] == "80.9"
    assert len(terminal_tables(study["results"], "study", "caption")) == 1  # no published rows: ours alone
    trace = {r["method"] + " " + r["model"]: r for r in references("trace")}
    assert trace["MoRAM LLaMA-2-7B-Chat"]["op"] == 44.54 and trace["MoRAM LLaMA-2-7B-Chat"]["bwt"] == -1.37
    assert trace["OSF Llama-3.1-8B"]["op"] == 53.4 and trace["OSF Llama-3.1-8B"]["bwt"] is None
    assert "No published rows" in (study["out"] / "results.md").read_text()
    assert "the test rows' sampling error and the seeds'" in seeds_note(results)  # order 1: 2 seeds
    one = results.with_keys(seeds=[0], study={**results["study"], "seeds_per_order": 1})
    assert "one seed per order: they hold the test rows' sampling error only" in study_markdown(one)


def test_the_figures_and_files_are_written(study):
    names = {f.name for f in study["files"]}
    assert {"results.json", "results.md", "results.csv", "r_matrix.png", "op_vs_bwt.png"} <= names
    assert all(f.stat().st_size > 1000 for f in study["files"] if f.suffix == ".png")
    assert json.loads((study["out"] / "results.json").read_text())["study"]["main_order"] == "1"


def test_the_plan_counts_arms_and_minutes_and_what_is_saved(study, stream, tmp_path):
    orders, tok = stream_orders(stream["spec"]), stream["tok"]
    specs = parse_method_specs("lora,mtl")
    fresh = plan_study(study["lm"], tok, stream["cfg"], specs, orders, orders["1"], [0], [0, 1, 2], parse_grid(None),
                       tmp_path, "tiny")
    for row in fresh["rows"]:
        assert row["grid"] == [3, 3] and row["orders"] == [2, 2] and row["extra seeds"] == [2, 2]
        assert row["step_s"] > 0 and row["minutes"] == pytest.approx(
            (3 * 60 * row["arm_min"]["validation"] + 4 * 60 * row["arm_min"]["test"]) / 60)
    assert fresh["total_min"] == pytest.approx(sum(r["minutes"] for r in fresh["rows"]) + fresh["before_min"])
    text = plan_markdown(fresh)
    assert "| lora | 0.000333, 0.001, 0.003 |" in text and "**total: 14 arms (14 left)**" in text
    done = plan_study(study["lm"], tok, stream["cfg"], specs, orders, orders["1"], [0], [0, 1], parse_grid(["x1,x3"]),
                      study["out"], "tiny")
    arms = 6 + sum(len(m["lr_grid"]) for m in study["results"]["methods"].values())  # 6: the orders' and order 1's seed
    assert [r["minutes"] for r in done["rows"]] == [0, 0] and f"**total: {arms} arms (0 left)**" in plan_markdown(done)


def test_the_budget_keeps_the_minimum_and_adds_the_seeds_that_fit(study, stream, tmp_path):
    orders, tok = stream_orders(stream["spec"]), stream["tok"]
    plan = plan_study(study["lm"], tok, stream["cfg"], parse_method_specs("lora,mtl"), orders, orders["1"], [0],
                      [0, 1, 2], parse_grid(None), tmp_path, "tiny")
    seed_min = sum(r["arm_min"]["test"] for r in plan["rows"])  # one more seed on order 1, every method
    minimum = plan["total_min"] - 2 * seed_min
    assert fit_budget(plan, 60 * (minimum + 1.5 * seed_min), [0], [0, 1, 2])[0] == [0, 1]
    assert fit_budget(plan, 60 * (minimum + 2 * seed_min) + 1, [0], [0, 1, 2])[0] == [0, 1, 2]
    seeds, line = fit_budget(plan, 60 * minimum / 2, [0], [0, 1, 2])
    assert seeds == [0] and "over the budget: it runs anyway" in line and "2 more seed(s) on order 1" in line
    assert parse_budget("1h30m") == 5400 and parse_budget("90m") == 5400 and parse_budget("45s") == 45
    assert run_order({"1": [], "2": []}, [0], [0, 1]) == [("1", [0]), ("2", [0]), ("1", [0, 1])]


def test_the_folder_reloads_into_the_same_table_from_its_saved_arms(study, stream, monkeypatch, tmp_path):
    """Run again on a folder holding only the study's records (each arm's seed JSON and each run's before.json, what
    scripts/study-standard.sh keeps in git for a new machine): every arm is reused (none runs); the table,
    results.json (but its date) and the guide's rows are the same; the machine each arm ran on is in results.json."""
    def no_arm(*args, **kwargs):
        raise AssertionError("an arm ran again")
    monkeypatch.setattr(instruct, "instruction_arm", no_arm)
    records = tmp_path / "records"
    for path in [*study["out"].glob("*/arms/*/seed*.json"), *study["out"].glob("*/before.json")]:
        (records / path.relative_to(study["out"])).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, records / path.relative_to(study["out"]))
    tok, orders = stream["tok"], stream_orders(stream["spec"])
    again = run_study(study["lm"], tok, stream["cfg"], parse_method_specs("lora,mtl"), stream["spec"], orders,
                      orders["1"], [0], [0, 1], parse_grid(["x1,x3"]), records, "real", "tiny", resamples=300)
    assert study_markdown(again).replace(again["date"], "") == study_markdown(study["results"]).replace(
        study["results"]["date"], "")
    for label, m in study["results"]["methods"].items():
        assert again["methods"][label]["intervals"] == m["intervals"]
    write_report(again, tmp_path, False)
    first, second = (json.loads((folder / "results.json").read_text()) for folder in (study["out"], tmp_path))
    assert {**second, "date": None} == {**first, "date": None}
    assert study_rows(second, "x") == study_rows(first, "x")
    assert first["study"]["machines"] == [machine_text()]


def test_the_guide_rows_are_generated_from_a_studys_results(study):
    """The guide's rows on a stream: the best arm with and without old rows, its numbers and the study's scale, read
    from results.json; the summary the guide keeps gives the same rows and replaces the hand-written stream row."""
    results = json.loads((study["out"] / "results.json").read_text())
    (row,) = study_rows(results, "the-study")  # lora and the ceiling mtl: no arm replays old rows
    lora, mtl = results["methods"]["lora"], results["methods"]["mtl"]
    assert (row.method, row.old_data, row.stream, row.section) == (lora["arm"], False, True, "the-study")
    assert settings(row).lr == lora["lr"] and settings(row).mix == 0  # Trainer's settings: the lr the grid chose
    over = lora["over_orders"]
    assert row.evidence.startswith(f"OP {over['op_tasks']['mean']:.1f} [{over['op_tasks']['lo']:.1f}, "
                                   f"{over['op_tasks']['hi']:.1f}], BWT {over['bwt_tasks']['mean']:+.1f}")
    assert f"general perplexity {100 * over['general_ppl_change']['mean']:+.1f}" in row.evidence
    assert f"the ceiling mtl: OP {mtl['over_orders']['op_tasks']['mean']:.1f}" in row.evidence
    assert row.scale == ("tiny, a task stream, 2 order(s) of 2 tasks, preset real (2 steps of batch 4 per task, auto), "
                         "1 seed(s) per order, 1 more on order 1")
    replay = {**results, "methods": {**results["methods"], "lora": {**lora, "options": {**lora["options"], "mix": 0.2}}}}
    assert [(r.method, r.old_data) for r in study_rows(replay, "x")] == [(lora["arm"], True)]  # it replays: old data
    ewc = {**results, "methods": {**results["methods"], "lora": {**lora, "arm": "lora[lr=0.003]+ewc",
                                                                   "reads_previous": True}}}
    (fisher,) = study_rows(ewc, "x")  # trains on no old rows, but its Fisher reads the last task's: old data
    assert (fisher.method, fisher.old_data) == ("lora[lr=0.003;mix=0]+ewc", True)  # at the mix it trained at
    assert "trains on no old rows" in fisher.evidence and cli_text(fisher).endswith("--retain old.txt`")
    assert settings(fisher) == Settings("lora+ewc", 0.003, 0.0, True)  # Trainer: previous=old, no mixed rows
    worse = {**lora, "over_orders": {**over, "op_tasks": {k: v - 1 for k, v in over["op_tasks"].items()}}}
    pairs = {"lora": {"lora2": {"mean": 1.0, "lo": 0.5, "hi": 1.5}}}  # lora minus lora2, paired
    two_arms = {**results, "methods": {**results["methods"], "lora2": worse},
                "study": {**results["study"], "op_differences": {"over": "over_orders", "pairs": pairs}}}
    (two,) = study_rows(two_arms, "x")
    assert two.method == lora["arm"] and two.evidence.endswith(  # the runner-up, paired, its perplexity beside its OP
        f"; next lora2: OP {over['op_tasks']['mean'] - 1:.1f} [{over['op_tasks']['lo'] - 1:.1f}, "
        f"{over['op_tasks']['hi'] - 1:.1f}] (paired difference +1.0 [+0.5, +1.5]), general perplexity "
        f"{100 * over['general_ppl_change']['mean']:+.1f} [{100 * over['general_ppl_change']['lo']:+.1f}, "
        f"{100 * over['general_ppl_change']['hi']:+.1f}] %")
    pairs["lora"]["lora2"]["lo"] = 0.0  # an interval that reaches 0 says so
    assert "(paired difference +1.0 [+0.0, +1.5], not separated)" in study_rows(two_arms, "x")[0].evidence
    top = max(p["lr"] for p in lora["lr_grid"])  # the choice still at the grid's top end after the edge rule
    edge = [{**p, "chosen": p["lr"] == top, "edge": p["lr"] == top} for p in lora["lr_grid"]]
    (at_edge,) = study_rows({**results, "methods": {**results["methods"], "lora": {**lora, "lr_grid": edge}}}, "x")
    assert ", chosen on validation rows, at the grid's top end: a higher lr was not tried)" in at_edge.evidence
    assert "grid's" not in row.evidence or any(p["chosen"] and p["edge"] for p in lora["lr_grid"])
    low, high = sorted(lora["lr_grid"], key=lambda p: p["lr"])[:2]  # the lower lr within the rows' error, kinder to text
    near = {"lr": low["lr"], "chosen": False, "op_vs_chosen": {"mean": -1.0, "lo": -3.0, "hi": 1.0},
            "general_ppl_change_dev": 0.1}
    grid = [near, {**high, "chosen": True, "edge": False, "general_ppl_change_dev": 0.5}]
    (kinder,) = study_rows({**results, "methods": {**results["methods"], "lora": {**lora, "lr_grid": grid}}}, "x")
    assert (f"; at lr {low['lr']:.3g}, within the validation rows' sampling error of it (OP -1.0 [-3.0, +1.0]), "
            "validation general perplexity rose +10.0 % against +50.0 %") in kinder.evidence
    for other in ({"op_vs_chosen": {"mean": -4.0, "lo": -6.0, "hi": -2.0}}, {"general_ppl_change_dev": 0.6}):
        grid = [{**near, **other}, grid[1]]  # separated from the choice, or no kinder to general text: nothing said
        (plain,) = study_rows({**results, "methods": {**results["methods"], "lora": {**lora, "lr_grid": grid}}}, "x")
        assert "within the validation rows' sampling error" not in plain.evidence
    tie = [{**grid[1], "op_tasks_dev": 50.0}, {**high, "lr": 3 * high["lr"], "chosen": False, "op_tasks_dev": 50.0,
                                                "general_ppl_change_dev": 0.9}]  # equal OP: the lower lr chosen
    (tied,) = study_rows({**results, "methods": {**results["methods"], "lora": {**lora, "lr_grid": tie}}}, "x")
    assert (f"; tied on validation OP with lr {3 * high['lr']:.3g} (ties go to the lower lr), where validation general "
            "perplexity rose +90.0 % against +50.0 %") in tied.evidence
    assert f"; {lora['trainable_params'] / 1e6:.2f} M trainable parameters on the last task" in row.evidence
    kept = summary(results, "forgetless study ...", {"section": "the-study", "commit": "abc"})
    kept = json.loads(json.dumps(kept))
    assert study_rows(kept, "the-study") == [row] and len(json.dumps(kept)) < len(json.dumps(results)) / 2
    rows = guide_rows(kept)
    assert [a for a in rows if not a.old_data and a.stream] == [row]  # the hand-written stream row without old data
    assert [a for a in rows if a != row] == [a for a in MEASURED if a.old_data or not a.stream]  # the others stay
    (replayed,) = study_rows(replay, "the-study")  # a side without a hand-written stream row: after its first row
    rows = guide_rows(json.loads(json.dumps(summary(replay, "forgetless study ...", {"section": "the-study"}))))
    first_old = next(a for a in MEASURED if a.old_data)
    assert rows[rows.index(first_old) + 1] == replayed and [a for a in rows if a != replayed] == MEASURED


def test_the_plain_answers_follow_the_means(study):
    """results.md answers the study's questions from results.json: the arm closest to the ceiling without old data
    (and with it, once an arm replays), and the arms with BWT >= -2 and OP within 2 points of the ceiling."""
    results = json.loads((study["out"] / "results.json").read_text())
    lora, mtl = (results["methods"][k]["over_orders"] for k in ("lora", "mtl"))
    gap = lora["op_tasks"]["mean"] - mtl["op_tasks"]["mean"]
    closest, kept = study_answers(results)
    assert closest.startswith("Closest to the ceiling without old data: `lora`") and f"{gap:+.1f} [" in closest
    paired = results["methods"]["lora"]["paired_over_orders"]["op_tasks"]  # the gap, paired over rows and orders
    assert paired["mean"] == pytest.approx(gap) and f"{paired['lo']:+.1f}, {paired['hi']:+.1f}] points, paired" in closest
    assert ("not separated from the ceiling" in closest) == (paired["lo"] <= 0 <= paired["hi"])
    pairs = results["study"]["op_differences"]["pairs"]
    assert pairs["lora"]["mtl"]["mean"] == pytest.approx(-pairs["mtl"]["lora"]["mean"])
    assert pairs["lora"]["mtl"]["lo"] == pytest.approx(-pairs["mtl"]["lora"]["hi"])
    keeps = lora["bwt_tasks"]["mean"] >= -2 and gap >= -2
    assert kept.endswith(": `lora`." if keeps else ": none.")
    strict = study_answers(results, points=-1e9)[-1]  # no arm can keep BWT above +1e9
    assert strict.endswith(": none.")
    replay = {**results, "methods": {**results["methods"], "lora": {**results["methods"]["lora"], "options": {
        **results["methods"]["lora"]["options"], "mix": 0.2}}}}
    assert study_answers(replay)[0].startswith("Closest to the ceiling with old data: `lora`")
    fisher = {**results, "methods": {**results["methods"], "lora": {**results["methods"]["lora"], "reads_previous": True}}}
    assert study_answers(fisher)[0].startswith("Closest to the ceiling with old data: `lora`")  # EWC's Fisher reads them
    assert "`lora` trains on no old rows" in study_answers(fisher)[0]
    assert results["methods"]["mtl"]["joint"] and not results["methods"]["lora"]["joint"]
    no_ceiling = {**results, "methods": {"lora": results["methods"]["lora"]}}
    assert study_answers(no_ceiling)[0].startswith("No joint ceiling")
    assert all(f"- {line}" in (study["out"] / "results.md").read_text() for line in study_answers(results))


def test_a_saved_arm_is_reused_when_the_code_only_added_config_keys(study):
    path = study["out"] / "order2" / "arms" / study["results"]["methods"]["lora"]["arm"] / "seed0.json"
    arm = json.loads(path.read_text())
    config = arm["run_config"]
    assert saved_arm(path, config)["config_hash"] == stable_hash(config)
    newer = {**config, "config": {**config["config"], "adapt": {**config["config"]["adapt"], "a_new_field": 1}},
             "also_new": True}
    assert saved_arm(path, newer)["config_added"] == ["also_new", "config.adapt.a_new_field"]
    changed = {**config, "config": {**config["config"], "adapt": {**config["config"]["adapt"], "steps": 99}}}
    assert saved_arm(path, changed) is None and saved_arm(path, {**changed, "also_new": True}) is None


def test_study_errors_are_one_line(tmp_path, stream):
    runner = CliRunner()
    cases = [(["nope"], "unknown stream 'nope'"), (["standard", "--orders", "4"], "has orders 1, 2, 3"),
             (["standard", "--model", "byte-gpt"], "on a pretrained model"),
             (["standard", "--seeds", "2", "--order1-seeds", "1"], "--order1-seeds >= --seeds"),
             (["standard", "--data-dev-rows", "0"], "chooses on validation rows"),
             (["standard", "--lr-grid", "fast"], "--lr-grid 'fast'"),
             (["standard", "--budget", "soon"], "--budget 'soon': give a wall-clock time"),
             (["standard", "--methods", "lora", "--paired-with", "mtl"], "--paired-with mtl: not among")]
    for args, message in cases:
        result = runner.invoke(app, ["study", *args, "--out", str(tmp_path / "x")])
        assert result.exit_code == 2, (args, result.output)
        assert len(result.output.strip().splitlines()) <= 2 and re.search(message, result.output), result.output
    assert not (tmp_path / "x").exists()


def test_saving_the_records_of_a_folder_that_is_not_a_study_is_one_line(tmp_path):
    """scripts/study-standard.sh save OUT: a folder without OUT/standard is refused in one line, before any copy."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "study-standard.sh"
    done = subprocess.run(["bash", str(script), "save", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "standard does not exist: give the study's folder" in done.stderr
